"""Cross-cutting HTTP concerns: who may call /v1 (API keys), and the X-Request-Id echo."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.handlers import BaseRouteHandler
from litestar.types import Guard, Message, Scope

from services.gateway.errors import APIError

REQUEST_ID_HEADER = "x-request-id"


def api_key_guard(keys: tuple[str, ...]) -> Guard:
    """Require `Authorization: Bearer <one of keys>` (compared in constant time)."""
    accepted = [k.encode() for k in keys]

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header `Authorization: Bearer <key>`")
        if not any(secrets.compare_digest(token.encode(), key) for key in accepted):
            raise APIError(401, "invalid API key")

    return guard


async def echo_request_id(message: Message, scope: Scope) -> None:
    """before_send hook (so it covers every response, errors and unknown routes included): the
    client's X-Request-Id back, or a fresh one."""
    if message["type"] != "http.response.start":
        return
    sent = next((v for k, v in scope.get("headers", ()) if k == REQUEST_ID_HEADER.encode()), None)
    headers = MutableScopeHeaders.from_message(message)
    headers[REQUEST_ID_HEADER] = sent.decode("latin-1") if sent else uuid.uuid4().hex
