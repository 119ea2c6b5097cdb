"""The KV hand-off between worker groups of different TP degrees, through the real stack (gateway, NATS, Redis,
prefill and decode workers, some of them TP = 2 groups of two processes each).

For each pairing of prefill and decode TP degrees: every stream equals the single-process engine's greedy output
(what `pdserve generate` prints), the decode side never runs a prompt's forward pass (its heartbeat's
prefill_tokens stays 0: the KV was pulled, rank by rank, never recomputed), and afterwards both sides have
freed every block and no location is left in Redis. The KV lease is long (600 s), so a settled stack means each
KV was freed by its pulls' ends, not by a lease running out. The one-KV-head checkpoint (tiny_mqa) holds its
head replicated on both ranks of a TP 2 group, on either side.
"""

from __future__ import annotations

import pytest

from services.demo_model import write_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos import Load, settled
from tests.e2e.test_faults import FAST, SHORT
from tests.e2e_support import heartbeats, scraped_total, start_stack

pytestmark = pytest.mark.slow  # worker groups: ranks spawned per scenario (make test-slow)

MAX_TOKENS = 24
PROMPTS = [*SHORT, "Prefill is compute-bound and decode is memory-bound; " * 6]
HANDOFF_ENV = FAST | {"PDSERVE_KV_LEASE_S": "600", "PDSERVE_KV_TRANSFER_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dir):
    """size → checkpoint directory; every one is served as model "demo" (its directory's name)."""
    mqa = write_demo_checkpoint(tmp_path_factory.mktemp("mqa") / "demo", arch="qwen3_moe", size="tiny_mqa")
    # DeepSeek-V3's latent cache: one "head" that every rank of a TP group holds whole
    latent = write_demo_checkpoint(tmp_path_factory.mktemp("latent") / "demo", arch="deepseek_v3", size="tiny")
    return {"tiny": model_dir, "tiny_mqa": mqa, "deepseek_v3": latent}


def _reference(checkpoint) -> dict[str, str]:
    """The single-process engine's greedy texts: what `pdserve generate` writes for each prompt."""
    tok = Tokenizer(checkpoint)
    engine = Engine.from_dir(checkpoint, max_model_len=2048)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([tok.encode(p) for p in PROMPTS], params)
    return {p: tok.decode(out) for p, out in zip(PROMPTS, outputs, strict=True)}


@pytest.mark.parametrize(
    ("size", "prefill_tp", "decode_tp"),
    [("tiny", 2, 1), ("tiny", 1, 2), ("tiny_mqa", 2, 2), ("tiny_mqa", 1, 2), ("deepseek_v3", 2, 1)],
    ids=["tp2-to-tp1", "tp1-to-tp2", "mqa-tp2-to-tp2", "mqa-tp1-to-tp2", "latent-tp2-to-tp1"],
)
def test_kv_hands_off_between_tp_degrees(checkpoints, size: str, prefill_tp: int, decode_tp: int) -> None:
    checkpoint = checkpoints[size]
    reference = _reference(checkpoint)
    parallel = {role: (tp, 1) for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)) if tp > 1}
    spec = StackSpec(model=str(checkpoint), port=free_port(), prefill=1, decode=1, threads_per_worker=2,
                     parallel=parallel, env=HANDOFF_ENV)  # fmt: skip
    stack = start_stack(spec)
    try:
        outcomes = Load(stack.url, PROMPTS, MAX_TOKENS).results()
        for o in outcomes:
            assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
            assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"
        settled(stack)  # every block free, no KV held, no pd:* key, every worker idle (the lease: 600 s)
        assert stack.nats_url is not None  # set once the stack started its own nats-server
        by_role = {b.role.value: b for b in heartbeats(stack.nats_url).values()}
        assert by_role["decode"].prefill_tokens == 0, "the decode side ran a prompt's forward pass (recomputed)"
        assert by_role["prefill"].prefill_tokens > 0
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            assert by_role[role].parallel == ("" if tp == 1 else f"tp={tp} ep=1"), by_role[role].parallel
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()


def test_a_send_failing_midway_between_groups_falls_back_to_recompute_and_frees_everything(checkpoints) -> None:
    """TP 2 → TP 2 with every KV send breaking after its first piece (injected on every prefill rank): each decode
    rank's pull fails, every rank drops what it staged, the decode group recomputes (same tokens), and the prefill
    group frees each KV at the first failed send (after every rank's sends in flight ended), not by its lease."""
    checkpoint = checkpoints["tiny"]
    reference = _reference(checkpoint)
    fault = {"PDSERVE_FAULT_KV_SEND_MIDWAY": "1", "PDSERVE_KV_CHUNK_BYTES": "4096"}
    spec = StackSpec(model=str(checkpoint), port=free_port(), prefill=1, decode=1, threads_per_worker=2,
                     parallel={"prefill": (2, 1), "decode": (2, 1)}, env=HANDOFF_ENV | fault)  # fmt: skip
    stack = start_stack(spec)
    try:
        outcomes = Load(stack.url, PROMPTS, MAX_TOKENS).results()
        for o in outcomes:
            assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
            assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"
        settled(stack)
        assert stack.nats_url is not None
        by_role = {b.role.value: b for b in heartbeats(stack.nats_url).values()}
        assert by_role["decode"].prefill_tokens > 0, "the decode group should have recomputed the prompts"
        decode = next(name for name in stack.procs if name.startswith("decode"))
        decode_metrics = f"http://127.0.0.1:{stack.metrics_ports[decode]}/metrics"
        assert scraped_total(decode_metrics, "pdserve:kv_transfer_failures_total") >= 1  # rank 0's own pulls
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
