"""JSON Schemas (and regexes / choices) that a random-weight model can always finish under constraint.

A random model never decides to close a string or an array, so every schema bounds what it allows: strings by
maxLength (at most 8 characters, so at most 32 bytes = 32 byte-level tokens), integers by minimum/maximum (a
finite set of digit strings), arrays by maxItems, objects by additionalProperties false (no free keys). Unbounded
numbers (fraction digits) and free-form objects are left out on purpose. The longest output any of these can
have stays well under MAX_TOKENS, so a constrained generation always ends with EOS inside the budget.
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 400

_STR = {"type": "string", "maxLength": 8}
_INT = {"type": "integer", "minimum": -50, "maximum": 500}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": _obj({"name": _STR, "age": _INT, "ok": {"type": "boolean"}}),
    "enum": _obj({"level": {"enum": ["low", "mid", "high"]}, "code": {"const": "X1"}}),
    "nested": _obj({"user": _obj({"id": _INT, "nick": _STR}), "active": {"type": "boolean"}}),
    "array": _obj({"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}}),
    "array_of_objects": {"type": "array", "items": _obj({"x": _INT, "y": _INT}), "minItems": 1, "maxItems": 2},
    "optional": _obj({"a": _INT, "b": _STR, "c": {"type": "boolean"}}, required=["a"]),
    "nullable": _obj({"v": {"anyOf": [_INT, {"type": "null"}]}, "w": {"type": ["string", "null"], "maxLength": 4}}),
    "pattern": _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "one_of_shapes": {"anyOf": [_obj({"kind": {"const": "a"}, "n": _INT}), _obj({"kind": {"const": "b"}, "s": _STR})]},
    "deep": _obj({"l1": _obj({"l2": _obj({"l3": _obj({"leaf": {"enum": [1, 2, 3]}})})})}),
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "small_ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
}

REGEXES = [r"[a-c]{2,5}-[0-9]{1,3}", r"(true|false)", r"[A-Z][a-z]{0,6} [0-9]{2}"]
CHOICES = [["red", "green", "blue"], ["yes, sir", "no"]]
