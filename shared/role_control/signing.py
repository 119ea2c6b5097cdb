"""Role-switch orders signed with the cluster secret (HMAC-SHA256), as KV pull tickets are (shared/kv/tickets.py).

Whoever holds the deployment's cluster secret (the gateway's admin API, the planner) may order a worker to switch
role; a worker obeys only an order that is signed with it, names this worker, has not expired, and whose nonce it
has not seen (each order works once). Shape: RoleControl(order = base64url JSON of a RoleSwitchOrder, mac =
base64url HMAC-SHA256(secret, DOMAIN || order)). The domain keeps these MACs apart from the tickets' (a ticket never
passes for an order, nor an order for a ticket). The signature is checked (in constant time) before the order is
read. Expiry is a wall clock on two machines: `skew_s` absorbs drift.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from enum import StrEnum

import msgspec

from shared.messages import Role, RoleControl, RoleSwitchOrder

DOMAIN = b"pdserve/role-control\n"
LIFETIME_S = 60.0  # an order is sent at once; a minute covers a slow NATS round trip
SKEW_S = 5.0
MIN_SECRET_BYTES = 16
MAX_ORDER_CHARS = 4096  # a longer string is not an order: refused before decoding
NONCE_BYTES = 16
MAX_NONCES = 4096  # orders remembered at once (a few per minute in practice); past it, new orders are refused


class OrderRefusal(StrEnum):
    NO_SECRET = "no_secret"  # the worker has no cluster secret: it takes no orders
    MALFORMED = "malformed"
    FORGED = "forged"  # another secret, or an altered order
    WRONG_WORKER = "wrong_worker"
    EXPIRED = "expired"
    REPLAYED = "replayed"


class OrderRefused(Exception):
    """An order did not pass; `reason` says which check. The message never repeats the order."""

    def __init__(self, reason: OrderRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ControlSigner:
    """Signs and checks role-switch orders under one cluster secret (str: its UTF-8 bytes)."""

    def __init__(self, secret: str | bytes, lifetime_s: float = LIFETIME_S, skew_s: float = SKEW_S) -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes: orders are signed with it")
        self._key, self.lifetime_s, self.skew_s = key, lifetime_s, skew_s

    def sign(
        self, worker_id: str, role: Role, finish_s: float | None = None, *, now: float | None = None
    ) -> RoleControl:
        expires_ms = int(((time.time() if now is None else now) + self.lifetime_s) * 1000)
        nonce = _b64(secrets.token_bytes(NONCE_BYTES))
        order = _b64(msgspec.json.encode(RoleSwitchOrder(worker_id, role, expires_ms, nonce, finish_s)))
        return RoleControl(order, _b64(self._mac(order)))

    def verify(self, control: RoleControl, worker_id: str, *, now: float | None = None) -> RoleSwitchOrder:
        """The order if it is signed with this secret, names `worker_id` and has not expired; else OrderRefused.
        Single use is the caller's (NonceMemory)."""
        try:
            if len(control.order) > MAX_ORDER_CHARS:
                raise ValueError("too long")
            mac = _unb64(control.mac)
        except ValueError:
            raise OrderRefused(OrderRefusal.MALFORMED, "the order is not of the signed shape") from None
        if not hmac.compare_digest(mac, self._mac(control.order)):
            raise OrderRefused(OrderRefusal.FORGED, "the order's signature does not match this cluster's secret")
        try:
            order = msgspec.json.decode(_unb64(control.order), type=RoleSwitchOrder)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            raise OrderRefused(OrderRefusal.MALFORMED, "the signed order cannot be read") from None
        if order.worker_id != worker_id:
            raise OrderRefused(OrderRefusal.WRONG_WORKER, f"the order is for worker {order.worker_id[:80]!r}")
        late_s = (time.time() if now is None else now) - order.expires_ms / 1000
        if late_s > self.skew_s:
            raise OrderRefused(OrderRefusal.EXPIRED, f"the order expired {late_s:.1f} s ago")
        return order

    def _mac(self, order: str) -> bytes:
        return hmac.new(self._key, DOMAIN + order.encode(), hashlib.sha256).digest()


class NonceMemory:
    """The nonces of the orders a worker obeyed, until they expire: a second use is refused."""

    def __init__(self, skew_s: float = SKEW_S, limit: int = MAX_NONCES) -> None:
        self._until: dict[str, float] = {}  # nonce → when it may be forgotten (wall clock)
        self.skew_s, self.limit = skew_s, limit

    def admit(self, order: RoleSwitchOrder, now: float | None = None) -> None:
        """Remember the order's nonce; OrderRefused (REPLAYED) when it was seen, or when too many are remembered."""
        now = time.time() if now is None else now
        self._until = {n: t for n, t in self._until.items() if t > now}
        if order.nonce in self._until:
            raise OrderRefused(OrderRefusal.REPLAYED, "the order was used once already")
        if len(self._until) >= self.limit:
            raise OrderRefused(OrderRefusal.REPLAYED, "too many orders remembered: refused rather than forgotten")
        self._until[order.nonce] = order.expires_ms / 1000 + self.skew_s


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """The strict inverse of _b64 (one spelling per byte string); ValueError otherwise."""
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except ValueError:
        raise ValueError("not base64url") from None
    if _b64(raw) != text:
        raise ValueError("not canonical base64url")
    return raw
