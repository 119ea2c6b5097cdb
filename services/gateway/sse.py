"""Server-sent events framing: `data: <json>` then a blank line, LF only (`vllm bench serve` splits on
the literal "\\n\\n"), ending with `data: [DONE]`. A failure mid-stream is one `data: {"error": ...}`
event, then [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from services.gateway.choices import ChoiceSet
from services.gateway.errors import error_body
from services.gateway.generation import Generation, GenerationError, Piece
from services.gateway.responses import ResponseWriter

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
_encoder = msgspec.json.Encoder()


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def events(gen: Generation | ChoiceSet, writer: ResponseWriter, include_usage: bool) -> AsyncIterator[bytes]:
    """The response body of a streaming request, one event per token: of one choice, or of n, whose chunks
    interleave as they come, each naming its choice's index; one usage chunk at the end (the prompt once, every
    choice's completion tokens). Closes `gen` however it ends (a client disconnect cancels this generator, and
    close() cancels the request upstream)."""
    try:
        try:
            async for index, piece in _indexed(gen):
                choice = gen.gens[index] if isinstance(gen, ChoiceSet) else gen
                for chunk in writer.chunks(piece, choice, index):
                    yield event(chunk)
            if include_usage:
                yield event(writer.usage_chunk(gen))
        except GenerationError as exc:
            yield event(error_body(exc.status, exc.message))
        yield DONE
    finally:
        await gen.close()


async def _indexed(gen: Generation | ChoiceSet) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece): one choice's pieces are choice 0's."""
    if isinstance(gen, ChoiceSet):
        async for indexed in gen.pieces():
            yield indexed
    else:
        async for piece in gen.pieces():
            yield 0, piece
