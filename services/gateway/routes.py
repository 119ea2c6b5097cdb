"""HTTP routes: the OpenAI-compatible API under /v1, plus /health and /ready.

A completion request: decode strictly (decoding.py) → validate and tokenize (prepare.py) → dispatch
(generation.py over the GatewayBackend) → one JSON body, or SSE events (sse.py). Every error before the first
streamed byte is a plain JSON error with its HTTP status, even with stream=true: among them 429 with
`Retry-After` when admission refuses the request (admission.py), and 503 while the gateway drains
(draining.py), when /ready says 503 too.
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
from services.gateway.backend import (
    BackendUnavailable,
    GatewayBackend,
    GenerationJob,
    Overloaded,
    RequestStatsSink,
)
from services.gateway.choices import ChoiceSet
from services.gateway.decoding import StrictJSON
from services.gateway.disconnect import until_disconnect
from services.gateway.draining import Drain
from services.gateway.errors import APIError, ErrorBody, error_response, error_responses
from services.gateway.generation import Generation, GenerationError
from services.gateway.middleware import tenant
from services.gateway.observe import RequestObserver
from services.gateway.prepare import Prepared, prepare_chat, prepare_completion
from services.gateway.responses import ResponseWriter, new_request_id
from services.gateway.schemas import (
    COMPLETION_ERRORS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionOperation,
    CompletionRequest,
    ModelCard,
    ModelList,
    Status,
    responses,
)
from services.gateway.served_model import ServedModel
from shared.prefix_hash import request_salt
from shared.telemetry import metrics, tracing

AnyRequest = Request[Any, Any, Any]


@post(
    "/chat/completions",
    dto=StrictJSON[ChatCompletionRequest],
    return_dto=None,
    status_code=200,
    responses=responses(ChatCompletion, *COMPLETION_ERRORS),
    operation_class=CompletionOperation,
)
async def chat_completions(
    data: JSONBody[ChatCompletionRequest],
    request: AnyRequest,
    backend: NamedDependency[GatewayBackend],
    model: NamedDependency[ServedModel],
    drain: NamedDependency[Drain],
) -> Response[ChatCompletion] | Stream:
    """Chat completion (OpenAI-compatible); `stream: true` answers with server-sent events."""
    arrived = time.time(), time.perf_counter()
    _refuse_while_draining(drain, model)
    return await _complete(request, backend, model, prepare_chat(data, model), arrived, chat=True)


@post(
    "/completions",
    dto=StrictJSON[CompletionRequest],
    return_dto=None,
    status_code=200,
    responses=responses(Completion, *COMPLETION_ERRORS),
    operation_class=CompletionOperation,
)
async def completions(
    data: JSONBody[CompletionRequest],
    request: AnyRequest,
    backend: NamedDependency[GatewayBackend],
    model: NamedDependency[ServedModel],
    drain: NamedDependency[Drain],
) -> Response[Completion] | Stream:
    """Text completion (OpenAI-compatible); `stream: true` answers with server-sent events."""
    arrived = time.time(), time.perf_counter()
    _refuse_while_draining(drain, model)
    return await _complete(request, backend, model, prepare_completion(data, model), arrived, chat=False)


def _refuse_while_draining(drain: Drain, model: ServedModel) -> None:
    if drain.draining:
        metrics.REQUESTS_REJECTED.labels(model.name, "gateway", "draining").inc()
        raise APIError(503, "the gateway is shutting down (draining): send the request to another replica")


async def _complete(
    request: AnyRequest,
    backend: GatewayBackend,
    model: ServedModel,
    prepared: Prepared,
    arrived: tuple[float, float],
    chat: bool,
) -> Response[Any] | Stream:
    request_id = new_request_id(chat)
    operation = tracing.CHAT if chat else tracing.TEXT_COMPLETION
    prompt_tokens = len(prepared.prompt_token_ids)
    observer = RequestObserver(
        operation,
        model.name,
        request_id,
        request.headers,
        arrived,
        prepared.sampling.max_tokens,
        prompt_tokens,
        stats=backend if isinstance(backend, RequestStatsSink) else None,
    )
    job = GenerationJob(
        request_id,
        model.name,
        prepared.prompt_token_ids,
        prepared.sampling,
        observer.trace_context(),
        prepared.n,
        cache_salt=request_salt(tenant(request), prepared.cache_salt),
        cache_key=prepared.cache_key,
    )
    kind = ChoiceSet if prepared.n > 1 else Generation  # n choices: one dispatch, the prompt computed once
    gen = kind(backend, job, model.tokenizer, prepared.stop, observer, log_prompts=model.log_prompts)
    writer = ResponseWriter(
        request_id, model.name, chat, prepared.tool_parser, model.tokenizer, prepared.scoring, prepared.prompt_token_ids
    )
    try:
        await gen.open()
    except BackendUnavailable as exc:
        message = f"no worker can serve the request now: {exc}"
        gen.fail(message, 503)
        await gen.close()
        raise APIError(503, message) from exc
    except Overloaded as exc:
        gen.fail(exc.message, 429)
        await gen.close()
        raise APIError(429, exc.message, headers={"Retry-After": str(exc.retry_after_s)}) from exc
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


@get("/models", responses=error_responses(401))
async def list_models(model: NamedDependency[ServedModel]) -> ModelList:
    """The served model, with its context length (`max_model_len`)."""
    return ModelList(object="list", data=[_card(model)])


@get("/models/{model_id:path}", responses=error_responses(400, 401, 404))
async def retrieve_model(model_id: FromPath[str], model: NamedDependency[ServedModel]) -> ModelCard:
    if model_id.lstrip("/") != model.name:
        raise APIError(404, f"The model `{model_id.lstrip('/')}` does not exist", "model")
    return _card(model)


@get("/health", include_in_schema=True)
async def health() -> Status:
    """200 while the process is alive. Never needs an API key."""
    return Status(status="ok")


@get("/ready", responses=responses(Status, 503))
async def ready(
    backend: NamedDependency[GatewayBackend], drain: NamedDependency[Drain]
) -> Response[Status] | Response[ErrorBody]:
    """200 when NATS and Redis answer and live workers can serve the model; else 503 with the reason
    ("draining: ..." once the gateway is shutting down)."""
    if drain.draining:
        return error_response(503, "draining: the gateway is shutting down and takes no new requests")
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
