"""The first exchange on a newly formed pair: each side proves it holds the cluster secret, before any KV moves.

Why: the rendezvous TCPStore has no authentication, and any client of it can list its keys
(`TCPStore.list_keys`), so an unguessable pair id keeps nobody out of the store. Someone who reads a pair's
keys there can race to join the pair as either rank. So the pair is not trusted until each side has received
the other's proof, HMAC-SHA256(cluster secret, domain ‖ pair id ‖ rank of the sender), 32 bytes under tag 0
(the server's transfers start at tag 1). Order: the decode rank sends first, the prefill rank checks it
and only then sends its own, which the decode rank checks. A pair whose peer sends a wrong proof (or none,
within the timeout) is closed and refused (PairRefused): the prefill side never sends KV to a stranger,
the decode side never imports KV from one.

Not covered: an attacker who sits on both paths (joins as rank 1 with the prefill worker and as rank 0
with the decode worker) can relay the two proofs, which do not change within a pair; that attacker could
read gloo's plaintext bytes anyway. docs/security.md says what to do (a private network, WireGuard/IPsec).
"""

from __future__ import annotations

import hashlib
import hmac

import torch

from shared.kv.transfer.pair import DECODE_RANK, Pair

PROOF_TAG = 0
PROOF_BYTES = 32
_DOMAIN = b"pdserve/kv-pair-proof\n"


class PairRefused(RuntimeError):
    """The peer on a pair did not prove it holds the cluster secret: the pair is closed."""


class PairProofs:
    """Makes and checks pair proofs under one cluster secret (bytes, or a str taken as UTF-8)."""

    def __init__(self, secret: bytes | str) -> None:
        self._key = secret.encode() if isinstance(secret, str) else bytes(secret)

    def proof(self, pair_id: str, rank: int) -> bytes:
        return hmac.new(self._key, _DOMAIN + f"{pair_id}\n{rank}".encode(), hashlib.sha256).digest()

    def confirm(self, pair: Pair) -> None:
        """Blocking: exchange proofs on a just-joined pair (see the module doc); PairRefused, with the pair
        closed, when the peer's proof is wrong or does not come within the pair's timeout."""
        try:
            if pair.rank == DECODE_RANK:
                self._send(pair)
                self._check(pair)
            else:
                self._check(pair)
                self._send(pair)
        except PairRefused:
            pair.close()
            raise
        except Exception as e:  # the peer sent nothing in time, or left
            pair.close()
            raise PairRefused(f"pair {pair.pair_id!r}: the peer sent no proof: {e}") from e

    def _send(self, pair: Pair) -> None:
        ours = torch.frombuffer(bytearray(self.proof(pair.pair_id, pair.rank)), dtype=torch.uint8)
        pair.send([ours.to(pair.backend.device)], PROOF_TAG)

    def _check(self, pair: Pair) -> None:
        theirs = torch.empty(PROOF_BYTES, dtype=torch.uint8, device=pair.backend.device)
        pair.recv([theirs], PROOF_TAG)
        expected = self.proof(pair.pair_id, pair.peer)
        if not hmac.compare_digest(bytes(theirs.cpu().tolist()), expected):
            role = "decode" if pair.peer == DECODE_RANK else "prefill"
            raise PairRefused(
                f"the {role} side of pair {pair.pair_id[:24]!r}… sent a wrong proof: it does not hold the "
                "cluster secret (a stranger joined through the rendezvous store?)"
            )
