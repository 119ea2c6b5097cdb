"""The deployment's one role-switch lock in Redis: every gateway's admin API and the planner take it around a switch,
so that switches happen one at a time and each decides on what the previous one left.

Admission: `SET pd:admin:role-lock "<holder> <token>" NX PX <ttl>`; the holder refreshes the TTL while it holds
the lock (every third of it) and deletes the key when done, each only while the value is still its own (a Lua
compare-and-set: a holder whose TTL ran out never touches its successor's lock). A holder that dies leaves the key
to expire within `ttl_s`. A caller that finds the lock taken waits up to `wait_s`, then gives up with the holder's
name (SwitchOutcome.LOCKED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis

LOCK_KEY = "pd:admin:role-lock"
TTL_S = 30.0
POLL_S = 0.1
log = logging.getLogger(__name__)

_REFRESH = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class LockTaken(Exception):
    """The lock stayed taken for the whole wait; `holder` names who holds it (None: it expired meanwhile)."""

    def __init__(self, holder: str | None, wait_s: float) -> None:
        who = f"by {holder}" if holder else "by another caller"
        super().__init__(f"another role switch holds {LOCK_KEY} ({who}); waited {wait_s:g} s")
        self.holder = holder


class RoleLock:
    """One acquisition of the lock by `holder` (a name for logs and refusals: "gateway gw-1", "planner")."""

    def __init__(self, redis: Redis, holder: str, ttl_s: float = TTL_S) -> None:
        self.redis, self.holder, self.ttl_s = redis, holder, ttl_s
        self.value = f"{holder} {secrets.token_hex(8)}"
        self._refreshing: asyncio.Task | None = None

    async def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, waiting up to `wait_s` for its holder to let go; LockTaken when it does not."""
        deadline = time.monotonic() + wait_s
        ttl_ms = int(self.ttl_s * 1000)
        while not await self.redis.set(LOCK_KEY, self.value, nx=True, px=ttl_ms):
            if time.monotonic() >= deadline:
                raise LockTaken(await holder_of(self.redis), wait_s)
            await asyncio.sleep(POLL_S)
        self._refreshing = asyncio.create_task(self._refresh())

    async def release(self) -> None:
        """Let go (only if the lock is still ours)."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                await self._refreshing
            self._refreshing = None
        try:
            await self.redis.eval(_RELEASE, 1, LOCK_KEY, self.value)  # type: ignore[misc]
        except Exception as exc:  # Redis away: the key expires on its own
            log.warning("could not release %s (%s); it expires within %g s", LOCK_KEY, exc, self.ttl_s)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                kept = await self.redis.eval(_REFRESH, 1, LOCK_KEY, self.value, int(self.ttl_s * 1000))  # type: ignore[misc]
            except Exception as exc:
                log.warning("could not refresh %s (%s)", LOCK_KEY, exc)
                continue
            if not kept:
                log.warning("%s was lost (expired, or taken over): a later switch may overlap this one", LOCK_KEY)
                return


async def holder_of(redis: Redis) -> str | None:
    """Who holds the lock now (its holder name), or None."""
    value = await redis.get(LOCK_KEY)
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    return text.rsplit(" ", 1)[0]


@contextlib.asynccontextmanager
async def role_lock(redis: Redis, holder: str, wait_s: float = 0.0, ttl_s: float = TTL_S) -> AsyncIterator[RoleLock]:
    """The lock, held for the block (refreshed meanwhile), released after it; LockTaken if it cannot be had."""
    lock = RoleLock(redis, holder, ttl_s)
    await lock.acquire(wait_s)
    try:
        yield lock
    finally:
        await lock.release()
