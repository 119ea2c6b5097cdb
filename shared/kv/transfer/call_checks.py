"""The checks every call to the KV transfer server passes before it touches anything (server.py): a readable
message whose ids are present and of sane length, a ticket signed for this caller (and, on Pull, this request)
used for the first time (replay.py), and the layout fingerprint. A refusal is counted, logged with its reason
(never the ticket) under the server's logger, and aborts the call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import grpc

from shared.engine.kv_pool import KVLayout
from shared.kv.replay import ReplayCache
from shared.kv.tickets import TicketError, TicketReason, Tickets
from shared.kv.transfer.rpc_calls import Call, Unreadable, short
from shared.kv.transfer.transports.sends import ServerStats
from shared.telemetry import metrics

MAX_ID_CHARS = 512  # request, worker and pair ids; longer is refused as INVALID_ARGUMENT
# A refused ticket: no usable credential at all → UNAUTHENTICATED; a real one that does not grant this call
# (or a signature that does not check out) → PERMISSION_DENIED.
_TICKET_CODES = {
    TicketReason.MISSING: grpc.StatusCode.UNAUTHENTICATED,
    TicketReason.MALFORMED: grpc.StatusCode.UNAUTHENTICATED,
    TicketReason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a valid ticket, no room to remember it
}


class CallChecks:
    """A server's checks of its calls; each raises (aborts the call) when the call does not pass."""

    def __init__(
        self,
        secret: bytes | str,
        replay_capacity: int,
        stats: ServerStats,
        model_name: str,
        layout: Callable[[], KVLayout],
        log: logging.Logger,
    ) -> None:
        self._tickets = Tickets(secret)
        self._replays = ReplayCache(replay_capacity, self._tickets.skew_s)
        self._stats = stats
        self._labels = (model_name, "prefill")
        self._layout = layout  # the source's, read at each check
        self._log = log

    async def shape(self, context: grpc.aio.ServicerContext, rpc: str, request: Call | Unreadable, *ids: str) -> Call:
        """`request`, known readable; else INVALID_ARGUMENT for an unreadable message, or one whose id fields
        are empty or too long."""
        if isinstance(request, Unreadable):
            await self.refuse(context, rpc, "?", f"the message is not a {request.kind}")
        for name in ids:
            value = getattr(request, name)
            if not value or len(value) > MAX_ID_CHARS:
                problem = "is empty" if not value else f"is longer than {MAX_ID_CHARS} characters"
                await self.refuse(context, rpc, request.decode_worker_id or "?", f"{name} {problem}")
        return request

    async def refuse(self, context: grpc.aio.ServicerContext, rpc: str, worker: str, why: str) -> NoReturn:
        """Count and log the refusal, then abort the call with INVALID_ARGUMENT (raises)."""
        self._stats.refused += 1
        metrics.KV_TRANSFER_FAILURES.labels(*self._labels, "invalid_request").inc()
        self._log.warning("refused %s from %s (worker %s): %s", rpc, context.peer(), short(worker), why)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc} refused: {why}")

    async def authorize(
        self, context: grpc.aio.ServicerContext, rpc: str, ticket: str, worker: str, request_id: str | None = None
    ) -> None:
        """Pass if `ticket` lets `worker` make this call (pull `request_id`; None: connect); else refuse."""
        try:
            self._replays.admit(self._tickets.verify(ticket, worker, request_id))
        except TicketError as e:
            self._stats.refused += 1
            metrics.KV_TRANSFER_FAILURES.labels(*self._labels, f"ticket_{e.reason}").inc()
            target = "" if request_id is None else f" of {short(request_id)}"
            self._log.warning("refused %s%s from %s (worker %s): ticket %s: %s",
                              rpc, target, context.peer(), short(worker), e.reason, e)  # fmt: skip
            code = _TICKET_CODES.get(e.reason, grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(code, f"{rpc} refused, ticket {e.reason}: {e}")

    async def fingerprint(self, fingerprint: str, context: grpc.aio.ServicerContext) -> None:
        """Pass if the caller's KV layout fingerprint is the source's; else FAILED_PRECONDITION."""
        ours = self._layout().fingerprint
        if fingerprint != ours:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"KV layout fingerprint {fingerprint!r} differs from ours {ours!r}"
            )
