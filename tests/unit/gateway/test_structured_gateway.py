"""Structured output and tool calls at the gateway (in-process fake backend): every spelling becomes the job's
spec, a bad schema / regex / grammar / tool_choice is a 400 naming the field before dispatch, and a reply that
is a tool call comes back as `tool_calls` (whole and streamed, through the official openai client)."""

from __future__ import annotations

import json

import openai
import pytest
from litestar.testing import TestClient

from services.gateway import create_app
from shared.structured import spec as specs
from shared.structured.spec import StructuredKind
from tests.openai_schema import validate, validate_stream_chunk
from tests.unit.gateway.harness import CHAT, COMPLETIONS, MODEL, USER, FakeBackend, assert_error, serve, settings_for

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("path", "extra", "expected"),
    [
        (CHAT, {"response_format": {"type": "json_object"}}, specs.JSON_OBJECT),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": True},
                }
            },
            specs.json_schema(SCHEMA),
        ),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}, specs.JSON_OBJECT),
        (CHAT, {"structured_outputs": {"regex": "[0-9]+"}}, specs.regex("[0-9]+")),
        (COMPLETIONS, {"structured_outputs": {"choice": ["a", "b"]}}, specs.choice(["a", "b"])),
        (CHAT, {"structured_outputs": {"json": SCHEMA}}, specs.json_schema(SCHEMA)),
        (CHAT, {"structured_outputs": {"grammar": 'start: "x"+'}}, specs.lark('start: "x"+')),
        (COMPLETIONS, {"guided_json": SCHEMA}, specs.json_schema(SCHEMA)),
        (COMPLETIONS, {"guided_regex": "a|b"}, specs.regex("a|b")),
        (CHAT, {"guided_choice": ["yes", "no"]}, specs.choice(["yes", "no"])),
        (CHAT, {"response_format": {"type": "text"}}, None),
    ],
)
def test_every_spelling_reaches_the_job(client, fake, path, extra, expected):
    body = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    r = client.post(path, json=body | extra)
    assert r.status_code == 200, r.text
    assert fake.jobs[-1].sampling.structured == expected


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
         "response_format", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "invalid"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "combined"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools", "nope"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(client, fake, extra, param, words):
    error = assert_error(client.post(CHAT, json={"messages": USER} | extra), 400, param)
    assert words in error["message"]
    assert fake.jobs == [], "refused before dispatch"


def test_history_arguments_that_are_not_json_render_as_text(client, fake):
    for arguments in ("not json", '{"a": '):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
        r = client.post(CHAT, json={"messages": history, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        prompt = fake.tokenizer.decode(fake.jobs[-1].prompt_token_ids, skip_special_tokens=False)
        assert json.dumps(arguments) in prompt


def test_required_and_named_tool_choice_constrain_the_output(client, fake):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": choice})
        assert r.status_code == 200, r.text
        spec = fake.jobs[-1].sampling.structured
        assert spec is not None and spec.kind is StructuredKind.LARK and "get_weather" in spec.spec
    client.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": "auto"})
    assert fake.jobs[-1].sampling.structured is None
    prompt = fake.tokenizer.decode(fake.jobs[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt
    client.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert "<tools>" not in fake.tokenizer.decode(fake.jobs[-1].prompt_token_ids, skip_special_tokens=False)


def test_tool_call_responses_have_openais_published_shape(checkpoint, tokenizer):
    """tool_calls whole and streamed validate against OpenAI's schemas (the message keeps refusal: null)."""
    fake = FakeBackend(tokenizer)
    fake.reply = CALL_TEXT
    with TestClient(create_app(settings_for(checkpoint), fake)) as client:
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 200}
        whole = client.post(CHAT, json=body).json()
        validate(whole, "CreateChatCompletionResponse")
        assert whole["choices"][0]["message"]["tool_calls"] and whole["choices"][0]["message"]["refusal"] is None
        streamed = client.post(CHAT, json=body | {"stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.split("\n\n") if line.startswith("data: {")]
        assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
        for chunk in chunks:
            validate_stream_chunk(chunk, chat=True)


def test_tool_calls_through_the_openai_client(checkpoint, tokenizer):
    """A reply that is a Hermes call (the fake backend's crafted output) comes back as tool_calls, whole and
    streamed; the call and its result round-trip into the next prompt through the template."""
    fake = FakeBackend(tokenizer)
    fake.reply = CALL_TEXT
    with serve(create_app(settings_for(checkpoint), fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        tools = [WEATHER]
        chat = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=200)  # type: ignore[arg-type]
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}

        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=tools, stream=True))  # type: ignore[arg-type]
        deltas = [c.choices[0].delta for c in chunks]
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
        assert {tc.index for tc in calls} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(d.content or "" for d in deltas)

        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        fake.reply = "It is sunny."
        after = client.chat.completions.create(model=MODEL, messages=history, tools=tools)  # type: ignore[arg-type]
        assert after.choices[0].message.content == "It is sunny." and after.choices[0].finish_reason == "stop"
        prompt = tokenizer.decode(fake.jobs[-1].prompt_token_ids, skip_special_tokens=False)
        assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
