"""One worker process over its life: the engine (and the worker group it leads), the connections and the metrics
server stay; the role served over them (a Worker of services/prefill, decode or mixed) may change while it runs,
without reloading weights (docs/architecture.md, "Role switching").

A switch is ordered on `pd.control.<worker>` (request/reply) by an order signed with the cluster secret
(shared/role_control/signing.py; a forged, expired, replayed or misaddressed one is refused). Then:

1. the old role leaves (Worker.leave): it takes no new job, hands its own queue back to the shared one, lets what
   it holds finish — a decode or mixed worker's requests for `finish_s`, then the rest are handed on to the prefill
   queue with their tokens so far; a prefill worker's held KV is pulled or its lease expires — and shuts its role
   down (its KV server or pull clients closed, its engine thread stopped);
2. the new role is built over the same engine and group (Worker(succeeds=old)) and sets up what it needs (a
   prefill role its KV transfer server(s), a decode role its pull clients: a group's on every rank);
3. once it serves, the order is answered (RoleSwitchReply).

What the old role held did not settle within finish_s + the KV lease + a margin: it serves on (TIMED_OUT). The new
role failed to set up: the old one is started again (INVALID, with the error). A stop (SIGTERM) during a switch calls
it off: what the old role holds drains and the process exits. The role's progress is a RoleState (role_state.py);
every switch is logged, traced (`role_switch <model>`) and counted (pdserve:role_switches_total,
pdserve:worker_role).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from shared.messages import Role, RoleControl, RoleSwitchOrder, RoleSwitchReply, SwitchOutcome, control_subject
from shared.messages import decode as decode_message
from shared.messages import encode as encode_message
from shared.role_control.signing import ControlSigner, NonceMemory, OrderRefusal, OrderRefused
from shared.settings import WorkerRole, WorkerSettings
from shared.telemetry import metrics, tracing
from shared.worker import gauges
from shared.worker.role_state import Phase, RoleState
from shared.worker.runtime import Leaving, Worker

if TYPE_CHECKING:
    from shared.engine.engine import Engine
    from shared.parallel.group_engine import WorkerGroup

log = logging.getLogger(__name__)
RoleFactory = Callable[[Role], type[Worker[Any]]]  # the role's Worker class (the CLI's: services/*/worker.py)
SETTLE_MARGIN_S = 10.0  # past finish_s and the KV lease: pulls in flight end, the own queue is handed back
ROLE_SWITCH_SPAN = "role_switch"
ROLE_FROM = "pdserve.role.from"
ROLE_TO = "pdserve.role.to"
SWITCH_OUTCOME = "pdserve.role_switch.outcome"
SWITCH_HANDED_ON = "pdserve.role_switch.handed_on"
SWITCH_FINISHED = "pdserve.role_switch.finished"


class WorkerHost:
    """Runs a worker process: `run()` serves roles in turn until `stop()`; `failure` says why the engine died."""

    def __init__(
        self,
        settings: WorkerSettings,
        roles: RoleFactory,
        engine: Engine | None = None,
        group: WorkerGroup | None = None,
    ) -> None:
        """roles: the Worker class of each role; engine, group: instead of building them (tests)."""
        self.settings, self.roles = settings, roles
        self.state = RoleState(Role(settings.role))
        self.worker: Worker[Any] = roles(self.state.role)(settings, engine, group)
        self.group = self.worker.group  # the whole group switches with its leader: it stays, with the engine
        self.signer = ControlSigner(settings.cluster_secret) if settings.cluster_secret else None
        self.nonces = NonceMemory()
        self.failure: BaseException | None = None
        self._started: asyncio.Future[tuple[Role, str]] | None = None  # a switch's: the role serving after it
        self._switching: asyncio.Task | None = None

    @property
    def role(self) -> Role:
        return self.state.role

    async def run(self) -> None:
        if not await self.worker.connect():
            return
        nc = self.worker.conn.nc
        subscription = await nc.subscribe(control_subject(self.settings.worker_id), cb=self._on_control)
        try:
            while True:
                self._record_role()
                await self._serve(self.worker)  # the role that served last is self.worker (a fallback replaces it)
                worker = self.worker
                if worker.failure is not None:
                    self.failure = worker.failure
                    return
                if self.state.phase is not Phase.STARTING:
                    return  # stopped
                try:
                    self._successor(worker)
                except Exception as exc:  # the new role cannot even be built: the old one serves again
                    self._fall_back(worker, exc)
                if self.state.phase is Phase.STOPPING:  # a stop while it was being built: not started at all
                    return
        finally:
            await _quietly(subscription.unsubscribe())
            if self._started is not None and not self._started.done():  # a switch's answer: called off
                self._started.set_result((self.state.role, "the worker is shutting down"))
            if self._switching is not None:  # its answer out, or given up
                await asyncio.wait({self._switching}, timeout=2.0)
                self._switching.cancel()
            await self.worker.close()

    def stop(self) -> None:
        """SIGTERM / SIGINT: the first call drains (a switch under way is called off: the old role's leave ends in a
        stop), a second one stops now."""
        if self.state.stop():
            log.info("a role switch was under way: called off, the worker stops")
        self.worker.stop()

    # ---- serving roles in turn -------------------------------------------------------------------------

    async def _serve(self, worker: Worker[Any]) -> None:
        """Serve `worker` until it stops. During a switch: report the role that serves (the target, or the old role
        again when the target's setup failed, which serves in its stead)."""
        starting = self.state.phase is Phase.STARTING
        announcing = asyncio.create_task(self._announce(worker)) if starting else None
        try:
            await worker.serve()
        except Exception as exc:
            if not starting or worker.taking_jobs.is_set():
                raise
            if announcing is not None:
                announcing.cancel()
            old = self._fall_back(worker, exc)
            await self._serve(old)

    async def _announce(self, worker: Worker[Any]) -> None:
        """Once the new role serves: the switch is done (the state's role is the one serving)."""
        await worker.taking_jobs.wait()
        if self.state.phase is Phase.STARTING:
            self.state.started(worker.role)
        self._record_role()
        if self._started is not None and not self._started.done():
            self._started.set_result((worker.role, ""))

    def _fall_back(self, failed: Worker[Any], exc: Exception) -> Worker[Any]:
        """The new role could not set up: the old one (the state's role) is built again, and will serve."""
        old = self.state.role
        log.error("the %s role could not start (%r); serving as %s again", failed.role, exc, old)
        worker = self.roles(old)(self._settings_of(old), succeeds=failed)
        self.worker = worker
        if self._started is not None and not self._started.done():
            self._started.set_result((old, f"the {failed.role} role could not start: {exc!r}"))
            self._started = None
        return worker

    def _successor(self, old: Worker[Any]) -> Worker[Any]:
        """The next role's worker over the old one's engine, group and connections."""
        target = self.state.target
        assert target is not None  # STARTING always has one
        gauges.forget_load(old.labels, len(old.load.group_total_blocks))
        worker = self.roles(target)(self._settings_of(target), succeeds=old)
        self.worker = worker
        return worker

    def _settings_of(self, role: Role) -> WorkerSettings:
        """The settings with `role`: validated (a prefill or decode role needs the cluster secret)."""
        return dataclasses.replace(self.settings, role=WorkerRole(role.value))

    def _record_role(self) -> None:
        gauges.record_role(self.worker.model_name, self.state.role.value, tuple(r.value for r in Role))

    # ---- control orders --------------------------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        """A signed order: checked, then its switch runs as a task (its answer comes once it is done)."""
        received = time.monotonic()
        try:
            order = self._checked(msg)
        except OrderRefused as exc:
            log.warning("refused a control order: %s", exc)
            await self._answer(msg, self._reply(SwitchOutcome.REFUSED, str(exc), received), None)
            return
        to = order.role
        try:
            self._settings_of(to)
        except ValueError as exc:
            await self._answer(msg, self._reply(SwitchOutcome.INVALID, str(exc), received), to)
            return
        refusal = self.state.begin(to)
        if refusal is not None:
            await self._answer(msg, self._reply(*refusal, received), to)
            return
        self._switching = asyncio.create_task(self._switch(msg, order, received))

    def _checked(self, msg: Msg) -> RoleSwitchOrder:
        if self.signer is None:
            raise OrderRefused(OrderRefusal.NO_SECRET, "this worker has no cluster_secret: it takes no control orders")
        try:
            control = decode_message(msg.data, RoleControl)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise OrderRefused(OrderRefusal.MALFORMED, "not a RoleControl message") from None
        order = self.signer.verify(control, self.settings.worker_id)
        self.nonces.admit(order)
        return order

    async def _switch(self, msg: Msg, order: RoleSwitchOrder, received: float) -> None:
        old, to = self.worker, order.role
        finish_s = self.settings.switch_finish_s if order.finish_s is None else order.finish_s
        timeout_s = finish_s + self.settings.kv.lease_s + SETTLE_MARGIN_S
        span = tracing.start_span(
            f"{ROLE_SWITCH_SPAN} {old.model_name}",
            tracing.extract(msg.headers),
            attributes={tracing.WORKER_ID: self.settings.worker_id, ROLE_FROM: old.role.value, ROLE_TO: to.value},
        )
        log.info("switching from %s to %s: taking no new job, finishing what is in hand (finish_s %g, at most %g s)",
                 old.role, to, finish_s, timeout_s)  # fmt: skip
        self._started = asyncio.get_running_loop().create_future()
        leaving = await old.leave(to, finish_s, timeout_s)
        span.set_attributes({SWITCH_HANDED_ON: leaving.handed_on, SWITCH_FINISHED: leaving.finished})
        log.info("left the %s role in %.2f s: %d requests finished here, %d handed on to the prefill queue%s",
                 old.role, leaving.took_s, leaving.finished, leaving.handed_on,
                 "" if leaving.idle else " (not idle in time)")  # fmt: skip
        if self.state.phase is Phase.STOPPING:
            reply = self._reply(SwitchOutcome.STOPPING, "the worker is shutting down", received, leaving)
        elif not leaving.idle:
            self.state.resumed()
            detail = f"what the {old.role} role held did not settle within {timeout_s:g} s: it serves on"
            reply = self._reply(SwitchOutcome.TIMED_OUT, detail, received, leaving)
        else:
            self.state.left()
            serving, why = await self._started
            outcome = SwitchOutcome.SWITCHED if serving is to else SwitchOutcome.INVALID
            if self.state.phase is Phase.STOPPING:
                outcome = SwitchOutcome.STOPPING
            reply = self._reply(outcome, why, received, leaving, previous=old.role)
        self._started = None
        span.set_attribute(SWITCH_OUTCOME, reply.outcome.value)
        tracing.end_span(span, error=reply.detail if reply.outcome is not SwitchOutcome.SWITCHED else None)
        if reply.outcome is SwitchOutcome.SWITCHED:
            labels = (old.model_name, old.role.value, to.value)
            metrics.ROLE_SWITCH_SECONDS.labels(*labels).observe(reply.took_s)
            log.info("now a %s worker (switched from %s in %.2f s)", to, old.role, reply.took_s)
        else:
            log.warning("the switch to %s did not happen (%s): %s", to, reply.outcome, reply.detail)
        await self._answer(msg, reply, to, from_role=old.role)

    def _reply(
        self,
        outcome: SwitchOutcome,
        detail: str,
        received: float,
        leaving: Leaving | None = None,
        previous: Role | None = None,
    ) -> RoleSwitchReply:
        return RoleSwitchReply(
            worker_id=self.settings.worker_id,
            outcome=outcome,
            role=self.state.role,
            previous_role=previous,
            detail=detail,
            took_s=time.monotonic() - received,
            finished=leaving.finished if leaving is not None else 0,
            handed_on=leaving.handed_on if leaving is not None else 0,
        )

    async def _answer(self, msg: Msg, reply: RoleSwitchReply, to: Role | None, from_role: Role | None = None) -> None:
        """Count the order's outcome, and answer it (the asker may be gone: nothing to do then)."""
        before = (from_role or self.state.role).value
        metrics.ROLE_SWITCHES.labels(self.worker.model_name, before, to.value if to else "", reply.outcome.value).inc()
        if msg.reply:
            await _quietly(msg.respond(encode_message(reply)))


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception as exc:  # NATS away: the asker times out (its NO_REPLY says the switch may still complete)
        log.debug("control answer not sent: %s", exc)
