"""The gateway's litestar application: `create_app(settings, backend=None, drain=None)`.

With no backend given, the lifespan opens a NatsBackend from the settings (connecting in the
background, so /health answers while NATS is away) and closes it in `finally`, or earlier when a drain
runs out of time (closing ends its open requests with a clear error). A backend passed in (tests,
embedding) belongs to the caller. `drain` (draining.py) is the shutdown state the server shares with the
routes; the CLI's DrainingServer sets it on SIGTERM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components

from services.gateway.admin import ADMIN_ROUTES
from services.gateway.backend import GatewayBackend
from services.gateway.draining import Drain
from services.gateway.errors import EXCEPTION_HANDLERS
from services.gateway.middleware import admin_key_guard, api_key_guard, echo_request_id
from services.gateway.nats_backend import NatsBackend
from services.gateway.routes import PROBE_ROUTES, V1_ROUTES
from services.gateway.schemas import API_KEY_REQUIRED, SECURITY_SCHEMES, declare_limits
from services.gateway.served_model import ServedModel
from services.gateway.tokenize import TOKENIZE_ROUTES
from services.gateway.unsupported import document_fields
from shared.settings import GatewaySettings


def _backend(state: State) -> GatewayBackend:
    return state.backend


def _model(state: State) -> ServedModel:
    return state.model


def _drain(state: State) -> Drain:
    return state.drain


def create_app(
    settings: GatewaySettings, backend: GatewayBackend | None = None, drain: Drain | None = None
) -> Litestar:
    model = ServedModel.load(settings)  # fails fast on a wrong checkpoint path, before serving anything
    drain = drain or Drain(settings.drain_timeout_s)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        owned: NatsBackend | None = None

        async def close_owned() -> None:  # once: at a drain's expiry or at the end, whichever comes first
            nonlocal owned
            closing, owned = owned, None
            if closing is not None:
                await closing.close()

        opened = app.state.backend is None
        if opened:
            owned = NatsBackend(settings)
            await owned.start()
            app.state.backend = owned
            drain.on_expiry(close_owned)
        try:
            yield
        finally:
            if opened:
                await close_owned()
                app.state.backend = None

    v1 = Router(
        "/v1",
        route_handlers=V1_ROUTES,
        guards=[api_key_guard(settings.api_keys)] if settings.api_keys else None,
        security=API_KEY_REQUIRED if settings.api_keys else None,  # what the guard asks for, in the document
    )
    # vLLM serves /tokenize and /detokenize beside /v1, not under it; they take the same keys
    tokenizer = Router(
        "/",
        route_handlers=TOKENIZE_ROUTES,
        guards=[api_key_guard(settings.api_keys)] if settings.api_keys else None,
        security=API_KEY_REQUIRED if settings.api_keys else None,
    )
    # the operator's API (admin.py): its own keys; off (403) without them
    admin = Router("/admin", route_handlers=ADMIN_ROUTES, guards=[admin_key_guard(settings.admin_keys)])
    app = Litestar(
        route_handlers=[v1, tokenizer, admin, *PROBE_ROUTES],
        dependencies={
            "backend": Provide(_backend, sync_to_thread=False),
            "model": Provide(_model, sync_to_thread=False),
            "drain": Provide(_drain, sync_to_thread=False),
        },
        state=State({"backend": backend, "model": model, "drain": drain}),
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[echo_request_id],
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # the process's own logging (format with trace ids, set by the CLI) stays as is
        openapi_config=OpenAPIConfig(
            title="pdserve gateway",
            version="0.1.0",
            path="/schema",
            components=Components(security_schemes=SECURITY_SCHEMES),
        ),
    )
    declare_limits(app.openapi_schema, model, settings.max_body_bytes)  # builds the document now, once
    document_fields(app.openapi_schema)  # OpenAI's fields that are refused or ignored, with their status
    return app
