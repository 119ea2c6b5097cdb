"""Third-party clients nobody here wrote, against a real stack (nats, redis, gateway, a prefill and a decode
worker): litellm (`openai/` model with api_base for chat, `text-completion-openai/` for /v1/completions),
streaming and not, gets the same text the raw HTTP answer has; NVIDIA AIPerf runs a short bounded profile of
each endpoint with the checkpoint's own tokenizer, and every request succeeds.

`make test-clients` installs both (litellm: the `clients` extra; AIPerf: its own virtualenv, .venv-aiperf, as its
pins conflict with the project's) and sets PDSERVE_CLIENT_TESTS=required, so that a missing client fails the
tier instead of skipping it. Elsewhere (`make test`) these tests skip when the clients are not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.e2e_support import start_stack

REPO = Path(__file__).resolve().parents[2]
AIPERF = REPO / os.environ.get("PDSERVE_AIPERF", ".venv-aiperf/bin/aiperf")  # relative to the repository
REQUIRED = os.environ.get("PDSERVE_CLIENT_TESTS") == "required"
MODEL = "demo"
USER = [{"role": "user", "content": "Tell me about disaggregated serving"}]
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 12}
AIPERF_REQUESTS = 8


def _missing(what: str) -> None:
    if REQUIRED:
        pytest.fail(f"{what} is not installed (make test-clients installs it)")
    pytest.skip(f"{what} is not installed (make test-clients installs it)")


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its model price list
    try:
        import litellm
    except ImportError:
        _missing("litellm")
    return litellm


@pytest.fixture(scope="module")
def stack(model_dir):
    stack = start_stack(StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1))
    yield stack
    stack.stop()


def _raw(stack, path: str, body: dict) -> dict:
    r = httpx.post(f"{stack.url}{path}", json={"model": MODEL, **GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_litellm_chat(litellm, stack):
    expected = _raw(stack, "/v1/chat/completions", {"messages": USER})["message"]["content"]
    where = {"model": f"openai/{MODEL}", "api_base": f"{stack.url}/v1", "api_key": "unused", **GREEDY}
    whole = litellm.completion(messages=USER, **where)
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == GREEDY["max_tokens"]
    stream = litellm.completion(messages=USER, stream=True, stream_options={"include_usage": True}, **where)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert any(getattr(c, "usage", None) and c.usage.completion_tokens == GREEDY["max_tokens"] for c in chunks)


def test_litellm_text_completion(litellm, stack):
    expected = _raw(stack, "/v1/completions", {"prompt": PROMPT})["text"]
    where = {"model": f"text-completion-openai/{MODEL}", "api_base": f"{stack.url}/v1", "api_key": "unused"}
    whole = litellm.text_completion(prompt=PROMPT, **where, **GREEDY)
    assert whole.choices[0].text == expected
    chunks = list(litellm.text_completion(prompt=PROMPT, stream=True, **where, **GREEDY))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == expected


def test_litellm_sees_a_refused_field(litellm, stack):
    where = {"model": f"openai/{MODEL}", "api_base": f"{stack.url}/v1", "api_key": "unused", "num_retries": 0}
    with pytest.raises(litellm.BadRequestError, match="store"):
        litellm.completion(messages=USER, store=True, **where, **GREEDY)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_profile_completes_every_request(stack, model_dir, tmp_path, endpoint):
    if not AIPERF.exists():
        _missing(f"AIPerf ({AIPERF})")
    out = tmp_path / "aiperf"
    cmd = [
        str(AIPERF), "profile",
        "--model", MODEL,
        "--url", stack.url,
        "--endpoint-type", endpoint,
        "--streaming",
        "--tokenizer", str(model_dir),  # the checkpoint's tokenizer.json: nothing downloaded
        "--isl", "16", "--isl-stddev", "0",
        "--osl", "8", "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "temperature:0",
        "--concurrency", "2",
        "--request-count", str(AIPERF_REQUESTS),
        "--random-seed", "1",
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--artifact-dir", str(out),
    ]  # fmt: skip
    # AIPerf 0.13.0 cannot load a local tokenizer directory under HF_HUB_OFFLINE=1 (it sends the path through
    # huggingface_hub.snapshot_download: benchmarks/crosscheck_external.py); a local path never reaches the Hub
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert int(summary["request_count"]["avg"]) == AIPERF_REQUESTS, summary.get("request_count")
    assert int(summary.get("error_request_count", {}).get("avg", 0)) == 0, summary.get("error_summary")
    assert summary["output_sequence_length"]["avg"] > 0
