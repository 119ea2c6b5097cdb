"""KV transfer tickets: short-lived credentials signed with the cluster secret (HMAC-SHA256).

Every prefill and decode worker of a deployment shares one secret. The decode worker, which knows its own
id, mints a ticket for each call it makes; the prefill worker's transfer server verifies it. Two kinds:
- a *pull* ticket binds (decode worker id, request id, expiry): it lets that worker pull that request's KV;
- a *connect* ticket binds (decode worker id, expiry): it lets that worker open a transfer pair.
A ticket of one kind never passes for the other (a connect ticket names no request).

Shape: `v2.<claims>.<mac>`, both parts unpadded base64url; claims = JSON `[worker, request or null,
expiry in ms since the epoch, nonce]`; mac = HMAC-SHA256(secret, domain || "v2." || claims). The nonce (16
random bytes, base64url) makes every ticket unique: the verifier remembers the nonces it accepted until they
expire and refuses a second use (shared/kv/replay.py; `verify` returns the claims it needs). The claims are
readable by whoever holds the ticket (they are not secret, only unforgeable). Verification checks the
signature (constant time) before it reads the claims, then worker, request and expiry, and says which
check failed (`TicketError.reason`) without ever repeating the ticket itself.

Expiry uses wall clocks on two machines: a small skew allowance (`skew_s`) absorbs clock drift.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from enum import StrEnum

import msgspec

VERSION = "v2"  # v1 tickets had no nonce
DEFAULT_LIFETIME_S = 60.0  # a decode worker mints right before the call: a minute covers any retry
DEFAULT_SKEW_S = 5.0  # clock drift between the minting and the verifying machine
MIN_SECRET_BYTES = 16
MAX_TICKET_CHARS = 4096  # a longer string is not a ticket: refused before any decoding
NONCE_BYTES = 16
_DOMAIN = b"pdserve/kv-transfer-ticket\n"  # keeps these MACs apart from anything else keyed by the secret


class TicketReason(StrEnum):
    MISSING = "missing"  # no ticket at all
    MALFORMED = "malformed"  # not of the ticket's shape
    FORGED = "forged"  # the signature does not match: another secret, or altered claims
    EXPIRED = "expired"  # signed, but past its expiry (plus the skew allowance)
    WRONG_WORKER = "wrong_worker"  # signed for another decode worker
    WRONG_REQUEST = "wrong_request"  # signed for another request, or the other kind of ticket
    REPLAYED = "replayed"  # valid, but used once already (the verifier's replay cache, shared/kv/replay.py)
    OVERLOADED = "overloaded"  # the replay cache is full of unexpired tickets: refused rather than forgotten


class TicketError(Exception):
    """A ticket was refused; `reason` says which check failed. The message never contains the ticket."""

    def __init__(self, reason: TicketReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Claims(msgspec.Struct, array_like=True, frozen=True):
    """What a ticket says (readable by its holder; only the signature makes it trustworthy)."""

    worker_id: str
    request_id: str | None  # None: a connect ticket
    expires_ms: int
    nonce: str  # unique per ticket: the key of the verifier's replay cache

    @property
    def expires_s(self) -> float:
        return self.expires_ms / 1000


class Tickets:
    """Mints and verifies tickets under one cluster secret (bytes, or a str taken as UTF-8)."""

    def __init__(
        self, secret: bytes | str, lifetime_s: float = DEFAULT_LIFETIME_S, skew_s: float = DEFAULT_SKEW_S
    ) -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret or b"")
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes (got {len(key)}): "
                "KV transfer tickets are signed with it"
            )
        if lifetime_s <= 0 or skew_s < 0:
            raise ValueError(f"lifetime_s must be positive and skew_s >= 0, got {lifetime_s} and {skew_s}")
        self._key = key
        self.lifetime_s = lifetime_s
        self.skew_s = skew_s

    def mint(self, worker_id: str, request_id: str | None = None, *, now: float | None = None) -> str:
        """A ticket for `worker_id` to pull `request_id`'s KV, or (request_id None) to connect."""
        if not worker_id or request_id == "":
            raise ValueError("a ticket needs a worker id, and a request id unless it is a connect ticket")
        expires_ms = int(((time.time() if now is None else now) + self.lifetime_s) * 1000)
        nonce = _b64(secrets.token_bytes(NONCE_BYTES))
        claims = _b64(msgspec.json.encode(Claims(worker_id, request_id, expires_ms, nonce)))
        return f"{VERSION}.{claims}.{_b64(self._mac(claims))}"

    def verify(self, ticket: str, worker_id: str, request_id: str | None = None, *, now: float | None = None) -> Claims:
        """The claims of `ticket` if it lets `worker_id` pull `request_id` (None: connect); else TicketError.
        Single use is the caller's to enforce (ReplayCache.admit with the claims' nonce and expiry)."""
        if not ticket:
            raise TicketError(TicketReason.MISSING, "no ticket")
        claims_part, mac = self._split(ticket)
        if not hmac.compare_digest(mac, self._mac(claims_part)):
            raise TicketError(TicketReason.FORGED, "the ticket's signature does not match this cluster's secret")
        try:
            claims = msgspec.json.decode(_unb64(claims_part), type=Claims)
        except (msgspec.DecodeError, ValueError):  # signed by a holder of the secret, yet unreadable
            raise TicketError(TicketReason.MALFORMED, "the ticket's claims cannot be read") from None
        if claims.worker_id != worker_id:
            raise TicketError(
                TicketReason.WRONG_WORKER,
                f"the ticket was issued to worker {_short(claims.worker_id)}, not {_short(worker_id)}",
            )
        if claims.request_id != request_id:
            raise TicketError(TicketReason.WRONG_REQUEST, f"{_kind(claims.request_id)}, not {_kind(request_id)}")
        late_s = (time.time() if now is None else now) - claims.expires_ms / 1000
        if late_s > self.skew_s:
            raise TicketError(TicketReason.EXPIRED, f"the ticket expired {late_s:.1f} s ago")
        return claims

    def _mac(self, claims_part: str) -> bytes:
        return hmac.new(self._key, _DOMAIN + f"{VERSION}.{claims_part}".encode(), hashlib.sha256).digest()

    @staticmethod
    def _split(ticket: str) -> tuple[str, bytes]:
        """(claims part, MAC bytes); MALFORMED unless the string has the ticket's shape."""
        parts = ticket.split(".") if len(ticket) <= MAX_TICKET_CHARS else []
        if len(parts) != 3 or parts[0] != VERSION:
            raise TicketError(TicketReason.MALFORMED, f"not a {VERSION} ticket")
        try:
            _unb64(parts[1])
            mac = _unb64(parts[2])
        except ValueError:
            raise TicketError(TicketReason.MALFORMED, "the ticket is not base64url") from None
        return parts[1], mac


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict inverse of _b64: one spelling per byte string (no padding, no stray or non-canonical characters)."""
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        raise ValueError("not base64url") from None
    if _b64(raw) != text:
        raise ValueError("not canonical base64url")
    return raw


def _kind(request_id: str | None) -> str:
    return "a connect ticket" if request_id is None else f"a ticket for request {_short(request_id)}"


def _short(text: str, limit: int = 80) -> str:
    """repr of an untrusted id, cut short: messages and logs stay one readable line."""
    return repr(text if len(text) <= limit else text[:limit] + "…")
