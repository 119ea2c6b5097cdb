"""The prefill path through a whole stack (1 prefill + 1 decode worker): under the documented default calibration
(live calibration off, so the choice is reproducible) a short prompt is computed on the decode worker and a long one
on the prefill worker with its KV handed off; both answer with the single-process engine's greedy tokens. The path
shows in the gateway's request metrics (`path` label), on the request's span (with its predicted TTFT), and the
workers report what they measured in their heartbeats."""

from __future__ import annotations

import time

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from services.trace.timeline import load_trace, missing_operations, render_text, summarize
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from shared.telemetry.spanfile import read_spans
from tests.e2e_support import heartbeats, scraped_total, start_stack

MAX_TOKENS = 8
SHORT = [(7 * i) % 97 + 10 for i in range(16)]  # under the default threshold of 299 tokens (docs/architecture.md)
LONG = [(13 * i) % 211 + 10 for i in range(400)]


@pytest.fixture(scope="module")
def span_file(tmp_path_factory):
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def stack(model_dir, span_file):
    env = {"PDSERVE_PREFILL_PATH": "auto", "PDSERVE_PREFILL_PATH_LIVE_CALIBRATION": "false"}
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, env=env, trace_file=str(span_file))
    stack = start_stack(spec)
    yield stack
    stack.stop()


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _decode_pulled_bytes(stack) -> float:
    return sum(scraped_total(u, "pdserve:kv_transfer_bytes_total", role="decode") for u in stack.metrics_urls())


@pytest.mark.slow  # a whole stack, > ~30 s on 2 cores: the slow tier
def test_a_short_prompt_is_prefilled_locally_and_a_long_one_remotely_with_the_engines_tokens(
    stack, model_dir, span_file
):
    tok = Tokenizer(model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = Engine.from_dir(model_dir, max_model_len=1024).generate([SHORT, LONG], params)
    gateway = f"{stack.url}/metrics"

    def ttfts(path: str) -> float:
        return scraped_total(gateway, "pdserve:time_to_first_token_seconds_count", path=path)

    short = _complete(stack.url, SHORT)
    assert short["choices"][0]["text"] == tok.decode(reference[0])
    assert (ttfts("local"), ttfts("remote")) == (1, 0)
    assert _decode_pulled_bytes(stack) == 0  # computed where it was decoded: nothing handed off

    long = _complete(stack.url, LONG)
    assert long["choices"][0]["text"] == tok.decode(reference[1])
    assert (ttfts("local"), ttfts("remote")) == (1, 1)
    assert _decode_pulled_bytes(stack) > 0  # the long prompt's KV was pulled

    roots = {s["attributes"]["gen_ai.response.id"]: s["attributes"] for s in _gateway_roots(span_file, 2)}
    for answer, path, reason in ((short, "local", "sooner"), (long, "remote", "stall")):
        attributes = roots[answer["id"]]
        assert attributes["pdserve.prefill_path"] == path and attributes["pdserve.prefill_path.reason"] == reason
        assert attributes["pdserve.prefill_path.predicted_ttft_s"] > 0  # beside the actual one
        assert attributes["gen_ai.server.time_to_first_token"] > 0

    # `pdserve trace`: the local request's timeline is whole (its prefill recorded by the decode worker)
    local_trace = _whole_trace(span_file, short["id"])
    assert summarize(local_trace).prefill_path == "local"
    prefill_spans = [s for s in local_trace if s["name"] == "prefill demo"]
    assert [s["service"] for s in prefill_spans] == ["pdserve-decode"]
    assert "prefill path local (sooner): TTFT predicted" in render_text(local_trace)

    # the workers measured their coefficients (the gateway ignores them here: live calibration is off)
    beats = {b.role: b.path_calibration for b in heartbeats(stack.nats_url).values()}
    assert beats["prefill"] is not None and beats["prefill"].prefill_tokens_per_s is not None
    assert beats["decode"] is not None and beats["decode"].prefill_tokens_per_s is not None  # the local prefill
    assert beats["decode"].kv_transfer_ms_per_mb is not None  # the long prompt's pull


def _gateway_roots(span_file, n: int) -> list[dict]:
    """The gateway's request spans, once `n` are in the file (the exporter flushes on its own schedule)."""
    for _ in range(200):
        roots = [s for s in read_spans(span_file) if "gen_ai.response.id" in s["attributes"]]
        if len(roots) >= n:
            return roots
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} request spans reached {span_file}")


def _whole_trace(span_file, request_id: str) -> list[dict]:
    """The request's trace once nothing is missing from it (each service flushes on its own schedule)."""
    spans: list[dict] = []
    for _ in range(200):
        spans = load_trace(span_file, request_id=request_id)
        if spans and not missing_operations(spans):
            return spans
        time.sleep(0.1)
    raise AssertionError(f"the trace of {request_id} stayed incomplete: {missing_operations(spans)}")
