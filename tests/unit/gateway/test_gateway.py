"""The gateway's HTTP API against an in-process fake backend: OpenAI shapes, SSE framing, stop strings,
the error shape for bad input, auth, readiness, and cancellation when the client goes away (the last two
against a real uvicorn server, with httpx and with the official openai client)."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest
from litestar.testing import TestClient

from services.gateway import create_app
from services.gateway.backend import Update
from tests.unit.gateway.harness import (
    CHAT,
    COMPLETIONS,
    CONTEXT,
    MODEL,
    REPLY,
    USER,
    FakeBackend,
    assert_error,
    serve,
    settings_for,
    sse_events,
    stream_chunks,
)

# ---- non-streaming ----------------------------------------------------------------------------------


def test_chat_completion(client, fake, tokenizer):
    r = client.post(CHAT, json={"model": MODEL, "messages": USER, "temperature": 0.5, "top_k": -1, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "refusal": None}
    assert choice["finish_reason"] == "stop"
    prompt = tokenizer.encode_chat(USER)
    completion = len(fake.reply_ids()) + 1  # the EOS counts, and prints nothing
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (job,) = fake.jobs
    assert job.request_id == body["id"] and job.model == MODEL and job.prompt_token_ids == prompt
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (0.5, 1.0, None, 7, False)
    assert s.max_tokens == CONTEXT - len(prompt)  # chat's default: the rest of the context
    assert fake.cancelled == [] and fake.closed == 1  # finished by the worker: nothing to cancel


def test_text_completion_defaults_to_16_tokens(client, fake):
    r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert fake.jobs[0].sampling.max_tokens == 16
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16
    # 16 bytes end inside 🙂: the cut-off character prints as U+FFFD, never as mojibake
    assert body["choices"][0]["text"] == "héllo 世界 \ufffd"


@pytest.mark.parametrize("form", ["ids", "batch of ids", "batch of text"])
def test_completion_prompt_forms(client, fake, tokenizer, form):
    ids = tokenizer.encode("hi")
    prompt = {"ids": ids, "batch of ids": [ids], "batch of text": ["hi"]}[form]
    r = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "top_k": 5})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == REPLY
    assert fake.jobs[0].prompt_token_ids == ids and len(ids) == 2  # byte-level: one token per byte
    assert fake.jobs[0].sampling.ignore_eos and fake.jobs[0].sampling.top_k == 5


def test_max_completion_tokens_wins_and_context_edges(client, fake):
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 50, "max_completion_tokens": 3})
    assert r.json()["choices"][0]["finish_reason"] == "length" and fake.jobs[-1].sampling.max_tokens == 3
    r = client.post(COMPLETIONS, json={"prompt": [65] * (CONTEXT - 1), "max_tokens": 1})
    assert r.status_code == 200 and fake.jobs[-1].sampling.max_tokens == 1
    r = client.post(COMPLETIONS, json={"prompt": [65] * (CONTEXT - 5)})  # default 16, capped by the room left
    assert r.status_code == 200 and fake.jobs[-1].sampling.max_tokens == 5
    err = assert_error(client.post(COMPLETIONS, json={"prompt": [65] * 2000, "max_tokens": 100}), 400, "max_tokens")
    assert "maximum context length is 2048 tokens" in err["message"] and "2100" in err["message"]


# ---- streaming --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens_per_update", [1, 4])
def test_chat_stream_format(checkpoint, tokenizer, tokens_per_update):
    fake = FakeBackend(tokenizer, tokens_per_update=tokens_per_update)
    with TestClient(create_app(settings_for(checkpoint), fake)) as client:
        r = client.post(CHAT, json={"model": MODEL, "messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = stream_chunks(r.text)
    assert len(chunks) == len(fake.reply_ids()) + 1  # one chunk per token (the EOS too), no usage chunk
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "chat.completion.chunk", MODEL)
    }
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and "content" in deltas[0]
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == REPLY
    assert all("\ufffd" not in d["content"] for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


def test_stream_usage_chunk_only_when_asked(client, fake):
    body = {"prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(client.post(COMPLETIONS, json=body).text)
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(content) == 5 and all(c["object"] == "text_completion" and "usage" not in c for c in content)
    assert "".join(c["choices"][0]["text"] for c in content) == "héll"  # 5 tokens: h, é (2), l, l
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    body["stream_options"] = {"include_usage": False}
    assert all(c["choices"] for c in stream_chunks(client.post(COMPLETIONS, json=body).text))


# ---- stop strings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("世界", "héllo "),  # two multi-byte characters, six tokens
        (["xyz", "🙂"], "héllo 世界 "),  # one character split over four tokens
        (["lo 世"], "hél"),  # spans tokens and a character boundary
        ("o 世X", REPLY),  # a prefix matches, then diverges: the held text comes out
        ("", REPLY),  # an empty stop string is ignored
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, fake, stop, expected, stream):
    r = client.post(CHAT, json={"messages": USER, "stop": stop, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = stream_chunks(r.text)
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
    assert text == expected and finish == "stop"
    stopped_by_gateway = expected != REPLY
    assert fake.cancelled == ([fake.jobs[0].request_id] if stopped_by_gateway else [])
    assert fake.closed == 1


# ---- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_no_worker_is_503(client, fake, stream):
    fake.unavailable = "no live decode worker for model 'demo'"
    err = assert_error(client.post(CHAT, json={"messages": USER, "stream": stream}), 503, None)
    assert "no live decode worker" in err["message"] and err["type"] == "service_unavailable"


@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_first_token_is_plain_json(client, fake, stream):
    fake.fail = Update([], "error", "no first token within 300 s; the request was cancelled", status=504)
    err = assert_error(client.post(CHAT, json={"messages": USER, "stream": stream}), 504, None)
    assert "no first token" in err["message"]
    assert fake.cancelled == [fake.jobs[0].request_id] and fake.closed == 1


def test_failure_mid_stream_is_an_error_event(client, fake):
    fake.fail, fake.fail_after = Update([], "error", "decode worker lost"), 3
    r = client.post(COMPLETIONS, json={"prompt": "hi", "stream": True})
    assert r.status_code == 200
    payloads = sse_events(r.text)
    assert [json.loads(p)["choices"][0]["text"] for p in payloads[:3]] == ["h", "", "é"]
    assert json.loads(payloads[3]) == {
        "error": {"message": "decode worker lost", "type": "internal_server_error", "param": None, "code": 500}
    }
    assert payloads[4:] == ["[DONE]"]
    assert fake.cancelled == [fake.jobs[0].request_id]  # frees whatever KV the failed request still holds


def test_failure_without_stream_is_5xx_json(client, fake):
    fake.fail, fake.fail_after = Update([], "error", "worker crashed"), 2
    assert assert_error(client.post(CHAT, json={"messages": USER}), 500, None)["message"] == "worker crashed"


# ---- bad input --------------------------------------------------------------------------------------

BAD_INPUTS = [
    # (path, body: bytes | JSON value, content type, status, param)
    (CHAT, b'{"model": "demo",', "application/json", 400, None),
    (CHAT, b"not json at all", "application/json", 400, None),
    (CHAT, [USER], "application/json", 400, None),
    (CHAT, b"", "application/json", 400, None),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', "application/json", 400, None),
    (COMPLETIONS, {"prompt": "hi"}, "text/plain", 415, None),
    (COMPLETIONS, {"prompt": "x" * (70 << 10)}, "application/json", 413, None),
    (CHAT, {"model": MODEL}, "application/json", 400, "messages"),
    (CHAT, {"messages": []}, "application/json", 400, "messages"),
    (CHAT, {"messages": "hello"}, "application/json", 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, "application/json", 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "application/json", 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, "application/json", 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, "messages[0].content"),
    (COMPLETIONS, {"prompt": ""}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"model": MODEL}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"prompt": [99999]}, "application/json", 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "application/json", 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, "application/json", 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, "application/json", 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 5000}, "application/json", 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "application/json", 400, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": [65] * (CONTEXT + 10)}, "application/json", 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * CONTEXT}]}, "application/json", 400, "messages"),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, "application/json", 404, "model"),
    (CHAT, {"messages": USER, "n": 17}, "application/json", 400, "n"),  # over max_n
    (CHAT, {"messages": USER, "n": 0}, "application/json", 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 3}, "application/json", 400, "best_of"),
    (CHAT, {"messages": USER, "temperature": 2.5}, "application/json", 400, "temperature"),
    (CHAT, {"messages": USER, "temperature": -0.1}, "application/json", 400, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, "application/json", 400, "top_p"),
    (CHAT, {"messages": USER, "top_p": 1.5}, "application/json", 400, "top_p"),
    (CHAT, {"messages": USER, "top_k": -2}, "application/json", 400, "top_k"),
    (CHAT, {"messages": USER, "stop": 5}, "application/json", 400, "stop"),
    (CHAT, {"messages": USER, "stop": ["a", 1]}, "application/json", 400, "stop[1]"),
    (CHAT, {"messages": USER, "logprobs": "yes"}, "application/json", 400, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "application/json", 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1}, "application/json", 400, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "application/json", 400, "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 6}, "application/json", 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "application/json", 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "echo": 1}, "application/json", 400, "echo"),
    (CHAT, {"messages": USER, "presence_penalty": 2.5}, "application/json", 400, "presence_penalty"),
    (CHAT, {"messages": USER, "frequency_penalty": -2.01}, "application/json", 400, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, "application/json", 400, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 1.5}, "application/json", 400, "min_p"),
    (CHAT, {"messages": USER, "logit_bias": {"99999": 1}}, "application/json", 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "application/json", 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, "application/json", 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": "x"}}, "application/json", 400, "logit_bias[...]"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 2}, "application/json", 400, "best_of"),
    (CHAT, {"messages": USER, "stream": "yes"}, "application/json", 400, "stream"),
    (CHAT, {"messages": USER, "stream": True, "stream_options": 1}, "application/json", 400, "stream_options"),
    (CHAT, {"messages": USER, "seed": "abc"}, "application/json", 400, "seed"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, None, 400, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, None, 400, "response_format"),
    (CHAT, {"messages": USER, "stop_token_ids": [-1]}, "application/json", 400, "stop_token_ids"),
]


@pytest.mark.parametrize(("path", "body", "content_type", "status", "param"), BAD_INPUTS)
def test_bad_input_is_4xx_in_openai_shape(client, fake, path, body, content_type, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": content_type} if content_type else {}
    assert_error(client.post(path, content=content, headers=headers), status, param)
    assert fake.jobs == []  # nothing was dispatched
    good = client.post(CHAT, json={"messages": USER})
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == REPLY


def test_unknown_route_and_method(client):
    assert "no route" in assert_error(client.get("/v1/nothing"), 404, None)["message"]
    assert_error(client.get(CHAT), 405, None)


def test_extra_fields_are_ignored(client):
    body = {"messages": USER, "frequency_penalty": 0, "user": "u1", "vendor_extension": {"a": [1]}, "stream": None}
    assert client.post(CHAT, json=body).status_code == 200


# ---- headers, auth, models, probes ------------------------------------------------------------------


def test_request_id_is_echoed(client):
    assert (
        client.post(CHAT, json={"messages": USER}, headers={"X-Request-Id": "bench-42"}).headers["x-request-id"]
        == "bench-42"
    )
    assert client.post(CHAT, content=b"{", headers={"X-Request-Id": "bad-1"}).headers["x-request-id"] == "bad-1"
    assert client.get("/nowhere", headers={"X-Request-Id": "r-404"}).headers["x-request-id"] == "r-404"
    assert len(client.get("/health").headers["x-request-id"]) == 32  # none sent: a fresh one


def test_api_keys(checkpoint, fake):
    with TestClient(create_app(settings_for(checkpoint, api_keys=("k1", "k2")), fake)) as client:
        err = assert_error(client.get("/v1/models"), 401, None)
        assert err["type"] == "authentication_error"
        assert_error(client.post(CHAT, json={"messages": USER}, headers={"Authorization": "Bearer nope"}), 401, None)
        assert_error(client.get("/v1/models", headers={"Authorization": "Basic k1"}), 401, None)
        assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        r = client.post(CHAT, json={"messages": USER}, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    assert len(fake.jobs) == 1


def test_models(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["object"] == "list"
    (card,) = r.json()["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", CONTEXT)
    assert client.get(f"/v1/models/{MODEL}").json() == card
    assert_error(client.get("/v1/models/other"), 404, "model")


def test_health_and_ready(client, fake):
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    fake.ready = (False, "no live decode worker for model 'demo' (live: 1 prefill)")
    assert "no live decode worker" in assert_error(client.get("/ready"), 503, None)["message"]


def test_openapi_schema(client):
    r = client.get("/schema/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert {CHAT, COMPLETIONS, "/v1/models", "/health", "/ready"} <= set(paths)
    assert "requestBody" in paths[CHAT]["post"]


# ---- over a real socket: disconnects and the official client ---------------------------------------


def test_client_disconnect_mid_stream_cancels_upstream(checkpoint, tokenizer):
    fake = FakeBackend(tokenizer, delay_s=0.005)
    fake.endless = True
    with serve(create_app(settings_for(checkpoint), fake)) as url, httpx.Client(timeout=10) as http:
        with http.stream("POST", url + CHAT, json={"messages": USER, "stream": True}) as r:
            assert r.status_code == 200
            lines = itertools.islice((line for line in r.iter_lines() if line.startswith("data: ")), 5)
            assert len(list(lines)) == 5
        # leaving the block closed the connection mid-stream
        assert fake.cancel_seen.wait(5), "the backend never saw a cancel"
        assert fake.cancelled == [fake.jobs[0].request_id]
        deadline = time.monotonic() + 5
        while fake.closed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.closed == 1


def test_client_timeout_without_stream_cancels_upstream(checkpoint, tokenizer):
    fake = FakeBackend(tokenizer, delay_s=0.005)
    fake.endless = True
    with serve(create_app(settings_for(checkpoint), fake)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2000}, timeout=0.5)
        assert fake.cancel_seen.wait(5), "the backend never saw a cancel"
        assert fake.cancelled == [fake.jobs[0].request_id]


def test_openai_client(checkpoint, tokenizer):
    fake = FakeBackend(tokenizer)
    with serve(create_app(settings_for(checkpoint, api_keys=("secret",)), fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
        assert chat.choices[0].message.content == REPLY and chat.choices[0].finish_reason == "stop"
        assert chat.usage.completion_tokens == len(fake.reply_ids()) + 1

        stream = client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == REPLY
        assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

        text = client.completions.create(model=MODEL, prompt="hi", max_tokens=6, stop=["llo"])
        assert (text.choices[0].text, text.choices[0].finish_reason) == ("hé", "stop")
        pieces = [
            c.choices[0].text for c in client.completions.create(model=MODEL, prompt="hi", stream=True, max_tokens=64)
        ]
        assert "".join(pieces) == REPLY

        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=USER)
        with pytest.raises(openai.BadRequestError) as excinfo:
            client.chat.completions.create(model=MODEL, messages=USER, n=17)
        assert excinfo.value.status_code == 400 and excinfo.value.body["param"] == "n"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in client.models.list()] == [MODEL]
