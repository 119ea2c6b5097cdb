"""Server-sent events framing: `data: <json>` then a blank line, LF only (`vllm bench serve` splits on
the literal "\\n\\n"), ending with `data: [DONE]`. A failure mid-stream is one `data: {"error": ...}`
event, then [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from services.gateway.choices import ChoiceSet
from services.gateway.errors import error_body
from services.gateway.generation import Generation, GenerationError
from services.gateway.responses import ResponseWriter

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
_encoder = msgspec.json.Encoder()


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def events(gen: Generation, writer: ResponseWriter, include_usage: bool) -> AsyncIterator[bytes]:
    """The response body of a streaming request, one event per token. Closes `gen` however it ends
    (a client disconnect cancels this generator, and close() cancels the request upstream)."""
    try:
        try:
            async for piece in gen.pieces():
                for chunk in writer.chunks(piece, gen):
                    yield event(chunk)
            if include_usage:
                yield event(writer.usage_chunk(gen))
        except GenerationError as exc:
            yield event(error_body(exc.status, exc.message))
        yield DONE
    finally:
        await gen.close()


async def choice_events(choices: ChoiceSet, writer: ResponseWriter, include_usage: bool) -> AsyncIterator[bytes]:
    """`events` for n choices: their chunks interleave as they come, each naming its choice's index; one usage
    chunk at the end (the prompt once, every choice's completion tokens). Closes every choice however it ends."""
    try:
        try:
            async for index, piece in choices.pieces():
                for chunk in writer.chunks(piece, choices.gens[index], index):
                    yield event(chunk)
            if include_usage:
                yield event(writer.usage_chunk(choices))
        except GenerationError as exc:
            yield event(error_body(exc.status, exc.message))
        yield DONE
    finally:
        await choices.close()
