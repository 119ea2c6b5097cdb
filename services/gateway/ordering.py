"""Per-request reordering of token events: the client sees every output position once, in order.

Two publishers write one request's events (the prefill worker position 0, a decode worker the rest),
and a re-dispatch starts a new attempt that may repeat positions already delivered. Rules, from
shared.messages.TokenEvent (every kind but a failure has a position; taken and queued ones carry no tokens):
  - an event of an attempt older than the newest seen is stale: dropped;
  - positions below `delivered` were already sent: dropped (an event straddling it is trimmed);
  - an event starting past `delivered` waits in `_early` until the gap is filled;
  - a FailedEvent ends the request at once, whatever its position.
When the gateway moves a request to another worker it starts a newer attempt itself (`move_on`): from then
on the old attempt's events are stale. `tokens` are the ids delivered so far (what the new attempt resumes
from). State is pure (no I/O, no clock): NatsBackend feeds it from its one token listener.
"""

from __future__ import annotations

from services.gateway.backend import Update
from shared.messages import (
    FailedEvent,
    FinishedEvent,
    FinishReason,
    Logprob,
    QueuedEvent,
    TakenEvent,
    TokenEvent,
    TokensEvent,
)

_Positioned = TakenEvent | QueuedEvent | TokensEvent | FinishedEvent  # every kind but FailedEvent

_DEFAULT_ERROR = {
    FinishReason.ERROR: "a worker failed the request",
    FinishReason.ABORT: "the request was aborted upstream",
}


class TokenOrder:
    def __init__(self) -> None:
        self.delivered = 0  # output positions [0, delivered) have been handed out
        self.attempt = 0  # newest attempt seen or started
        self.finished = False
        self.tokens: list[int] = []  # the ids at positions [0, delivered)
        self._early: dict[int, _Positioned] = {}  # seq → event waiting for positions before it
        self._prompt_scored = False  # an update carried the prompt's logprobs already

    def push(self, event: TokenEvent) -> list[Update]:
        """Feed one event; return the updates now deliverable, in order (often one, maybe none)."""
        if self.finished or event.attempt < self.attempt:
            return []
        if event.attempt > self.attempt:
            self.attempt = event.attempt
            # early events of the older attempt may never be followed by the tokens between
            self._early = {s: e for s, e in self._early.items() if e.attempt == event.attempt}
        if isinstance(event, FailedEvent):
            self.finished = True
            self._early.clear()
            reason = event.finish_reason
            message = event.error or _DEFAULT_ERROR[reason]
            return [Update([], reason.value, message, status=event.status)]
        if event.seq > self.delivered:
            held = self._early.get(event.seq)
            if held is None or len(_tokens(event)) >= len(_tokens(held)) or isinstance(event, FinishedEvent):
                self._early[event.seq] = event
            return []
        updates = [self._take(event)]
        while not self.finished and (ready := self._next_early()) is not None:
            updates.append(self._take(ready))
        return [u for u in updates if u.token_ids or u.finished or u.prompt_logprobs]

    def move_on(self, attempt: int) -> None:
        """A newer attempt starts (the request moved to another worker): older events are stale from now."""
        if attempt <= self.attempt:
            raise ValueError(f"attempt {attempt} is not newer than {self.attempt}")
        self.attempt = attempt
        self._early.clear()

    def gap(self) -> tuple[int, int] | None:
        """(first missing position, first position waiting) while early events wait for a gap to fill."""
        return (self.delivered, min(self._early)) if self._early else None

    def _take(self, event: _Positioned) -> Update:
        """An event starting at or before `delivered`: its new positions (maybe none) go out."""
        if not isinstance(event, TokensEvent | FinishedEvent):
            return Update([], None)  # a taken / queued event: a position, no output
        fresh = event.token_ids[self.delivered - event.seq :]
        logprobs = event.logprobs[self.delivered - event.seq :]
        self.delivered += len(fresh)
        self.tokens.extend(fresh)
        reason = event.finish_reason.value if isinstance(event, FinishedEvent) else None
        if reason is not None:
            self.finished = True
            self._early.clear()
        return Update(
            list(fresh),
            reason,
            logprobs=list(logprobs),
            prompt_logprobs=self._prompt_logprobs(event),
            cached_tokens=event.cached_tokens,
        )

    def _prompt_logprobs(self, event: TokensEvent | FinishedEvent) -> list[Logprob]:
        """The prompt's logprobs, the first time an event brings them (a re-dispatched attempt computes them again)."""
        if not event.prompt_logprobs or self._prompt_scored:
            return []
        self._prompt_scored = True
        return list(event.prompt_logprobs)

    def _next_early(self) -> _Positioned | None:
        for seq in sorted(self._early):
            if seq > self.delivered:
                return None
            event = self._early.pop(seq)
            if seq + len(_tokens(event)) > self.delivered or isinstance(event, FinishedEvent):
                return event
        return None


def _tokens(event: _Positioned) -> list[int]:
    """The output an event carries: none on a taken or queued one."""
    return event.token_ids if isinstance(event, TokensEvent | FinishedEvent) else []
