"""A worker group of 2 ranks (gloo, TP = 2 over a checkpoint with one KV head, so both ranks' pools hold the same
head): the leader's engine gives the single engine's tokens, and after chunked prefill, forks, preemptions and
imports (broadcast and staged) the follower's KV pool is byte-identical to the leader's, having run exactly the
leader's ops. A collective the
follower never joins times out instead of hanging; a follower that dies is reported at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport
from shared.engine.sampling import SamplingParams
from shared.parallel.group_engine import WorkerGroup, rank_placements, start_group

pytestmark = pytest.mark.slow  # worker groups: ranks spawned per scenario (make test-slow)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """One KV head: at TP = 2 each rank's pool holds it (replicated), so the two pools can be compared byte for
    byte, and a single engine's export fills either."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("mqa") / "demo", arch="qwen3_moe", size="tiny_mqa")


def _config(model_dir, **kw) -> EngineConfig:
    base = dict(
        model=str(model_dir),
        block_size=4,
        num_kv_blocks=40,
        max_model_len=64,
        threads=1,
        prepack_weights=False,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
    )
    return EngineConfig(**(base | kw))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in (27, 9, 33, 18)]


def _workload(engine: Engine, exported: Exported, staged_ref) -> dict[str, list[int]]:
    """Chunked prefills with enough KV pressure to preempt, a fork of 3 choices, and two imports."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    engine.add_group(_prompts()[1], [Choice(f"c{i}", seeded) for i in range(3)])
    prompt, first = _prompts()[2][:21], exported.tokens
    engine.import_kv("imp", prompt, first, GREEDY, exported.kv)
    engine.import_kv("imp-staged", prompt, first, GREEDY, staged_ref(exported.kv))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


class Exported:
    def __init__(self, model_dir) -> None:
        """A request's KV exported by a single engine after its first token (what a prefill worker hands on)."""
        engine = Engine.build(_config(model_dir))
        prompt = _prompts()[2][:21]
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
        tokens = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
        self.tokens = tokens
        self.kv = engine.export_kv("p")


@pytest.fixture(scope="module")
def exported(model_dir) -> Exported:
    return Exported(model_dir)


@pytest.fixture(scope="module")
def group(model_dir):
    deaths: list[tuple[int, int | None]] = []
    g = start_group(_config(model_dir, tp=2), on_death=lambda rank, status: deaths.append((rank, status)))
    yield g
    g.close()
    assert not deaths, f"a follower died during the tests: {deaths}"


def test_group_matches_single_engine_and_pools_stay_identical(model_dir, group: WorkerGroup, exported) -> None:
    single = Engine.build(_config(model_dir))
    key = "staged-imp"

    def staged(kv: KVExport):
        # each rank stages its own copy through its agent (the reslice's per-rank pull), then one op imports
        asyncio.run(group.agents.call_all("stage_kv", {r: (key, kv) for r in group.agents.ranks}))
        return group.ops.state.staged.ref(key)

    expected = _workload(single, exported, staged_ref=lambda kv: kv)
    got = _workload(group.engine, exported, staged_ref=staged)
    assert group.engine.stats.preemptions > 0, "the workload is meant to preempt"
    assert got == expected
    assert got["imp-staged"] == got["imp"]
    group.engine.check_integrity()

    group.ops.sync()  # the follower runs ops behind the leader: let it finish the last step
    digests = asyncio.run(group.agents.call_all("pool_digest", {0: None, 1: None}))
    assert digests[0] == digests[1]
    counts = asyncio.run(group.agents.call_all("op_counts", {0: None, 1: None}))
    assert counts[0] == counts[1]
    assert counts[1]["step"] == group.engine.stats.steps
    assert counts[1]["copy"] >= 1 and counts[1]["write"] == 1 and counts[1]["import_staged"] == 1
    assert group.ops.cost.steps == group.engine.stats.steps and group.ops.cost.bytes > 0


def test_prefix_cache_hits_on_the_leader_are_what_the_follower_computes(model_dir, group: WorkerGroup) -> None:
    """The leader's scheduler decides the hits for both ranks: a follower is sent only the uncached positions
    (its pool holds the cached blocks, written by earlier steps), so tokens and pools still agree."""
    g = torch.Generator().manual_seed(8)
    base = torch.randint(5, 200, (30,), generator=g).tolist()
    waves = [[("pa", base)], [("pb", base[:-1] + [4]), ("pc", base + [9, 9, 9, 9, 9])], [("pd", base[:13])]]

    def serve(engine: Engine) -> tuple[dict[str, list[int]], int]:
        out: dict[str, list[int]] = {}
        before = engine.stats.prefill_tokens
        for wave in waves:
            for rid, prompt in wave:
                engine.add_request(rid, prompt, GREEDY, cache_salt="group-test")
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, engine.stats.prefill_tokens - before

    expected, computed_off = serve(Engine.build(_config(model_dir, enable_prefix_caching=False)))
    hits_before = group.engine.prefix_cache_stats().hit_tokens
    got, computed = serve(group.engine)
    hits = group.engine.prefix_cache_stats().hit_tokens - hits_before
    assert got == expected
    assert hits == 28 + 28 + 12  # whole blocks of 4, the last token of each prompt computed
    assert computed == computed_off - hits  # the steps sent to the follower held only the uncached tokens
    group.engine.check_integrity()
    group.ops.sync()
    digests = asyncio.run(group.agents.call_all("pool_digest", {0: None, 1: None}))
    assert digests[0] == digests[1]


def test_agent_errors_and_unknown_handlers(group: WorkerGroup) -> None:
    from shared.ranklink.agents import AgentError

    with pytest.raises(AgentError, match="no handler 'nope'"):
        asyncio.run(group.agents.call(1, "nope"))
    assert asyncio.run(group.agents.call(1, "unstage_kv", "missing")) is False
    with pytest.raises(KeyError, match="no KV staged"):
        group.ops.state.staged.take("missing")
    pids = asyncio.run(group.agents.call_all("pid", {0: None, 1: None}))
    assert pids == dict(enumerate(group.pids))


def test_extra_collective_times_out_and_a_dead_follower_is_reported(model_dir) -> None:
    died = threading.Event()
    seen: list[tuple[int, int | None]] = []

    def on_death(rank: int, status: int | None) -> None:
        seen.append((rank, status))
        died.set()

    g = start_group(_config(model_dir, tp=2, group_timeout_s=2.0), on_death=on_death)
    try:
        # the leader makes one more collective than its follower (no op announced): it raises, it never hangs
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            g.ops.group.broadcast_(torch.zeros(4, dtype=torch.int64))
        assert time.monotonic() - start < 15
        os.kill(g.pids[1], signal.SIGKILL)
        assert died.wait(5), "the leader did not notice its follower's death"
        assert seen == [(1, -signal.SIGKILL)]
    finally:
        g.close(timeout_s=2)


def test_rank_placements_split_cores_and_threads(tmp_path) -> None:
    cfg = EngineConfig(model=str(tmp_path), threads=4, tp=2)
    cpu = rank_placements(cfg, 2, available=[0, 1, 2, 3])
    assert [p.cores for p in cpu] == [(0, 1), (2, 3)] and [p.threads for p in cpu] == [2, 2]
    assert [p.cores for p in rank_placements(cfg, 2, available=[5])] == [None, None]
    gpu = rank_placements(EngineConfig(model=str(tmp_path), device="cuda:2", tp=2), 2)
    assert [p.device for p in gpu] == ["cuda:2", "cuda:3"]


def test_generate_cli_with_tp_2_prints_the_single_process_text(model_dir) -> None:
    """`pdserve generate --tp 2` (its own process: the leader spawns its follower) gives the text without."""
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    base = [sys.executable, "-m", "services.cli", "generate", "--model", str(model_dir), "--max-tokens", "10"]
    base += ["--ignore-eos", "--json", "--threads", "1", "the worker group"]
    runs = [
        subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=300)
        for extra in ([], ["--tp", "2"])
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    single, group = (json.loads(r.stdout) for r in runs)
    assert group["token_ids"] == single["token_ids"] and group["text"] == single["text"]
    assert "rank 1: the step loop ends (stop)" in runs[1].stderr  # the follower ran the steps, and stopped
