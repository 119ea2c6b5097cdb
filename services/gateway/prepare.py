"""From a validated-by-schema request to what the backend runs: prompt token ids, sampling, stop strings.

Everything a client can get wrong is checked here and raised as a 4xx APIError naming the field; a
request that passes is one every worker accepts (the rules shared/sampling_spec.py declares for the engine's
SamplingParams too, read without importing torch into the gateway).

Limits: the body is at most max_body_bytes (litestar answers 413); a prompt at most
ServedModel.max_prompt_tokens tokens (settings.max_prompt_tokens, else the context less one). Work grows with
what a client sends and runs on the event loop, so it is bounded before it is done: text that cannot fit in
the token limit is refused before the chat template renders or the tokenizer runs, as are more messages than
the limit has tokens; stop strings (matched against every generated token) and stop token ids are capped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from services.gateway.errors import APIError
from services.gateway.sampling_fields import Scoring, chat_scoring, completion_scoring, distribution_fields
from services.gateway.schemas import (  # the limits live with the schema, which declares them in /schema
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.gateway.served_model import ServedModel
from services.gateway.structured import checked, requested_spec
from services.gateway.tools.choice import ToolPlan, plan_tools
from services.gateway.tools.parsers import ToolParser
from services.gateway.tools.registry import parser_for
from shared import sampling_spec as spec
from shared.messages import Sampling
from shared.model.tokenizer import ChatTemplateError
from shared.structured.spec import StructuredSpec

COMPLETIONS_DEFAULT_MAX_TOKENS = spec.MAX_TOKENS.default  # OpenAI's; chat's is the room left in the context
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    sampling: Sampling
    stop: tuple[str, ...]  # stop strings, applied by the gateway on the text
    stream: bool
    include_usage: bool  # streaming: send the usage chunk
    scoring: Scoring = Scoring()  # logprobs and echo
    tool_parser: ToolParser | None = None  # chat with tools: the output is read back into tool_calls
    n: int = 1  # choices: the prompt is computed once, choice i seeded seed + i (shared/choices.py)
    cache_salt: str | None = None  # the request's own prefix-cache salt (the tenant's is added at dispatch)
    cache_key: str | None = None  # prompt_cache_key: an affinity hint for routing


def prepare_chat(req: ChatCompletionRequest, model: ServedModel) -> Prepared:
    _check_model(req.model, model)
    _check_common(req)
    scoring = chat_scoring(req)
    tools = plan_tools(req, parser_for(model.tool_call_parser, model.tokenizer.chat_template))
    prompt = _chat_prompt(req, model, tools)
    requested = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = _max_tokens(requested, param, _fitting(prompt, "messages", model), model, default=None)
    prepared = _prepared(req, prompt, max_tokens, model, scoring, tools)
    return replace(prepared, tool_parser=tools.parser) if tools is not None else prepared


def prepare_completion(req: CompletionRequest, model: ServedModel) -> Prepared:
    _check_model(req.model, model)
    _check_common(req)
    scoring = completion_scoring(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(
            400,
            f"best_of must equal n ({req.n or 1}), got {req.best_of}: ranking more candidates than are returned is "
            "not served",
            "best_of",
        )
    prompt = _completion_prompt(req.prompt, model)
    prompt_len = _fitting(prompt, "prompt", model)
    max_tokens = _max_tokens(req.max_tokens, "max_tokens", prompt_len, model, COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _prepared(req, prompt, max_tokens, model, scoring)


def _structured(
    req: ChatCompletionRequest | CompletionRequest, model: ServedModel, tools: ToolPlan | None
) -> StructuredSpec | None:
    """The output constraint (compiled, so that a bad one is a 400 here): the request's own, or the tool call
    that tool_choice required / named. Both at once is a 400."""
    asked = requested_spec(req)
    if tools is not None and tools.constraint is not None:
        if asked is not None:
            raise APIError(400, f"{asked[1]} cannot be combined with a required or named tool_choice", asked[1])
        asked = (tools.constraint, "tools")
    return checked(*asked, model.grammars) if asked is not None else None


def _check_model(requested: str | None, model: ServedModel) -> None:
    if requested is not None and requested != model.name:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{model.name}`", "model")


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    """What both request kinds must satisfy before their prompt is looked at (n is checked against the served
    model's max_n when the request is prepared: _choices)."""


def _chat_prompt(req: ChatCompletionRequest, model: ServedModel, tools: ToolPlan | None) -> list[int]:
    if not req.messages:
        raise APIError(400, "messages must contain at least one message", "messages")
    if len(req.messages) > model.max_prompt_tokens:
        reason = f"too many messages: {len(req.messages)}, for prompts of at most {model.max_prompt_tokens} tokens"
        raise APIError(400, reason, "messages")
    messages: list[dict[str, Any]] = []
    chars = 0
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            roles = ", ".join(sorted(CHAT_ROLES))
            raise APIError(400, f"unknown role {m.role!r}; use one of {roles}", f"messages[{i}].role")
        message: dict[str, Any] = {"role": m.role, "content": _text_content(m.content, i)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:  # arguments as objects, as chat templates (and transformers) expect them
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
        chars += len(message["content"]) + len(m.name or "")
    _check_text_length(chars, "messages", model)  # before the template renders: it only adds text
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        rendered = tools.template_tools if tools is not None else None
        text = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=rendered
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from exc
    _check_text_length(len(text), "messages", model)
    # The template already writes any BOS it wants (Tokenizer.encode_chat, in two steps).
    return model.tokenizer.encode(text, add_special_tokens=False)


def _template_call(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except (json.JSONDecodeError, RecursionError):  # not JSON (or nested past the parser): the text as it is
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def _check_text_length(chars: int, param: str, model: ServedModel) -> None:
    """Refuse, without tokenizing, text too long to fit in max_prompt_tokens whatever its tokens."""
    if chars > model.max_prompt_chars:
        raise APIError(
            400,
            f"The prompt is too long: {chars} characters cannot fit in {model.max_prompt_tokens} tokens, the "
            "longest prompt this server accepts.",
            param,
        )


def _text_content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            got = "a text part without `text`" if part.type == "text" else f"a {part.type!r} part"
            raise APIError(400, f"only text content is supported, got {got}", f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)


def _completion_prompt(prompt: str | list[Any], model: ServedModel) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_text_length(len(prompt), "prompt", model)
        ids = model.tokenizer.encode(prompt) if prompt else []
    elif all(type(t) is int for t in prompt):
        ids = list(prompt)
        _fitting(ids, "prompt", model)  # before looking at every id
    elif all(isinstance(p, str | list) for p in prompt):
        raise APIError(400, "only one prompt per request is supported", "prompt")
    else:
        raise APIError(400, "prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise APIError(400, "prompt must not be empty", "prompt")
    _check_token_ids(ids, model, "prompt")
    return ids


def _check_token_ids(ids: list[int], model: ServedModel, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", param)


def _fitting(prompt: list[int], param: str, model: ServedModel) -> int:
    """The prompt's length, once checked against max_prompt_tokens (which leaves room for at least one
    generated token)."""
    if len(prompt) <= model.max_prompt_tokens:
        return len(prompt)
    limit = model.max_model_len
    if model.max_prompt_tokens < limit - 1:  # the server's own limit, stricter than the model's
        message = (
            f"This server accepts prompts of at most {model.max_prompt_tokens} tokens, and your prompt has "
            f"{len(prompt)} tokens."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens, and your prompt has {len(prompt)} tokens: "
            "it must be shorter than the context to leave room for at least one generated token."
        )
    raise APIError(400, message, param)


def _max_tokens(requested: int | None, param: str, prompt_len: int, model: ServedModel, default: int | None) -> int:
    """The generation budget. None = `default`, capped by the room left (all of it when default is None)."""
    limit = model.max_model_len
    room = limit - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            f"Please reduce the length of the prompt or {param} (at most {room}).",
            param,
        )
    return requested


def _prepared(
    req: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    max_tokens: int,
    model: ServedModel,
    scoring: Scoring,
    tools: ToolPlan | None = None,
) -> Prepared:
    stop_token_ids = list(req.stop_token_ids or [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_token_ids)}", "stop_token_ids")
    _check_token_ids(stop_token_ids, model, "stop_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    sampling = Sampling(
        max_tokens=max_tokens,
        seed=req.seed,
        stop_token_ids=stop_token_ids,
        logprobs=scoring.logprobs,
        prompt_logprobs=scoring.prompt_logprobs,
        **distribution_fields(req, model),
        structured=_structured(req, model, tools),
    )
    return Prepared(
        prompt_token_ids=prompt,
        sampling=sampling,
        stop=tuple(s for s in stop if s),  # an empty stop string would end every request at once: ignored
        stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        n=_choices(req.n, model),
        scoring=scoring,
        cache_salt=req.cache_salt,
        cache_key=req.prompt_cache_key,
    )


def _choices(n: int | None, model: ServedModel) -> int:
    if n is not None and not 1 <= n <= model.max_n:
        raise APIError(400, f"n must be between 1 and {model.max_n} (this server's max_n), got {n}", "n")
    return n or 1
