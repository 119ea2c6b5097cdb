"""Prefix-cache block hashes: one definition for the engine (which cached blocks a request can reuse), the
workers (which blocks they announce as held) and the gateway (which worker holds a prompt's prefix). Torch-free:
the gateway imports it.

A full block of `block_size` tokens is named by a hash chained over every token up to its end and over what else
changes its K/V, so two blocks with one hash hold the same K/V:

    root   = H("pdserve-prefix-v1", namespace, salt)          # namespace: the model as served; salt: see below
    h[0]   = H(root, tokens[0:B])
    h[i]   = H(h[i-1], tokens[i*B:(i+1)*B])

Only full blocks are named (a partial last block is recomputed). `salt` is what isolates tenants and requests
that ask for it (`request_salt`): one tenant's prompt can never hit another's blocks, so cache timing tells
nothing across tenants (docs/security.md). Hashes are 64-bit (blake2b, 8 bytes): unkeyed, but a collision needs
2^32 blocks for even odds, and the salt, not secrecy of the hash, is what separates tenants.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = b"pdserve-prefix-v1"
_SEP = b"\x1f"  # between the root's fields: no field of one root can run into the next


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def request_salt(tenant: str | None, cache_salt: str | None) -> str:
    """The salt of a request's hashes: its tenant (API keys on) and its own `cache_salt`, either may be absent.
    Distinct (tenant, cache_salt) pairs give distinct salts (the separator cannot occur in a tenant id)."""
    return f"{tenant or ''}\x1f{cache_salt or ''}" if tenant or cache_salt else ""


def root_hash(namespace: str, salt: str = "") -> int:
    """The parent of a prompt's first block: the model as served (`namespace`) and the request's salt."""
    return _digest(HASH_VERSION, _SEP, namespace.encode(), _SEP, salt.encode())


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block whose predecessor's hash is `parent` (the root for the first block)."""
    return _digest(parent.to_bytes(8, "little"), struct.pack(f"<{len(tokens)}q", *tokens))


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: int, start: int = 0, parent: int | None = None
) -> list[int]:
    """The hashes of the full blocks of `token_ids`, from block `start` on (`parent`: block start-1's hash, the
    root when start is 0). A partial last block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start and parent is None:
        raise ValueError("hashing from a later block needs its predecessor's hash")
    h = root if parent is None else parent
    out: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        h = block_hash(h, token_ids[i * block_size : (i + 1) * block_size])
        out.append(h)
    return out
