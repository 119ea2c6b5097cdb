"""The OpenAI error shape, `{"error": {"message", "type", "param", "code"}}` with code = HTTP status, and
the exception handlers that put every failure into it (litestar's own 404/405/413/400 included).

Client mistakes are 4xx, always: the OpenAI SDK retries every 5xx. `error_responses` declares the statuses a
route can answer, in this shape, for the OpenAPI document (/schema): what the document says is what is sent.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

log = logging.getLogger(__name__)

_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "internal_server_error"


class APIError(Exception):
    """Raise anywhere in a request to answer `status` with this message in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_MEANINGS = {
    400: "Invalid request: the field at fault is named in `param`",
    401: "Missing or invalid API key (only when the gateway has keys)",
    404: "No such model",
    413: "The request body is larger than the gateway's limit",
    415: "The request body is not JSON (Content-Type)",
    429: "Overloaded: retry after `Retry-After` seconds",
    500: "The request failed inside the serving plane",
    503: "No worker can serve the request now, or the gateway is draining (shutting down)",
    504: "The request ran past its deadline",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI `responses=` of a route: each status documented with the error shape."""
    return {
        status: ResponseSpec(ErrorBody, description=_MEANINGS[status], generate_examples=False) for status in statuses
    }


def error_body(status: int, message: str, param: str | None = None) -> ErrorBody:
    return ErrorBody(ErrorDetail(message=message, type=error_type(status), param=param, code=status))


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response[ErrorBody]:
    return Response(error_body(status, message, param), status_code=status, headers=headers)


def _api_error(_: Request[Any, Any, Any], exc: APIError) -> Response[ErrorBody]:
    return error_response(exc.status, exc.message, exc.param, exc.headers)


def _http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorBody]:
    status = exc.status_code
    message, param = exc.detail or HTTPStatus(status).phrase, None
    if isinstance(exc, NotFoundException) and exc.detail in ("Not Found", ""):
        message = f"no route for {request.method} {request.url.path}"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        message = f"the request body is larger than the limit of {limit} bytes"
    elif isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        param = first.get("key")
        message = "the request body is empty: send a JSON object" if param == "data" else str(first.get("message"))
        param = None if param == "data" else param
    if status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.detail, exc_info=exc)
    return error_response(status, message, param, exc.headers)


def _unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorBody]:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_exception, Exception: _unexpected}
