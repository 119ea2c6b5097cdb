"""A prefill worker SIGKILLed while it streams a long prompt's KV layer by layer (PDSERVE_KV_STREAM_LAYERS),
through the real stack (gateway, one prefill and one decode worker, NATS, Redis, the KV pull).

The window: PDSERVE_FAULT_KV_SEND_STALL_S (testing only) holds every send after its first piece — part of
layer 0, with 4 KiB pieces — so once the prefill worker has accepted the decode worker's pull (its
`kv_layer_streamed_pulls` count moves) the stream is certainly under way and cannot finish before the kill:
the decode worker has its receive posted for every layer and the first-token trailer, and has only a part
of layer 0. The transfer timeout is longer than the stall, so whatever ends the pull is the dead peer.

Proven, per kv_fallback: the decode worker sees the pull fail as `unavailable` (the peer gone; not a
timeout) and either recomputes the prompt and samples the first token itself — the client's stream equals
the single-process engine's, token for token — or answers a clear error (kv_fallback 'fail'); either way
the decode worker ends with every block free, no KV held, nothing running and sound block accounting, no
`pd:*` key is left once the dead worker's lease runs out, and the killed worker left nothing in /dev/shm."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from services.local.cluster_state import wait_settled
from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos import Load
from tests.e2e_support import scraped_total, start_stack

pytestmark = pytest.mark.slow  # a stack per policy: ~50 s each on the shared 2-core machine

PROMPT = "Prefill is compute-bound and decode is memory-bound; " * 24
MAX_TOKENS = 12
STALL_S = 120  # the window: far longer than the test needs, shorter than the transfer timeout
ENV = {
    "PDSERVE_KV_STREAM_LAYERS": "1",
    "PDSERVE_FAULT_KV_SEND_STALL_S": str(STALL_S),
    "PDSERVE_KV_CHUNK_BYTES": "4096",  # a layer is many pieces: the one sent before the stall is part of layer 0
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": str(STALL_S + 60),  # the decode side does not give up on its own first
    "PDSERVE_WORKER_TTL_S": "2",  # the gateway notices the dead worker within seconds
    "PDSERVE_KV_LEASE_S": "4",  # the dead worker's `pd:kv:` key expires soon
    "PDSERVE_FIRST_TOKEN_TIMEOUT_S": "90",
    "PDSERVE_DRAIN_TIMEOUT_S": "5",
}


@pytest.fixture(scope="module")
def reference(model_dir) -> str:
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=2048)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return tok.decode(engine.generate([tok.encode(PROMPT)], params)[0])


def _segments_of(pid: int) -> list[str]:
    """Shared KV segments a process of this pid created that are still in /dev/shm (shm.py names them)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"pdserve-kv-{pid}-*"))


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_mid_layer_stream(model_dir, reference, policy):
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, prefill=1, decode=1,
                     env=ENV | {"PDSERVE_KV_FALLBACK": policy})  # fmt: skip
    stack = start_stack(spec)
    prefill, decode = stack.procs["prefill-0"], stack.procs["decode-1"]
    prefill_metrics = f"http://127.0.0.1:{stack.metrics_ports['prefill-0']}/metrics"
    decode_metrics = f"http://127.0.0.1:{stack.metrics_ports['decode-1']}/metrics"
    try:
        load = Load(stack.url, [PROMPT], MAX_TOKENS)
        streamed = lambda: scraped_total(prefill_metrics, "pdserve:kv_layer_streamed_pulls_total")  # noqa: E731
        _wait(lambda: streamed() >= 1, 90, "the decode worker's streamed pull reaching the prefill worker")
        time.sleep(0.5)  # the send thread posts its first piece (layer 0 is done in milliseconds), then stalls
        assert scraped_total(decode_metrics, "pdserve:kv_transfer_failures_total") == 0  # the pull is in flight
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(10)

        (outcome,) = load.results()
        if policy == "recompute":
            assert outcome.verdict == "completed", (outcome.status, outcome.error, outcome.exception)
            assert outcome.text == reference  # recomputed by the decode worker, first token included
        else:
            assert outcome.verdict == "failed_cleanly", (outcome.status, outcome.error, outcome.exception)
            assert "kv_fallback" in (outcome.error or "") and outcome.pieces == []  # no first token came
        # the decode worker saw the peer go (not its own timeout), once
        assert scraped_total(decode_metrics, "pdserve:kv_transfer_failures_total", reason="unavailable") == 1
        assert scraped_total(decode_metrics, "pdserve:kv_transfer_failures_total", reason="timeout") == 0
        assert scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count", role="decode") == 0

        # the live (decode) worker: every block free, nothing held or running; no key left once leases run out
        assert stack.nats_url is not None and stack.redis_url is not None
        beats, _, problems = wait_settled(stack.nats_url, stack.redis_url, 60)
        assert not problems, problems
        (decode_beat,) = [b for b in beats.values() if b.role == "decode"]
        assert not [b for b in beats.values() if b.role == "prefill"]
        assert decode_beat.free_blocks == decode_beat.total_blocks and decode_beat.held_kv == 0
        assert (decode_beat.prefill_tokens > 0) == (policy == "recompute")
        assert decode.poll() is None  # the decode worker lives on
        assert _segments_of(prefill.pid) == [] and _segments_of(decode.pid) == []
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
    assert _segments_of(prefill.pid) == [] and _segments_of(decode.pid) == []
