"""HTTP routes: the OpenAI-compatible API under /v1, plus /health and /ready.

A completion request: decode strictly (decoding.py) → validate and tokenize (prepare.py) → dispatch
(generation.py over the Backend) → one JSON body, or SSE events (sse.py). Every error before the first
streamed byte is a plain JSON error with its HTTP status, even with stream=true.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import Stream

from services.gateway import sse
from services.gateway.backend import Backend, BackendUnavailable, GenerationJob
from services.gateway.decoding import StrictJSON
from services.gateway.disconnect import until_disconnect
from services.gateway.errors import APIError, ErrorBody, error_response
from services.gateway.generation import Generation, GenerationError
from services.gateway.observe import RequestObserver
from services.gateway.prepare import Prepared, prepare_chat, prepare_completion
from services.gateway.responses import ResponseWriter, new_request_id
from services.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    Status,
)
from services.gateway.served_model import ServedModel
from shared.telemetry import metrics, tracing

AnyRequest = Request[Any, Any, Any]


@post("/chat/completions", dto=StrictJSON[ChatCompletionRequest], return_dto=None, status_code=200)
async def chat_completions(
    data: JSONBody[ChatCompletionRequest],
    request: AnyRequest,
    backend: NamedDependency[Backend],
    model: NamedDependency[ServedModel],
) -> Response[ChatCompletion] | Stream:
    """Chat completion (OpenAI-compatible); `stream: true` answers with server-sent events."""
    arrived = time.time(), time.perf_counter()
    return await _complete(request, backend, model, prepare_chat(data, model), arrived, chat=True)


@post("/completions", dto=StrictJSON[CompletionRequest], return_dto=None, status_code=200)
async def completions(
    data: JSONBody[CompletionRequest],
    request: AnyRequest,
    backend: NamedDependency[Backend],
    model: NamedDependency[ServedModel],
) -> Response[Completion] | Stream:
    """Text completion (OpenAI-compatible); `stream: true` answers with server-sent events."""
    arrived = time.time(), time.perf_counter()
    return await _complete(request, backend, model, prepare_completion(data, model), arrived, chat=False)


async def _complete(
    request: AnyRequest,
    backend: Backend,
    model: ServedModel,
    prepared: Prepared,
    arrived: tuple[float, float],
    chat: bool,
) -> Response[Any] | Stream:
    request_id = new_request_id(chat)
    operation = tracing.CHAT if chat else tracing.TEXT_COMPLETION
    prompt_tokens = len(prepared.prompt_token_ids)
    observer = RequestObserver(
        operation, model.name, request_id, request.headers, arrived, prepared.sampling.max_tokens, prompt_tokens
    )
    job = GenerationJob(request_id, model.name, prepared.prompt_token_ids, prepared.sampling, observer.trace_context())
    gen = Generation(backend, job, model.tokenizer, prepared.stop, observer)
    writer = ResponseWriter(request_id, model.name, chat)
    try:
        await gen.open()
    except BackendUnavailable as exc:
        message = f"no worker can serve the request now: {exc}"
        gen.fail(message, 503)
        await gen.close()
        raise APIError(503, message) from exc
    streaming = False
    try:
        if not prepared.stream:
            await until_disconnect(request.receive, gen.collect())
            return Response(writer.whole(gen))
        await until_disconnect(request.receive, gen.wait_first())
        body = sse.events(gen, writer, prepared.include_usage)
        # the background close covers a client gone before the body generator ever started
        stream = Stream(body, media_type="text/event-stream", headers=sse.HEADERS, background=BackgroundTask(gen.close))
        streaming = True
        return stream
    except GenerationError as exc:
        raise APIError(exc.status, exc.message) from exc
    finally:
        if not streaming:
            await gen.close()


def _card(model: ServedModel) -> ModelCard:
    return ModelCard(
        id=model.name,
        object="model",
        created=model.created,
        owned_by="pdserve",
        root=model.name,
        max_model_len=model.max_model_len,
    )


@get("/models")
async def list_models(model: NamedDependency[ServedModel]) -> ModelList:
    """The served model, with its context length (`max_model_len`)."""
    return ModelList(object="list", data=[_card(model)])


@get("/models/{model_id:path}")
async def retrieve_model(model_id: FromPath[str], model: NamedDependency[ServedModel]) -> ModelCard:
    if model_id.lstrip("/") != model.name:
        raise APIError(404, f"The model `{model_id.lstrip('/')}` does not exist", "model")
    return _card(model)


@get("/health", include_in_schema=True)
async def health() -> Status:
    """200 while the process is alive. Never needs an API key."""
    return Status(status="ok")


@get("/ready")
async def ready(backend: NamedDependency[Backend]) -> Response[Status] | Response[ErrorBody]:
    """200 when NATS and Redis answer and live workers can serve the model; else 503 with the reason."""
    ok, reason = await backend.readiness()
    if not ok:
        return error_response(503, reason)
    return Response(Status(status="ready", detail=reason))


@get("/metrics", include_in_schema=False)
async def prometheus_metrics() -> Response[bytes]:
    """Prometheus text exposition of this process's metrics. Never needs an API key."""
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


V1_ROUTES = [chat_completions, completions, list_models, retrieve_model]
PROBE_ROUTES = [health, ready, prometheus_metrics]
