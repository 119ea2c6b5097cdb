"""DecodeTables (shared/engine/decode_tables.py): the persistent decode block tables equal the lists padded afresh
after any sequence of joins, leaves, growths and replacements, writing whole rows only where a table changed
hands; and an engine's tokens are the same with and without them under joins, finishes, aborts and preemption."""

from __future__ import annotations

import random

import torch

from shared.engine.config import SchedulerConfig
from shared.engine.decode_tables import DecodeTables
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(len(tables), width)


def test_rows_follow_their_lists_and_write_only_what_changed():
    dt = DecodeTables()
    a, b = [3, 4], [7]
    assert torch.equal(dt.update([a, b]), _padded([a, b]))
    assert dt.rows_written == 2
    a.append(5)  # grew in place: no whole row written
    assert torch.equal(dt.update([a, b]), _padded([a, b]))
    assert dt.rows_written == 2
    c = [9, 9, 9, 9, 9]  # a new list takes row 0 (the old one left), then a shorter one: the tail is zeroed
    assert torch.equal(dt.update([c, b]), _padded([c, b]))
    d = [1]
    assert torch.equal(dt.update([d, b]), _padded([d, b]))
    assert dt.table[0, 1:].eq(0).all()
    assert dt.rows_written == 4


def test_random_joins_leaves_and_growth_match_fresh_padding():
    rng = random.Random(0)
    dt = DecodeTables()
    live: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.2 or not live:
            live.insert(rng.randrange(len(live) + 1), [rng.randrange(100) for _ in range(rng.randrange(0, 6))])
        elif op < 0.35:
            live.pop(rng.randrange(len(live)))
        elif op < 0.45:  # released and readmitted: a new list of the same length
            i = rng.randrange(len(live))
            live[i] = [rng.randrange(100) for _ in live[i]]
        else:
            for t in live:
                if rng.random() < 0.3:
                    t.extend(rng.randrange(100) for _ in range(rng.randrange(1, 3)))
        assert torch.equal(dt.update(live), _padded(live))


def test_engine_tokens_equal_with_and_without_persistent_tables(checkpoint):
    """A small pool (preemptions), staggered joins, an abort, different lengths, greedy: the same tokens."""

    def run(persistent: bool) -> tuple[dict[str, list[int]], int]:
        engine = Engine.from_dir(
            checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=64), num_kv_blocks=9, max_model_len=96
        )
        if not persistent:
            engine.runner.decode_tables = None
        gen = torch.Generator().manual_seed(3)
        out: dict[str, list[int]] = {}
        for step in range(120):
            if step % 3 == 0 and step < 30:
                for j in range(2):
                    rid = f"r{step}-{j}"
                    prompt = torch.randint(0, 200, (5 + (step + j) % 13,), generator=gen).tolist()
                    engine.add_request(rid, prompt, SamplingParams(max_tokens=10 + step % 7, temperature=0.0))
                    out[rid] = []
            if step == 9:
                engine.abort("r3-1")
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        assert not engine.has_unfinished()
        engine.check_integrity()
        return out, engine.stats.preemptions

    with_tables, preempted = run(True)
    assert preempted > 0  # the pool is small enough that requests were preempted and recomputed
    assert with_tables == run(False)[0]
