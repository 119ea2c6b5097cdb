"""Structured output and tool calls through a live disaggregated stack (gateway, prefill worker, KV hand-off,
decode worker, as real processes) with the official openai client: what the model writes follows the schema /
regex / choice, token for token what one in-process engine writes (greedy; the prefill worker samples the first
token under the grammar, the decode worker replays it); tool calls come back parsed, streamed and not."""

from __future__ import annotations

import json
import re
import signal

import jsonschema
import openai
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from shared.structured import spec as specs
from tests.chaos import EventWatch, Load, gateway_metric
from tests.e2e.test_faults import FAST, busiest
from tests.e2e_support import start_stack
from tests.structured_cases import CHOICES, MAX_TOKENS, REGEXES, SCHEMAS

USER = [{"role": "user", "content": "Answer in the requested format."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc"]}}, "required": ["zone"]},
    },
}
E2E_SCHEMAS = ["flat", "nested", "array_of_objects", "one_of_shapes"]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def one_engine(model_dir):
    """The single-process engine's greedy outputs for a spec: what the stack must reproduce."""
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    prompt = tok.encode_chat(USER)

    def run(spec) -> str:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=spec)
        return tok.decode(engine.generate([prompt], params)[0])

    return run


def _chat(client, **kw):
    return client.chat.completions.create(
        **({"model": "demo", "messages": USER, "temperature": 0, "max_tokens": MAX_TOKENS} | kw)
    )


@pytest.mark.parametrize("name", E2E_SCHEMAS)
def test_json_schema_through_the_stack(client, one_engine, name):
    schema = SCHEMAS[name]
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    choice = _chat(client, response_format=rf).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert choice.message.content == one_engine(specs.json_schema(schema))


def test_json_object_regex_and_choice_through_the_stack(client, one_engine):
    obj = _chat(client, response_format={"type": "json_object"}).choices[0].message.content or ""
    assert isinstance(json.loads(obj), dict) and obj == one_engine(specs.JSON_OBJECT)
    for pattern in REGEXES:
        text = _chat(client, extra_body={"structured_outputs": {"regex": pattern}}).choices[0].message.content or ""
        assert re.fullmatch(pattern, text) and text == one_engine(specs.regex(pattern))
    for options in CHOICES:
        text = _chat(client, extra_body={"guided_choice": options}).choices[0].message.content
        assert text in options and text == one_engine(specs.choice(options))
    streamed = _chat(client, stream=True, extra_body={"structured_outputs": {"regex": REGEXES[0]}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == one_engine(specs.regex(REGEXES[0]))
    completion = client.completions.create(
        model="demo", prompt="x", max_tokens=64, temperature=0, extra_body={"guided_regex": REGEXES[1]}
    )
    assert re.fullmatch(REGEXES[1], completion.choices[0].text)


def test_invalid_schema_is_400(client):
    rf = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as excinfo:
        _chat(client, response_format=rf)
    assert excinfo.value.body["param"] == "response_format" and "nope" in excinfo.value.body["message"]


def _call(choice) -> tuple[str, dict]:
    (call,) = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and call.type == "function" and call.id
    return call.function.name, json.loads(call.function.arguments)


def test_required_and_named_tool_calls(client):
    tools = [WEATHER, TIME]
    name, args = _call(_chat(client, tools=tools, tool_choice="required").choices[0])
    (tool,) = [t for t in tools if t["function"]["name"] == name]
    jsonschema.validate(args, tool["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    name, args = _call(_chat(client, tools=tools, tool_choice=named, temperature=1.0, seed=4).choices[0])
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_streamed_tool_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _call(_chat(client, tools=[WEATHER], tool_choice=named).choices[0])
    chunks = list(_chat(client, tools=[WEATHER], tool_choice=named, stream=True))
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert (calls[0].function.name, json.loads("".join(tc.function.arguments or "" for tc in calls))) == whole
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_call_with_forced_output(client):
    """tool_choice auto: the model decides; here its output is forced (a regex) to be a call, which the gateway
    parses back; without a call, auto gives plain content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    forced = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)
    choice = _chat(client, tools=[WEATHER], extra_body={"structured_outputs": {"regex": forced}}).choices[0]
    assert _call(choice) == ("get_weather", {"city": "Oslo", "unit": "c"})
    plain = _chat(client, tools=[WEATHER], extra_body={"guided_choice": ["no call"]}).choices[0]
    assert plain.message.content == "no call" and plain.finish_reason == "stop" and not plain.message.tool_calls


def test_constrained_requests_survive_a_decode_worker_dying(model_dir):
    """A decode worker is killed while constrained requests stream: the gateway moves each (prompt + tokens so
    far) to the other decode worker, whose matcher replays those tokens; every request completes, matches its
    regex and equals the one-engine output (ignore_eos: past the grammar's end only EOS is allowed)."""
    pattern, max_tokens = "[a-z]{60}", 72
    prompts = ["The quick brown fox", "héllo wörld", "a b c", "Tell me a story"]
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured=specs.regex(pattern))
    outputs = engine.generate([tok.encode(p) for p in prompts], params)
    reference = {p: tok.decode(o) for p, o in zip(prompts, outputs, strict=True)}
    spec = StackSpec(model=str(model_dir), port=free_port(), decode=2, threads_per_worker=1, env=FAST)
    stack = start_stack(spec)
    try:
        before = gateway_metric(stack, "pdserve:request_migrations_total")
        watch = EventWatch(stack.nats_url)
        try:
            load = Load(stack.url, prompts, max_tokens, extra={"structured_outputs": {"regex": pattern}})
            load.progress.wait(lambda p: min(p.counts) >= 3)
            victim = busiest(stack, watch, "decode")
            stack.procs[victim].send_signal(signal.SIGKILL)
            outcomes = load.results()
        finally:
            watch.close()
        assert gateway_metric(stack, "pdserve:request_migrations_total") > before, "a request moved"
    finally:
        stack.stop()
    for o in outcomes:
        assert o.verdict == "completed", (o.prompt, o.error, o.exception)
        assert re.fullmatch(pattern, o.text) and o.text == reference[o.prompt]
