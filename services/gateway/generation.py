"""One request's run against the backend: updates in, one text piece per generated token out.

Owns the request's upstream lifetime: whenever the run ends without the worker having finished it
(client gone, stop string matched, deadline, failure), `close()` cancels it upstream so prefill and
decode free its work and KV. `close()` is idempotent and safe to call from a cancelled task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from services.gateway.backend import GatewayBackend, GenerationJob, RequestStream, Update
from services.gateway.observe import RequestObserver
from services.gateway.prompt_log import log_completion, log_prompt
from services.gateway.textstream import TextAssembler
from shared.messages import Logprob
from shared.model.tokenizer import Tokenizer

_CLOSE_TIMEOUT_S = 5.0


class GenerationError(Exception):
    """The request failed upstream (worker error, timeout); `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Piece:
    text: str  # may be "" (half a character, a possible stop-string start, a special token)
    finish_reason: str | None = None  # "stop" | "length", on the last piece only
    token_ids: tuple[int, ...] = ()  # the token(s) this piece comes from (none: score only)
    logprobs: tuple[Logprob, ...] = ()  # theirs, when the request asked


class Generation:
    """Open → (wait_first) → pieces() or collect() → close(). Counts completion tokens for usage; tells
    `observer` (span and metrics) when tokens reach the client and how the request ended."""

    def __init__(
        self,
        backend: GatewayBackend,
        job: GenerationJob,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        observer: RequestObserver | None = None,
        log_prompts: bool = False,  # settings.log_prompts: prompt and completion text in the log (prompt_log.py)
    ) -> None:
        self.backend = backend
        self.job = job
        self.observer = observer
        self.log_prompts = log_prompts
        self._tokenizer = tokenizer
        self.text = TextAssembler(tokenizer, stop)
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # delivered, up to a stop string's match
        self.logprobs: list[Logprob] = []  # theirs, when the request asked
        self.prompt_logprobs: list[Logprob] = []  # prompt positions 1.., when the request asked
        self.cached_tokens = 0  # of the prompt, served from the prefix cache of the worker that computed it
        self.finish_reason: str | None = None
        self._stream: RequestStream | None = None
        self._first: Update | None = None
        self._worker_finished = False
        self._closed = False
        self._failure: GenerationError | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt_token_ids)

    async def open(self) -> None:
        """Dispatch. Raises BackendUnavailable."""
        if self.log_prompts:
            log_prompt(self.job.request_id, self._tokenizer, self.job.prompt_token_ids)
        self._stream = await self.backend.open(self.job)
        self._dispatched(self._stream)

    def attach(self, stream: RequestStream) -> None:
        """Take a stream dispatched with others instead of opening one (the choices of a request: choices.py)."""
        if self.log_prompts:
            log_prompt(self.job.request_id, self._tokenizer, self.job.prompt_token_ids)
        self._stream = stream
        self._dispatched(stream)

    def _dispatched(self, stream: RequestStream) -> None:
        """Tell the observer the prefill path the request took (a backend that chooses none leaves it unset)."""
        if self.observer is not None:
            self.observer.dispatched(getattr(stream, "prefill_path", None))

    def fail(self, message: str, status: int) -> GenerationError:
        """Record why the request failed (for close() to report); returns the error to raise."""
        self._failure = GenerationError(message, status)
        return self._failure

    async def wait_first(self) -> None:
        """Wait for the first update, so that a failure before any token is still a plain HTTP error."""
        self._first = await self._next()
        if self._first.failed:
            raise self.fail(self._first.error or "request failed", self._first.status)

    async def pieces(self) -> AsyncIterator[Piece]:
        """One piece per token, the last one with finish_reason. Raises GenerationError on a failure."""
        while self.finish_reason is None:
            update = self._first if self._first is not None else await self._next()
            self._first = None
            if update.failed:
                raise self.fail(update.error or "request failed", update.status)
            for piece in self._pieces_of(update):
                yield piece

    async def collect(self) -> str:
        """Run to the end; the whole text."""
        async for _ in self.pieces():
            pass
        return self.text.text

    def _pieces_of(self, update: Update) -> list[Piece]:
        self._worker_finished = update.finished  # the worker let go of the request: nothing to cancel
        self.prompt_logprobs = self.prompt_logprobs or update.prompt_logprobs
        self.cached_tokens = self.cached_tokens or update.cached_tokens  # a moved request's recompute does not count
        pieces = []
        for i, token_id in enumerate(update.token_ids):
            self.completion_tokens += 1
            self.token_ids.append(token_id)
            logprobs = tuple(update.logprobs[i : i + 1])
            self.logprobs += logprobs
            text = self.text.add(token_id)
            if self.text.stopped:  # later tokens are dropped; close() cancels the rest upstream
                self.finish_reason = "stop"
                self._observe_tokens(len(pieces) + 1)
                return [*pieces, Piece(text, "stop", (token_id,), logprobs)]
            pieces.append(Piece(text, None, (token_id,), logprobs))
        self._observe_tokens(len(update.token_ids))
        if update.finished:
            tail = self.text.finish()
            self.finish_reason = "stop" if self.text.stopped else update.finish_reason
            last = pieces.pop() if pieces else Piece("")
            pieces.append(Piece(last.text + tail, self.finish_reason, last.token_ids, last.logprobs))
        return pieces

    async def _next(self) -> Update:
        if self._stream is None:
            raise RuntimeError("Generation.open() was not called")
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return Update([], "error", "the backend ended the request without a final event")

    def _observe_tokens(self, n: int) -> None:
        if self.observer is not None:
            self.observer.tokens(n)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._report_end()
        if self.log_prompts:
            ending = "error" if self._failure is not None else self.finish_reason or "abort"
            log_completion(self.job.request_id, self.text.text, self.completion_tokens, ending)
        if self._stream is None:
            return  # never dispatched: nothing upstream to cancel
        # shielded: this runs in the finally of a task that is being cancelled (client disconnect)
        with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            if not self._worker_finished:
                await self.backend.cancel(self.job.request_id)
            await self._stream.aclose()

    def _report_end(self) -> None:
        if self.observer is None:
            return
        if self._failure is not None:
            self.observer.end("error", self.completion_tokens, self._failure.message, self._failure.status)
        elif self.finish_reason is not None:
            self.observer.end(self.finish_reason, self.completion_tokens)
        else:  # closed mid-way without a failure: the client went away
            self.observer.end("abort", self.completion_tokens, "the client disconnected", 499)
