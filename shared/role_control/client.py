"""The client side of a role switch: what the gateway's admin API and the planner call.

`switch_role` is the safe call, and the one to use: under the deployment's lock (lock.py) it reads the live
workers, refuses a switch that would leave a needed role without a worker (safety.py), sends the signed order
(`request_switch`), waits for the worker's answer, and holds the lock `settle_s` more so that every heartbeat
reader sees the new role before the next switch is decided. `request_switch` alone sends one order and waits for
its answer: no lock, no safety check.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared.messages import (
    HEARTBEAT_WILDCARD,
    Heartbeat,
    Role,
    RoleSwitchReply,
    SwitchOutcome,
    control_subject,
    decode,
    encode,
)
from shared.role_control.lock import LockTaken, role_lock
from shared.role_control.safety import switch_refusal
from shared.role_control.signing import ControlSigner

TIMEOUT_S = 120.0  # a worker answers once its switch is done: a decode worker's requests may finish first
LOCK_WAIT_S = 5.0
SETTLE_S = 2.5  # two heartbeats and some: every reader of heartbeats sees the new role before the lock is free
HEARTBEAT_WINDOW_S = 1.5  # listening this long hears every live worker's latest beat (they beat once a second)

Workers = Callable[[], list[Heartbeat] | Awaitable[list[Heartbeat]]]


@dataclass(frozen=True)
class SwitchResult:
    """How one switch went: the worker's answer (RoleSwitchReply's fields), or why it was not asked."""

    worker_id: str
    outcome: SwitchOutcome
    role: Role | None = None  # the worker's role now, when known
    previous_role: Role | None = None
    detail: str = ""
    took_s: float = 0.0
    finished: int = 0
    handed_on: int = 0

    @property
    def switched(self) -> bool:
        return self.outcome is SwitchOutcome.SWITCHED

    @classmethod
    def of(cls, reply: RoleSwitchReply) -> SwitchResult:
        return cls(reply.worker_id, reply.outcome, reply.role, reply.previous_role, reply.detail, reply.took_s,
                   reply.finished, reply.handed_on)  # fmt: skip

    def as_dict(self) -> dict[str, object]:
        """The JSON the admin API answers with (docs/api.md, "Admin API")."""
        return {
            "worker_id": self.worker_id,
            "outcome": self.outcome.value,
            "role": None if self.role is None else self.role.value,
            "previous_role": None if self.previous_role is None else self.previous_role.value,
            "detail": self.detail,
            "took_s": round(self.took_s, 3),
            "finished": self.finished,
            "handed_on": self.handed_on,
        }


async def switch_role(
    nc: NATS,
    redis: Redis,
    worker_id: str,
    role: Role,
    secret: str,
    *,
    workers: Workers | None = None,
    finish_s: float | None = None,
    timeout_s: float = TIMEOUT_S,
    holder: str = "role_control",
    lock_wait_s: float = LOCK_WAIT_S,
    settle_s: float = SETTLE_S,
    headers: Mapping[str, str] | None = None,
) -> SwitchResult:
    """Switch `worker_id` to `role`, safely (see the module). `workers`: the caller's live view (latest heartbeat
    of each live worker), read once the lock is held; default: the heartbeats heard on NATS for
    HEARTBEAT_WINDOW_S. `finish_s`: how long a decode (or mixed) worker's requests may run on before they are
    handed on (None: the worker's switch_finish_s). `holder` names the caller in the lock. `headers`: NATS
    headers of the order (a trace context). Never raises for a refusal: the result says it."""
    started = time.monotonic()
    try:
        async with role_lock(redis, holder, lock_wait_s):
            beats = await _read(workers) if workers is not None else await live_workers(nc)
            refusal = switch_refusal(beats, worker_id, role)
            if refusal is not None:
                outcome, detail = refusal
                current = next((b.role for b in beats if b.worker_id == worker_id), None)
                return SwitchResult(worker_id, outcome, current, detail=detail, took_s=time.monotonic() - started)
            result = await request_switch(nc, worker_id, role, secret, finish_s=finish_s, timeout_s=timeout_s,
                                          headers=headers)  # fmt: skip
            if result.switched:
                await asyncio.sleep(settle_s)
            return result
    except LockTaken as exc:
        return SwitchResult(worker_id, SwitchOutcome.LOCKED, detail=str(exc), took_s=time.monotonic() - started)


async def request_switch(
    nc: NATS,
    worker_id: str,
    role: Role,
    secret: str,
    *,
    finish_s: float | None = None,
    timeout_s: float = TIMEOUT_S,
    headers: Mapping[str, str] | None = None,
) -> SwitchResult:
    """Send one signed order to `worker_id` on pd.control.<worker> and wait for its answer (no lock, no safety
    check: `switch_role` is the safe call)."""
    control = ControlSigner(secret).sign(worker_id, role, finish_s)
    subject = control_subject(worker_id)
    try:
        msg = await nc.request(subject, encode(control), timeout=timeout_s, headers=dict(headers or {}) or None)
    except nats.errors.NoRespondersError:
        return SwitchResult(worker_id, SwitchOutcome.UNKNOWN_WORKER, detail=f"no worker listens on {subject}")
    except (TimeoutError, nats.errors.TimeoutError):
        return SwitchResult(worker_id, SwitchOutcome.NO_REPLY, detail=f"no answer within {timeout_s:g} s (the "
                            "switch may still complete: the worker's heartbeat shows its role)")  # fmt: skip
    try:
        return SwitchResult.of(decode(msg.data, RoleSwitchReply))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return SwitchResult(worker_id, SwitchOutcome.NO_REPLY, detail=f"the worker's answer could not be read: {exc}")


async def live_workers(nc: NATS, seconds: float = HEARTBEAT_WINDOW_S) -> list[Heartbeat]:
    """Every worker's latest heartbeat heard within `seconds`."""
    seen: dict[str, Heartbeat] = {}

    async def on_beat(msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        seen[beat.worker_id] = beat

    sub = await nc.subscribe(HEARTBEAT_WILDCARD, cb=on_beat)
    try:
        await asyncio.sleep(seconds)
    finally:
        await sub.unsubscribe()
    return list(seen.values())


async def _read(workers: Workers) -> list[Heartbeat]:
    beats = workers()
    return await beats if inspect.isawaitable(beats) else beats
