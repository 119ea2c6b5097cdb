"""The n choices of one request (n > 1): one Generation per choice over the streams of one dispatch.

Each choice is a request of its own on the wire (shared/choices.py: `<request>_c<i>`, seeded seed + i): its
stream orders its tokens, its Generation detokenizes them, applies the stop strings and owns its upstream
lifetime (closing it cancels that choice unless its worker finished it). The workers compute the prompt once
for all of them and hand its KV on once. This class only fans out and back in: the non-streaming answer waits
for every choice; a stream interleaves the choices' pieces as they come, each tagged with its index.

Usage is counted as OpenAI does: the prompt once, completion tokens summed over the choices. The request's span
and latency metrics (RequestObserver) follow choice 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.backend import GatewayBackend, GenerationJob, choice_requests, open_choices
from services.gateway.generation import Generation, GenerationError, Piece
from services.gateway.observe import RequestObserver
from shared.model.tokenizer import Tokenizer


class ChoiceSet:
    """Open → (wait_first) → pieces() or collect() → close(), as Generation, for n choices."""

    def __init__(
        self,
        backend: GatewayBackend,
        job: GenerationJob,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        observer: RequestObserver | None = None,
        log_prompts: bool = False,
    ) -> None:
        self.backend = backend
        self.job = job
        self.gens = [
            Generation(backend, single, tokenizer, stop, observer if i == 0 else None, log_prompts)
            for i, single in enumerate(choice_requests(job))
        ]

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt_token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.gens[0].cached_tokens  # one prefill computed the prompt for every choice

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)

    async def open(self) -> None:
        """Dispatch every choice at once. Raises BackendUnavailable / Overloaded as Generation.open."""
        streams = await open_choices(self.backend, self.job)
        for gen, stream in zip(self.gens, streams, strict=True):
            gen.attach(stream)

    def fail(self, message: str, status: int) -> GenerationError:
        errors = [g.fail(message, status) for g in self.gens]
        return errors[0]

    async def wait_first(self) -> None:
        """Every choice's first update (they come together, from one prefill); raises GenerationError."""
        for gen in self.gens:
            await gen.wait_first()

    async def collect(self) -> list[str]:
        """Run every choice to its end; their texts in choice order."""
        return list(await asyncio.gather(*(g.collect() for g in self.gens)))

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) as each choice produces them; raises the first GenerationError of any choice
        (the others are closed with the set)."""
        queue: asyncio.Queue[tuple[int, Piece | GenerationError | None]] = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for piece in gen.pieces():
                    queue.put_nowait((index, piece))
            except GenerationError as exc:
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, None))  # this choice ended

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if isinstance(item, GenerationError):
                    raise item
                if item is None:  # that choice ended
                    running -= 1
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close every choice (each cancels upstream what its worker did not finish)."""
        for gen in self.gens:
            await gen.close()
