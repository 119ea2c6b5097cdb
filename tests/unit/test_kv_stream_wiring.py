"""The worker wiring of layer-streamed KV (docs/kv_transfer.md, "Layer-by-layer streaming"), piece by piece: the
setting and `pdserve up --kv-stream-layers`, the positions of the events around a streamed job (the gateway
keeps one taker per stage and orders tokens by position), and the decode worker's decision whether the first
token from the pull's trailer ends the request. The whole path runs in tests/e2e/test_streamed_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.cli import main as cli_main
from services.decode.worker import first_token_end
from shared.engine.request import FinishReason
from shared.messages import DecodeJob, FinishedEvent, PrefillJob, Sampling, TokensEvent
from shared.settings import WorkerSettings, from_env
from shared.worker.events import announce_event, queued_event, streamed_first_token_event

SECRET = "s" * 16
PROMPT = [5, 6, 7]


def _jobs(streamed: bool, **sampling) -> tuple[PrefillJob, DecodeJob]:
    s = Sampling(max_tokens=sampling.pop("max_tokens", 8), **sampling)
    prefill = PrefillJob("r", "demo", PROMPT, s, "reply.r")
    decode = DecodeJob("r", "demo", PROMPT, [] if streamed else [9], s, "reply.r", kv_streamed=streamed)
    return prefill, decode


def test_the_setting_is_off_by_default_and_read_from_the_environment():
    assert not from_env(WorkerSettings, {"PDSERVE_CLUSTER_SECRET": SECRET}).kv.stream_layers
    env = {"PDSERVE_CLUSTER_SECRET": SECRET, "PDSERVE_KV_STREAM_LAYERS": "1"}
    assert from_env(WorkerSettings, env, role="prefill").kv.stream_layers


@pytest.mark.parametrize("flag", [False, True])
def test_up_passes_the_flag_to_every_worker(monkeypatch, tmp_path, flag):
    seen = {}

    class Stack:
        def __init__(self, spec, **_kw) -> None:
            seen["env"] = spec.env

    class Supervisor:
        def __init__(self, *_a, **_kw) -> None: ...

        def run(self) -> int:
            return 0

    monkeypatch.setattr("services.local.stack.Stack", Stack)
    monkeypatch.setattr("services.local.supervisor.Supervisor", Supervisor)
    monkeypatch.setattr("services.local.preflight.preflight", lambda *_a, **_kw: None)  # no checkpoint here
    argv = ["up", "--model", str(tmp_path), *(["--kv-stream-layers"] if flag else [])]
    assert cli_main(argv) == 0
    assert ("PDSERVE_KV_STREAM_LAYERS" in seen["env"]) is flag
    if flag:
        env = {"PDSERVE_CLUSTER_SECRET": SECRET, **seen["env"]}
        assert from_env(WorkerSettings, env, role="prefill").kv.stream_layers


def test_a_streamed_job_keeps_the_stage_positions_of_an_unstreamed_one():
    """Unstreamed: prefill takes stage 0 and queues at 1, decode takes stage 1. Streamed: the same stages (so
    the gateway does not drop decode's events as a second taker of stage 0), the queue at 0 (no token out)."""
    prefill, plain = _jobs(streamed=False)
    _, streamed = _jobs(streamed=True)
    assert announce_event(prefill, "p").seq == 0
    assert queued_event(prefill, "p").seq == 1 and queued_event(prefill, "p", streamed=True).seq == 0
    assert announce_event(plain, "d").seq == 1 and announce_event(streamed, "d").seq == 1


def test_the_streamed_first_token_event_is_at_position_0_and_may_end_the_request():
    _, job = _jobs(streamed=True)
    going_on = streamed_first_token_event(job, 42, None, "d")
    assert (type(going_on), going_on.seq, going_on.token_ids, going_on.prompt_tokens) == (TokensEvent, 0, [42], 3)
    ended = streamed_first_token_event(job, 42, FinishReason.STOP, "d")
    assert isinstance(ended, FinishedEvent) and ended.finish_reason is not None and ended.finish_reason.value == "stop"


def test_first_token_end_decides_as_the_scheduler():
    engine = SimpleNamespace(scheduler=SimpleNamespace(eos_token_ids=frozenset({2})), max_model_len=64)
    end = lambda outputs, **s: first_token_end(engine, _jobs(True, **s)[1], outputs)  # type: ignore[arg-type]  # noqa: E731
    assert end([9]) is None
    assert end([2]) is FinishReason.STOP  # EOS
    assert end([2], ignore_eos=True) is None
    assert end([9], stop_token_ids=[9]) is FinishReason.STOP
    assert end([9], max_tokens=1) is FinishReason.LENGTH
    engine.max_model_len = len(PROMPT) + 1  # the prompt and this token fill the model
    assert end([9]) is FinishReason.LENGTH
