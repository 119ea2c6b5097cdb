"""Tool calls: the parsers (Hermes and Llama-3.1 JSON) whole and streamed, the demo chat template with tools,
tool calls and tool results, and required / named tool_choice enforced by structured output so that even the
random demo model writes a valid call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.demo_model import CHAT_TEMPLATE, write_demo_checkpoint
from services.gateway.tools.hermes import HermesParser
from services.gateway.tools.llama3_json import Llama3JsonParser
from services.gateway.tools.output import ToolDeltas
from services.gateway.tools.registry import parser_for
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
)


def test_hermes_parse_whole():
    content, calls = HermesParser().parse(HERMES_TEXT)
    assert content is not None and content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": "cet"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HermesParser().parse("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert HermesParser().parse(broken) == (broken, [])  # not a call: stays content


REORDERED = '<tool_call>\n{"arguments": {"zone": "utc"}, "name": "get_time"}\n</tool_call>'
NESTED = '<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}, "d": "</tool"}}\n</tool_call> ok'


@pytest.mark.parametrize("text", [HERMES_TEXT, REORDERED, NESTED])
@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_hermes_stream_equals_whole(text, step):
    """Fed in pieces of any size, the stream gives the same content and calls as the whole text; arguments go
    out in fragments as they arrive (not only when the call closes)."""
    stream = HermesParser().stream()
    content, fragments, before_close = "", [], 0
    for i in range(0, len(text), step):
        d = stream.feed(text[i : i + step])
        content += d.content
        fragments += d.calls
        if _close_at(text) > i + step:
            before_close = len([f for f in fragments if f.arguments])
    d = stream.finish()
    content += d.content
    fragments += d.calls
    whole_content, whole_calls = HermesParser().parse(text)
    assert content.strip() == (whole_content or "").strip()
    heads = [f for f in fragments if f.id is not None]
    assert [(f.index, f.name) for f in heads] == [(i, c.name) for i, c in enumerate(whole_calls)]
    for i, c in enumerate(whole_calls):
        args = "".join(f.arguments for f in fragments if f.index == i)
        assert json.loads(args) == json.loads(c.arguments)
    if text != REORDERED and step < 5:
        assert before_close > 0, "argument fragments streamed before the first call closed"


def _close_at(text: str) -> int:
    return text.index("</tool_call>")


def test_tool_deltas_are_openai_shaped():
    """Name, id and type first (arguments ""), then the arguments; finish_reason tool_calls on the last chunk."""
    deltas = ToolDeltas(HermesParser())
    out = []
    for i in range(0, len(HERMES_TEXT), 7):
        out += deltas.feed(HERMES_TEXT[i : i + 7], None)
    out += deltas.feed("", "stop")
    calls = [d.delta.tool_calls[0] for d in out if d.delta.tool_calls]
    assert sorted({c.index for c in calls}) == [0, 1] and [c.index for c in calls] == sorted(c.index for c in calls)
    first = [c for c in calls if c.index == 0]
    assert first[0].id and first[0].type == "function" and first[0].function.name == "get_weather"
    assert first[0].function.arguments == "" and all(c.id is None and c.function.name is None for c in first[1:])
    assert len(first) > 2, "the arguments came in several fragments"
    assert json.loads("".join(c.function.arguments for c in first)) == {"city": "Paris", "unit": "c"}
    assert out[-1].finish_reason == "tool_calls" and all(d.finish_reason is None for d in out[:-1])
    plain = ToolDeltas(HermesParser()).feed("just text <tool", None) + ToolDeltas(HermesParser()).feed("", "stop")
    assert "".join(d.delta.content or "" for d in plain) == "just text "  # "<tool" held: it may open a call


def test_llama3_json_parse():
    p = Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "utc"})]
    _, two = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in two] == [("a", {}), ("b", {"x": 1})]
    assert p.parse("Hello {there}") == ("Hello {there}", [])
    stream = p.stream()
    d1, d2 = stream.feed('{"name": "get_time", '), stream.feed('"parameters": {"zone": "cet"}}')
    end = stream.finish()
    assert d1.content == d2.content == "" and [c.name for c in end.calls if c.id] == ["get_time"]
    text = p.stream()
    assert text.feed("Hi").content == "Hi"


def test_parser_choice():
    assert parser_for("auto", CHAT_TEMPLATE).name == "hermes"
    assert parser_for("auto", "{{ '<|python_tag|>' }} ipython").name == "llama3_json"
    assert parser_for("llama3_json", CHAT_TEMPLATE).name == "llama3_json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("tools"), arch="qwen3_moe", size="tiny")


def test_demo_template_renders_tools_calls_and_results(model_dir):
    tok = Tokenizer(model_dir)
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )  # without tools: the plain ChatML it always wrote
    tools = [{"type": "function", "function": WEATHER}]
    history = [
        *plain,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ]
    text = tok.apply_chat_template(history, tools=tools)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools") and json.dumps(tools[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert text.count("<|im_start|>system") == 1


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_are_valid_on_a_random_model(model_dir, parser, temperature):
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=1024)
    prompt = tok.encode_chat([{"role": "user", "content": "weather?"}])
    for tools in ([WEATHER, TIME], [TIME]):  # required (either tool), named (that one)
        params = SamplingParams(max_tokens=300, temperature=temperature, seed=5, structured=parser.constraint(tools))
        out = engine.generate([prompt], params)[0]
        assert out[-1] in tok.eos_token_ids
        content, calls = parser.parse(tok.decode(out))
        assert content is None and len(calls) == 1
        (tool,) = [t for t in tools if t["name"] == calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
