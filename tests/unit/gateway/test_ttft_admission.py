"""Admission's TTFT bound (services/gateway/admission.py) on recorded signals: heartbeats as workers send them, read
with the documented defaults (path_signals.py), the path chosen by the rule (prefill_path.py), then refused or not."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY

from services.gateway.admission import RETRY_AFTER_MAX_S, Admission, ttft_overload
from services.gateway.backend import GenerationJob, Overloaded
from services.gateway.path_signals import DEFAULT_PREFILL_STEP_MS, DEFAULT_PREFILL_TOKENS_PER_S, PathSignals
from services.gateway.prefill_path import PathChoice, Slos, choose_path
from shared.messages import Heartbeat, Role, Sampling
from shared.settings import GatewaySettings, PrefillPath

SLOS = Slos(ttft_s=2.5, tpot_s=0.1)  # the settings' defaults
RATE = DEFAULT_PREFILL_TOKENS_PER_S  # tokens/s of every worker here: nothing measured, the defaults apply
PROMPT = 16


def _beat(role: Role, waiting_tokens: int = 0) -> Heartbeat:
    rpc = "p:1" if role is Role.PREFILL else None
    return Heartbeat(f"{role}-1", role, "demo", rpc, block_size=16, total_blocks=64, free_blocks=64,
                     waiting_tokens=waiting_tokens)  # fmt: skip


def _choice(prefill_queue: int, decode_queue: int, prompt: int = PROMPT) -> PathChoice:
    signals = PathSignals([_beat(Role.PREFILL, prefill_queue), _beat(Role.DECODE, decode_queue)], live=False)
    return choose_path(prompt, signals.prefill(), signals.decode(), signals.transfer(), SLOS)


def _backlog(seconds: float) -> int:
    """Queued prompt tokens that take `seconds` at the default rate."""
    return int(seconds * RATE)


def test_an_idle_stack_is_admitted():
    assert ttft_overload(_choice(0, 0), SLOS.ttft_s) is None


def test_a_backlog_on_both_paths_is_refused_with_the_time_it_takes_to_clear():
    choice = _choice(_backlog(10), _backlog(10))
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "ttft")  # local no better: neither meets it
    assert choice.chosen is not None and choice.chosen.queue_s == pytest.approx(_backlog(10) / RATE)
    refusal = ttft_overload(choice, SLOS.ttft_s)
    assert refusal is not None and refusal.reason == "ttft_slo"
    predicted = (_backlog(10) + PROMPT) / RATE + DEFAULT_PREFILL_STEP_MS / 1e3
    assert choice.chosen.ttft_s == pytest.approx(predicted)
    assert refusal.retry_after_s == math.ceil(predicted - SLOS.ttft_s) == 8  # the queue drains a second a second
    assert "predicted in 10.0 s on the remote prefill path, 10.0 s of it behind queued prompts" in refusal.message


def test_switching_path_is_tried_first():
    """A queued prefill worker beside an idle decode worker: the rule takes the local path, which meets the target."""
    choice = _choice(_backlog(10), 0)
    assert (choice.path, choice.reason) == (PrefillPath.LOCAL, "relief")
    assert ttft_overload(choice, SLOS.ttft_s) is None


def test_a_prompt_that_misses_without_any_backlog_is_admitted():
    """Waiting cannot help it: refusing it would refuse it forever."""
    long_prompt = _backlog(4)  # 4 s of prefill alone, over the 2.5 s target
    choice = _choice(_backlog(10), _backlog(10), prompt=long_prompt)
    assert choice.chosen is not None and choice.chosen.ttft_s - choice.chosen.queue_s > SLOS.ttft_s
    assert ttft_overload(choice, SLOS.ttft_s) is None


def test_the_factor_moves_the_limit_and_retry_after_is_bounded():
    choice = _choice(_backlog(4), _backlog(4))  # about 4 s predicted
    assert ttft_overload(choice, 1.0 * SLOS.ttft_s) is not None
    assert ttft_overload(choice, 2.0 * SLOS.ttft_s) is None  # a 5 s limit
    refusal = ttft_overload(_choice(_backlog(600), _backlog(600)), SLOS.ttft_s)
    assert refusal is not None and refusal.retry_after_s == RETRY_AFTER_MAX_S


def _refused() -> float:
    labels = {"model_name": "demo", "role": "gateway", "reason": "ttft_slo"}
    return REGISTRY.get_sample_value("pdserve:requests_rejected_total", labels) or 0.0


def test_admit_path_counts_refusals_and_is_off_without_a_limit():
    busy = _choice(_backlog(10), _backlog(10))
    job = GenerationJob("r1", "demo", [1] * PROMPT, Sampling(max_tokens=4))
    Admission(8, 1.0).admit_path(busy, job)  # the bound is off
    on = Admission(8, 1.0, ttft_limit_s=SLOS.ttft_s)
    on.check("r1", PROMPT, {}, None, now=0.0)  # the queue and KV bounds admit it first
    before = _refused()
    with pytest.raises(Overloaded) as exc:
        on.admit_path(busy, job)
    assert exc.value.reason == "ttft_slo" and _refused() == before + 1
    on._note_departures([], now=1.0)
    assert on.departure_rate(now=2.0) is None  # the refused request never left: nothing departed
    on.admit_path(_choice(0, 0), job)


def test_settings():
    settings = GatewaySettings()
    assert settings.admission_ttft_refuse is False and settings.admission_ttft_factor == 1.0
    with pytest.raises(ValueError, match="admission_ttft_factor"):
        GatewaySettings(admission_ttft_factor=0.0)
    with pytest.raises(ValueError):
        Admission(8, 1.0, ttft_limit_s=0.0)
