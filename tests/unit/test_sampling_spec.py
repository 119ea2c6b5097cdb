"""The sampling fields are declared once (shared/sampling_spec.py): the wire's Sampling, the engine's SamplingParams
and the gateway's request schema agree with the declaration field by field — names and order, types, defaults,
ranges — and the engine's parameters are built from the wire's with every field carried."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgspec
import pytest

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared import sampling_spec as spec
from shared.engine.sampling import SamplingParams
from shared.messages import Sampling
from shared.structured.spec import JSON_OBJECT
from shared.worker.engine_factory import sampling_params

_WIRE = msgspec.inspect.type_info(Sampling)
assert isinstance(_WIRE, msgspec.inspect.StructType)
_WIRE_FIELDS = {f.name: f for f in _WIRE.fields}
_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_INSPECTED = {
    int: msgspec.inspect.IntType,
    float: msgspec.inspect.FloatType,
    bool: msgspec.inspect.BoolType,
    list: msgspec.inspect.ListType,
    dict: msgspec.inspect.DictType,
    object: msgspec.inspect.StructType,
}


def _bare(t: msgspec.inspect.Type) -> msgspec.inspect.Type:
    """The type without its metadata (a description, extra JSON Schema)."""
    return _bare(t.type) if isinstance(t, msgspec.inspect.Metadata) else t


def _plain(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, bool]:
    """(the type without None and metadata, whether None was allowed)."""
    t = _bare(t)
    if isinstance(t, msgspec.inspect.UnionType):
        (inner,) = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        return _bare(inner), True
    return t, False


def _range_of(t: msgspec.inspect.Type) -> spec.Range | None:
    """The numeric constraints of an inspected int / float type, as a Range (None when it has none)."""
    t = _bare(t)
    assert isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType)
    if (t.ge, t.gt, t.le, t.lt) == (None, None, None, None):
        return None
    return spec.Range(
        low=t.ge if t.gt is None else t.gt,
        high=t.le if t.lt is None else t.lt,
        low_open=t.gt is not None,
        high_open=t.lt is not None,
    )


def _params(name: str, value: float) -> SamplingParams:
    fields: dict[str, Any] = {name: value}
    return SamplingParams(**fields)


def _empty(value: object) -> object:
    """Defaults compare as values: an empty list, tuple or dict is one empty collection."""
    return () if value in ([], (), {}) else value


def test_the_declaration_lists_each_field_once_in_the_consumers_order():
    names = [f.name for f in spec.SAMPLING_FIELDS]
    assert len(set(names)) == len(names)
    assert list(_WIRE_FIELDS) == names
    assert list(_ENGINE_FIELDS) == names


@pytest.mark.parametrize("field", spec.SAMPLING_FIELDS, ids=lambda f: f.name)
def test_the_wire_struct_is_the_declaration(field: spec.SamplingField[object]):
    wire = _WIRE_FIELDS[field.name]
    kind, optional = _plain(wire.type)
    assert isinstance(kind, _INSPECTED[field.kind])
    assert optional == field.optional
    if field.wire_required:
        assert wire.required
    else:
        assert _empty(wire.default if wire.default is not msgspec.NODEFAULT else wire.default_factory()) == _empty(
            field.default
        )
    if isinstance(kind, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        assert _range_of(kind) == field.range
    if isinstance(kind, msgspec.inspect.DictType):
        assert _range_of(kind.value_type) == field.item_range


@pytest.mark.parametrize("field", spec.SAMPLING_FIELDS, ids=lambda f: f.name)
def test_the_engine_params_are_the_declaration(field: spec.SamplingField[object]):
    assert _empty(_ENGINE_FIELDS[field.name].default) == _empty(field.default)
    r = field.range
    if r is None:
        return
    step = 1 if field.kind is int else 1e-6
    for bound, inside in ((r.low, not r.low_open), (r.high, not r.high_open)):
        if bound is None:
            continue
        outside = bound - step if bound == r.low else bound + step
        if inside:
            _params(field.name, bound)  # accepted
        else:
            with pytest.raises(ValueError, match=field.name):
                _params(field.name, bound)
        with pytest.raises(ValueError, match=field.name):
            _params(field.name, outside)
    with pytest.raises(ValueError, match=field.name):
        _params(field.name, math.nan)


def test_the_engine_refuses_a_bias_out_of_the_declared_range():
    item = spec.LOGIT_BIAS.item_range
    assert item is not None and item.high is not None
    SamplingParams(logit_bias=((1, item.high),))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, item.high + 1),))


@pytest.mark.parametrize("request_kind", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("field", spec.SAMPLING_FIELDS, ids=lambda f: f.name)
def test_the_request_schema_takes_the_declared_range(request_kind, field: spec.SamplingField[object]):
    """A request field of a declared name has the API's range where one is declared, else the wire's (the
    completions API's max_tokens takes 0, to score a prompt). The API's `logprobs` is another field than the wire's
    (chat's a switch, with top_logprobs as the count: the next test; completions' the legacy count)."""
    info = msgspec.inspect.type_info(request_kind)
    assert isinstance(info, msgspec.inspect.StructType)
    request = {f.name: f for f in info.fields}
    if field.name not in request or field.kind not in (int, float):
        return
    if field is spec.LOGPROBS:
        return
    kind, optional = _plain(request[field.name].type)
    assert optional  # a request may leave any field out (or send null): the declared default applies
    api_range = field.api_range
    if request_kind is CompletionRequest and field is spec.MAX_TOKENS:
        api_range = None
    assert _range_of(kind) == (api_range or field.range)


def test_top_logprobs_takes_the_declared_logprobs_range():
    info = msgspec.inspect.type_info(ChatCompletionRequest)
    assert isinstance(info, msgspec.inspect.StructType)
    (top,) = [f for f in info.fields if f.name == "top_logprobs"]
    assert _range_of(_plain(top.type)[0]) == spec.LOGPROBS.range


def test_the_engine_params_carry_every_wire_field():
    wire = Sampling(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop_token_ids=[4, 2],
        ignore_eos=True,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        min_p=0.1,
        logit_bias={9: 2.0, 3: -1.0},
        logprobs=2,
        prompt_logprobs=1,
        structured=JSON_OBJECT,
    )
    non_default = [f.name for f in spec.SAMPLING_FIELDS if _empty(getattr(wire, f.name)) == _empty(f.default)]
    assert non_default == []  # the example sets every field: none could be dropped unseen
    params = sampling_params(wire)
    for field in spec.SAMPLING_FIELDS:
        value = getattr(wire, field.name)
        expected = {
            "stop_token_ids": tuple(wire.stop_token_ids),
            "logit_bias": tuple(sorted(wire.logit_bias.items())),
        }.get(field.name, value)
        assert getattr(params, field.name) == expected, field.name
    assert sampling_params(wire, max_tokens=1).max_tokens == 1
