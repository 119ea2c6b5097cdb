"""Cross-cutting HTTP concerns: who may call /v1 (API keys) and /admin (admin keys), and the X-Request-Id echo."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.handlers import BaseRouteHandler
from litestar.types import Guard, Message, Scope

from services.gateway.errors import APIError

REQUEST_ID_HEADER = "x-request-id"
TENANT_STATE = "pdserve_tenant"  # connection state: the caller's tenant id (tenant_of), set by the API key guard


def tenant_of(key: bytes) -> str:
    """An API key's tenant id: each key is a tenant. A digest, so that the id can travel to the workers (in the
    prefix-cache salt) and into logs without the key itself."""
    return "key-" + hashlib.sha256(key).hexdigest()[:24]


def tenant(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The tenant the API key guard admitted the request as; None when the gateway has no API keys."""
    return connection.scope.get("state", {}).get(TENANT_STATE)


def api_key_guard(keys: tuple[str, ...]) -> Guard:
    """Require `Authorization: Bearer <one of keys>` (compared in constant time)."""
    accepted = [k.encode() for k in keys]

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header `Authorization: Bearer <key>`")
        matched = [key for key in accepted if secrets.compare_digest(token.encode(), key)]
        if not matched:
            raise APIError(401, "invalid API key")
        connection.scope.setdefault("state", {})[TENANT_STATE] = tenant_of(matched[0])

    return guard


def admin_key_guard(keys: tuple[str, ...]) -> Guard:
    """Require `Authorization: Bearer <one of the admin keys>` (constant-time compare): 401 without one or with
    another key (an API key is not an admin key); with no admin key configured, every call is refused (403): the
    admin API is off."""
    accepted = [k.encode() for k in keys]

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if not accepted:
            raise APIError(403, "the admin API is disabled: the gateway has no admin_keys (set PDSERVE_ADMIN_KEYS)")
        scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing admin key: send the header `Authorization: Bearer <admin key>`")
        if not any(secrets.compare_digest(token.encode(), key) for key in accepted):
            raise APIError(401, "invalid admin key")

    return guard


async def echo_request_id(message: Message, scope: Scope) -> None:
    """before_send hook (so it covers every response, errors and unknown routes included): the
    client's X-Request-Id back, or a fresh one."""
    if message["type"] != "http.response.start":
        return
    sent = next((v for k, v in scope.get("headers", ()) if k == REQUEST_ID_HEADER.encode()), None)
    headers = MutableScopeHeaders.from_message(message)
    headers[REQUEST_ID_HEADER] = sent.decode("latin-1") if sent else uuid.uuid4().hex
