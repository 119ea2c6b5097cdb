"""One streamed request to an OpenAI-compatible server, timed: `send` turns it into a RequestRecord.

A token chunk is an SSE event whose `choices` list is non-empty, whatever its text — as `vllm bench serve` counts
them. Its text may legitimately be empty (half a UTF-8 character, a special token): the server still spent a
decode step on it, and pdserve sends exactly one token per chunk, so counting only chunks with text would merge
gaps and delay TTFT. The usage chunk (`choices: []`) is not a token chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import httpx

from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestRecord

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERROR_CHARS = 500


def api_root(base_url: str) -> str:
    """The server root from a base URL written either way: http://h:8000, http://h:8000/ or http://h:8000/v1."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def request_body(
    model: str,
    endpoint: str,
    req: BenchRequest,
    extra_body: dict | None = None,
    history: Sequence[tuple[str, str]] = (),
) -> dict:
    """The JSON body: greedy, streamed with a usage chunk, exactly req.output_len tokens (ignore_eos).
    history: the (user message, answer) pairs of a conversation's earlier turns, sent before req.prompt — chat as
    alternating user/assistant messages, completions as their texts run together (req.prefix first in both: the
    system message in chat). extra_body keys override these."""
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINT_PATHS)}, got {endpoint!r}")
    body: dict = {"model": model}
    if endpoint == "chat":
        messages = [{"role": "system", "content": req.prefix}] if req.prefix else []
        for user, answer in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": req.prompt})
        body |= {"messages": messages, "max_completion_tokens": req.output_len}
    else:
        prompt = req.prefix + "".join(user + answer for user, answer in history) + req.prompt
        body |= {"prompt": prompt, "max_tokens": req.output_len}
    body |= {
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body | (extra_body or {})


async def send(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    endpoint: str,
    req: BenchRequest,
    api_key: str | None,
    start_ref: float,
    extra_body: dict | None = None,
    history: Sequence[tuple[str, str]] = (),
) -> RequestRecord:
    """POST one streamed request (after `history`, see request_body) and time it with time.perf_counter();
    start_s is relative to start_ref (a perf_counter value). The streamed text is kept in the record's
    generated_text. Never raises for what the server or the network does: a non-200 (status and body), an error
    event, a malformed event, a stream cut before [DONE] or a transport error is a failed record."""
    url = api_root(base_url) + ENDPOINT_PATHS.get(endpoint, "")
    body = request_body(model, endpoint, req, extra_body, history)
    headers = {"X-Request-Id": f"bench-{uuid.uuid4().hex}"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    record = RequestRecord(req.kind, req.prompt_len, req.output_len, start_s=0.0, success=False)
    sent = time.perf_counter()
    record.start_s = sent - start_ref
    try:
        async with http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {resp.status_code}: {_error_text(text)}"
                return record
            await _read_stream(resp.aiter_lines(), record, sent)
    except Exception as exc:  # any failure of one request is that request's result, never the run's
        record.success = False
        record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS] or type(exc).__name__
    return record


async def _read_stream(lines: AsyncIterator[str], record: RequestRecord, sent: float) -> None:
    """Fill `record` from the SSE lines of a 200 response."""
    chunks = 0
    last_token = sent
    usage_tokens: int | None = None
    async for data in sse_events(lines):
        now = time.perf_counter()
        if data == "[DONE]":
            record.latency_s = now - sent
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"malformed SSE event: {data[:200]!r}"
            return
        if not isinstance(event, dict):
            record.error = f"malformed SSE event: {data[:200]!r}"
            return
        if event.get("error") is not None:
            record.error = f"error event: {_error_text(json.dumps(event))}"
            return
        if choices := event.get("choices"):
            record.generated_text += _choice_text(choices[0])
            if chunks == 0:
                record.ttft_s = now - sent
            else:
                record.itl_s.append(now - last_token)
            chunks += 1
            last_token = now
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                # The server's count wins (as in vLLM): for chat it includes the chat template.
                record.prompt_len = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                record.cached_tokens = details["cached_tokens"]
    else:
        record.error = "the stream ended before data: [DONE]"
        return
    if chunks == 0:
        record.error = "no token chunk before [DONE]"
        return
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.success = True


def _choice_text(choice: object) -> str:
    """The text one streamed choice adds: `text` (completions) or `delta.content` (chat); "" when it has none."""
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event. Multi-line data is joined with "\\n" (the SSE rule); comments (":"),
    event/id/retry fields and stray blank lines are skipped. A last event not closed by a blank line still counts.
    A server that omits the blank line between `data:` lines is tolerated: joined data that is not valid JSON is
    split back into its lines."""
    data: list[str] = []
    async for line in lines:
        if line:
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value.removeprefix(" "))
            continue
        for event in _split(data):
            yield event
        data = []
    for event in _split(data):
        yield event


def _split(data: list[str]) -> list[str]:
    if len(data) <= 1:
        return data
    joined = "\n".join(data)
    try:
        json.loads(joined)
    except json.JSONDecodeError:
        return data
    return [joined]


def _error_text(body: str) -> str:
    """The message of an OpenAI-style {"error": {"message": ...}} body, else the body itself, cut short."""
    try:
        err = json.loads(body)["error"]
        message = err["message"] if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, KeyError, TypeError):
        message = body
    return str(message).strip()[:MAX_ERROR_CHARS]
