"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: the served model's own tokenizer and chat
template, so a client can count a prompt's tokens (and see the context, `max_model_len`) before sending it.

/tokenize takes a `prompt` (text; special tokens added unless `add_special_tokens` is false) or chat `messages`
(rendered as /v1/chat/completions renders them, with the same checks; `add_generation_prompt` defaults to true,
`add_special_tokens` to false because the template writes its own). It answers `{count, max_model_len, tokens}`,
plus `token_strs` when `return_token_strs`. The count is what a completion request would send the model; a
prompt longer than the context is counted, not refused. /detokenize takes `tokens` and answers `{prompt}`, the
text with special tokens spelled out, so that tokenize and detokenize round-trip.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from services.gateway.decoding import StrictJSON
from services.gateway.errors import APIError
from services.gateway.prepare import _chat_prompt, _check_model, _check_token_ids  # the chat route's own checks
from services.gateway.schemas import ChatCompletionRequest, ChatMessage, responses
from services.gateway.served_model import ServedModel

TOKENIZE_ERRORS = (400, 401, 404, 413, 415)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Exactly one of `prompt` and `messages`."""

    model: str | None = None  # None = the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None  # vLLM's; only false (the chat API has no such option)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only with return_token_strs


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: Annotated[list[int], msgspec.Meta(description="token ids, each below the vocabulary size")]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


@post("/tokenize", dto=StrictJSON[TokenizeRequest], return_dto=None, status_code=200,
      responses=responses(TokenizeResponse, *TOKENIZE_ERRORS))  # fmt: skip
async def tokenize(data: JSONBody[TokenizeRequest], model: NamedDependency[ServedModel]) -> TokenizeResponse:
    """Token ids of a prompt or of chat messages, with the context length (vLLM's /tokenize)."""
    _check_model(data.model, model)
    tokens = _tokens(data, model)
    strs = [model.tokenizer.id_to_token(t) or "" for t in tokens] if data.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens, token_strs=strs)


@post("/detokenize", dto=StrictJSON[DetokenizeRequest], return_dto=None, status_code=200,
      responses=responses(DetokenizeResponse, *TOKENIZE_ERRORS))  # fmt: skip
async def detokenize(data: JSONBody[DetokenizeRequest], model: NamedDependency[ServedModel]) -> DetokenizeResponse:
    """The text of token ids, special tokens included (vLLM's /detokenize)."""
    _check_model(data.model, model)
    _check_token_ids(data.tokens, model, "tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(data.tokens, skip_special_tokens=False))


def _tokens(data: TokenizeRequest, model: ServedModel) -> list[int]:
    if (data.prompt is None) == (data.messages is None):
        raise APIError(400, "send exactly one of `prompt` (text) and `messages` (chat)", "prompt")
    if data.prompt is not None:
        if data.add_generation_prompt is not None or data.continue_final_message is not None:
            param = "add_generation_prompt" if data.add_generation_prompt is not None else "continue_final_message"
            raise APIError(400, f"`{param}` applies to `messages`, not to a `prompt`", param)
        add_special = True if data.add_special_tokens is None else data.add_special_tokens
        return model.tokenizer.encode(data.prompt, add_special_tokens=add_special)
    if data.continue_final_message:
        raise APIError(400, "continue_final_message is not supported", "continue_final_message")
    assert data.messages is not None
    chat = ChatCompletionRequest(messages=data.messages, add_generation_prompt=data.add_generation_prompt)
    tokens = _chat_prompt(chat, model, None)  # the template already wrote any special tokens it wants (no tools)
    if data.add_special_tokens:  # as vLLM does: the post-processor's own as well (a second BOS, say)
        text = model.tokenizer.decode(tokens, skip_special_tokens=False)
        tokens = model.tokenizer.encode(text, add_special_tokens=True)
    return tokens


TOKENIZE_ROUTES = [tokenize, detokenize]
