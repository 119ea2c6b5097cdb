"""Request bodies: strict JSON into msgspec schemas, every failure a 4xx in the OpenAI shape.

Litestar's own msgspec decoding is lenient ("0.5" → 0.5); `StrictJSON` is the DTO that routes use
instead: same OpenAPI schema, strict decoding, content type and UTF-8 checked, and the field at
fault reported as `param`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from litestar.dto import MsgspecDTO

from services.gateway.errors import APIError
from services.gateway.unsupported import refuse_unsupported

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=msgspec.Struct)  # what litestar's MsgspecDTO accepts (a request schema)

_AT = re.compile(r" - at `\$\.?(?P<path>.*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def decode_body(body: bytes, kind: type[T]) -> T:
    """Raises APIError(400) naming what is wrong (and where, as `param`)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}", _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's depth guard: arrays or objects nested thousands deep
        raise APIError(400, "the request body nests arrays or objects too deeply") from exc


def _param_of(message: str) -> str | None:
    at = _AT.search(message)
    missing = _MISSING.search(message)
    parts = [p for p in (at and at["path"], missing and missing["field"]) if p]
    return ".".join(parts) or None


def check_content_type(content_type: str | None) -> None:
    """JSON or nothing said (curl without -H, some benchmark clients); anything else is a 415."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}")


class StrictJSON(MsgspecDTO[RequestT]):
    """Use as `dto=StrictJSON[Schema], return_dto=None` on a handler taking `data: Schema`."""

    def decode_bytes(self, value: bytes) -> Any:
        check_content_type(self.asgi_connection.headers.get("content-type"))
        decoded = decode_body(value, self.model_type)
        refuse_unsupported(value, self.model_type)  # OpenAI's fields that pdserve does not serve: a 400 each
        return decoded

    @classmethod
    def create_openapi_schema(cls, field_definition: Any, handler_id: str, schema_creator: Any) -> Any:
        # document the schema itself, not the transfer model litestar would derive from it
        return schema_creator.for_field_definition(field_definition)
