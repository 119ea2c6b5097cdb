"""KV cache groups (shared/engine/kv_groups.py): gpt-oss's full and sliding layers in separate pools, block
managers and tables. The window group frees blocks that leave the window (freed blocks are poisoned: a step
that read one would change the tokens), its live blocks per request stay bounded however long the decode; the
full group grows; everything is given back at the end; forked choices and preemption account per group. Token
parity with transformers for these models is test_model_parity.py's (gpt_oss, qwen3-window, qwen2_moe-window)."""

from __future__ import annotations

import pytest

from services.demo_model import GPT_OSS_WINDOW, write_demo_checkpoint
from shared.engine.block_manager import FREED, NoFreeBlocksError
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.fork import Choice
from shared.engine.kv_budget import GroupNeed, KvPlan, KvShape, KvSizing, split_plan
from shared.engine.kv_groups import KVGroup, kv_groups, window_live_blocks
from shared.engine.sampling import SamplingParams

BLOCK = 4
W = GPT_OSS_WINDOW  # 16: the tiny demo's even layers slide over 16 tokens
PROMPTS = [list(range(3, 103)), list(range(40, 63)), [5, 6, 7]]  # 100 tokens (chunked by a budget of 32), 23, 3
NEW_TOKENS = 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("gpt-oss-groups"), arch="gpt_oss", size="tiny")


def _engine(
    checkpoint, num_blocks: int = 64, block_size: int = BLOCK, budget: int = 32, max_len: int = 256, caching=True
) -> Engine:
    return Engine.from_dir(
        checkpoint,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_len,
        enable_prefix_caching=caching,
    )


def _params(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_layers_are_grouped_by_window():
    assert kv_groups(4, ()) == (KVGroup((0, 1, 2, 3), None),)
    assert kv_groups(2, (8, 8)) == (KVGroup((0, 1), 8),)  # all sliding: one pool, freed by the window
    assert kv_groups(3, (8, 4, 8)) == (KVGroup((0, 1, 2), 8),)  # the largest window frees the one pool
    assert kv_groups(4, (128, None, 128, None)) == (KVGroup((1, 3), None), KVGroup((0, 2), 128))
    assert kv_groups(5, (None, 8, 4, 8, None)) == (
        KVGroup((0, 4), None),
        KVGroup((2,), 4),
        KVGroup((1, 3), 8),
    )
    assert window_live_blocks(16, 4) == 5 and window_live_blocks(16, 16) == 2 and window_live_blocks(16, 4, 32) == 13


def test_the_budget_is_split_so_every_group_holds_the_same_requests():
    shape = KvShape(bytes_per_block=1000, block_size=16, max_model_len=4096)
    total = KvPlan(10_000, shape, KvSizing.KV_CACHE_BYTES, "kv_cache_bytes 9.5 MiB")
    needs = [GroupNeed("full", 500, 256), GroupNeed("window 128", 500, 10)]
    full, window = split_plan(total, needs)
    requests = 10_000 * 1000 // (256 * 500 + 10 * 500)  # 74
    assert (full.num_blocks, window.num_blocks) == (requests * 256, requests * 10)
    assert full.bytes + window.bytes <= total.bytes
    # the same budget as one pool of every layer holds 10_000 // 256 = 39 requests: grouping nearly doubles it
    assert requests > 1.8 * (10_000 // 256)
    tests = split_plan(KvPlan(64, shape, KvSizing.NUM_KV_BLOCKS, "num_kv_blocks 64"), needs[1:])
    assert [p.num_blocks for p in tests] == [64]
    with pytest.raises(ValueError, match="window 128 KV group gets 9 blocks"):
        split_plan(KvPlan(9, shape, KvSizing.NUM_KV_BLOCKS, "num_kv_blocks 9"), needs[1:] + [GroupNeed("w", 1, 10)])


def test_each_group_has_its_own_pool_of_its_layers(checkpoint):
    engine = _engine(checkpoint)
    assert [g.window for g in engine.kv_groups] == [None, W]
    assert [g.layers for g in engine.kv_groups] == [(1,), (0,)]
    assert [p.tensor.shape[0] for p in engine.pools] == [1, 1]
    assert engine.pools[1].layout.layer_windows == (W,) and engine.pools[0].layout.layer_windows == (None,)
    assert engine.layout.num_layers == 2  # the model's layout (fingerprint) is unchanged
    # layer 0 writes into the window pool, layer 1 into the full one
    assert engine.runner._caches[0].data_ptr() == engine.pools[1].tensor[0].data_ptr()
    assert engine.runner._caches[1].data_ptr() == engine.pools[0].tensor[0].data_ptr()


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_the_window_group_frees_blocks_that_leave_the_window_and_never_reads_them(checkpoint, caching):
    keep_all = _engine(checkpoint, caching=False)
    keep_all.scheduler.window_groups = [(b, None) for b, _ in keep_all.scheduler.window_groups]  # type: ignore[misc]
    expected = keep_all.generate(PROMPTS, _params())
    assert keep_all.scheduler.freed_behind_window == 0

    engine = _engine(checkpoint, caching=caching)
    window_blocks, window_pool = engine.group_blocks[1], engine.pools[1]
    free = window_blocks.free

    def poisoning_free(blocks: list[int]) -> None:
        free(blocks)
        cache = window_blocks.cache
        for b in blocks:  # truly free: a block the prefix cache still names may be hit later, its K/V intact
            if b != FREED and window_blocks.ref_count(b) == 0 and (cache is None or cache.hash_of(b) is None):
                window_pool.tensor[:, :, b] = 1e4

    window_blocks.free = poisoning_free
    live: list[int] = []
    full_held: dict[str, int] = {}
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, prompt, _params())
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        # a step whose query is a decode runs on the window's blocks (a prefill chunk's step holds the chunk's)
        decoding = {r.request_id for r in engine.scheduler.running if r.num_computed_tokens == r.num_tokens - 1}
        for o in engine.step():
            results[o.request_id] += o.new_token_ids
        engine.check_integrity()
        for req in engine.scheduler.running:
            full, window = req.group_tables
            assert FREED not in full.blocks  # the full layers keep every block
            if req.request_id in decoding:
                live.append(sum(b != FREED for b in window.blocks))
                full_held[req.request_id] = len(full.blocks)
    assert [results[rid] for rid in ids] == expected
    assert engine.scheduler.freed_behind_window > 0
    assert max(live) <= window_live_blocks(W, BLOCK)  # however far past the window the decode runs
    assert full_held["r0"] == -(-(len(PROMPTS[0]) + NEW_TOKENS - 1) // BLOCK)  # the full group grew with it
    assert all(b.num_free == b.num_blocks for b in engine.group_blocks)


def test_forked_choices_share_both_groups_and_match_single_requests(checkpoint):
    prompt = PROMPTS[0][:42]
    params = _params(24)
    (single,) = _engine(checkpoint).generate([prompt], params)
    engine = _engine(checkpoint)
    engine.add_group(prompt, [Choice(f"g/{i}", params) for i in range(3)])
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_integrity()
    assert [tokens[f"g/{i}"] for i in range(3)] == [single] * 3
    assert engine.stats.prefill_tokens == len(prompt)  # the prompt computed once: the children shared it
    assert all(b.num_free == b.num_blocks for b in engine.group_blocks)


def test_preemption_frees_both_groups(checkpoint):
    """Few blocks: decodes preempt each other and recompute, with the same tokens; both groups account."""
    expected = _engine(checkpoint).generate(PROMPTS[1:], _params(40))
    engine = _engine(checkpoint, num_blocks=26, max_len=96)  # 2 x 63 tokens need 32 full-group blocks
    ids = ["a", "b"]
    for rid, prompt in zip(ids, PROMPTS[1:], strict=True):
        engine.add_request(rid, prompt, _params(40))
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            results[o.request_id] += o.new_token_ids
        engine.check_integrity()
    assert engine.stats.preemptions > 0
    assert [results[rid] for rid in ids] == expected
    assert all(b.num_free == b.num_blocks for b in engine.group_blocks)


def _prefill_held(checkpoint, prompt: list[int]) -> tuple[Engine, list[int]]:
    prefill = _engine(checkpoint)
    prefill.add_request("held", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first: list[int] = []
    while prefill.has_unfinished():
        for o in prefill.step():
            first += o.new_token_ids
    return prefill, first


@pytest.mark.parametrize("decode_block", [BLOCK, 2, 16], ids=lambda b: f"decode-block{b}")
def test_the_hand_off_moves_the_full_layers_and_only_the_window_of_the_window_layers(checkpoint, decode_block):
    prompt = PROMPTS[0]
    (expected,) = _engine(checkpoint).generate([prompt], _params())
    prefill, first = _prefill_held(checkpoint, prompt)
    assert first == expected[:1]
    kv = prefill.export_kv("held")
    total = -(-len(prompt) // BLOCK)
    window_first = (len(prompt) - W + 1) // BLOCK  # the next query (at len(prompt)) sees keys from there on
    full, window = kv.parts
    assert (full.first_block, full.num_blocks) == (0, total)
    assert (window.first_block, window.num_blocks) == (window_first, total - window_first)
    one_pool = prefill.layout.bytes_per_block * total  # every layer's every block: what one pool moved
    assert kv.nbytes == one_pool // 2 * (total + window.num_blocks) // total
    # bytes-identical to the pools' blocks
    (_, held) = prefill.group_kv_blocks("held")
    for i, (pool, (_, ids)) in enumerate(zip(prefill.pools, held, strict=True)):
        assert kv.part_blocks(i).equal(pool.read(ids))
    prefill.release_kv("held")
    assert all(b.num_free == b.num_blocks for b in prefill.group_blocks)

    decode = _engine(checkpoint, block_size=decode_block, num_blocks=256)
    decode.import_kv("held", prompt, first, _params(), kv)
    full_table, window_table = decode.requests["held"].group_tables
    n = -(-len(prompt) // decode_block)
    assert full_table.freed == 0 and len(full_table.blocks) == n and FREED not in full_table.blocks
    assert window_table.freed == kv.first_block_at(decode_block, 1)
    assert sum(b != FREED for b in window_table.blocks) == n - window_table.freed
    out = list(first)
    while decode.has_unfinished():
        for o in decode.step():
            out += o.new_token_ids
        decode.check_integrity()
    assert out == expected
    assert decode.stats.prefill_tokens == 0
    assert all(b.num_free == b.num_blocks for b in decode.group_blocks)


def test_an_import_that_does_not_fit_a_group_takes_nothing(checkpoint):
    prefill, first = _prefill_held(checkpoint, PROMPTS[0])
    kv = prefill.export_kv("held")
    decode = _engine(checkpoint, num_blocks=64)
    decode.group_blocks[0].allocate(50)  # the full group cannot take the 25 blocks: the window group takes none
    with pytest.raises(NoFreeBlocksError):
        decode.import_kv("held", PROMPTS[0], first, _params(), kv)
    assert decode.group_blocks[1].num_free == 64 and "held" not in decode.requests
    with pytest.raises(ValueError, match="KV cache groups"):
        decode.kv_blocks("held")


def test_the_wire_announces_each_group_and_refuses_spans_that_do_not_fit(checkpoint):
    from shared.kv.transfer.errors import KvTransferError
    from shared.kv.transfer.wire import announced_layout, describe, received

    prefill, _ = _prefill_held(checkpoint, PROMPTS[0])
    kv = prefill.export_kv("held")
    reply = describe(kv, tag=0, chunk_bytes=0)
    assert [(g.num_layers, g.first_block, g.num_blocks) for g in reply.groups] == [
        (p.num_layers, p.first_block, p.num_blocks) for p in kv.parts
    ]
    assert list(reply.shape) == [kv.blocks.numel()]
    source = announced_layout(reply, prefill.layout)
    back = received(reply, source, kv.blocks.clone())
    assert back.parts == kv.parts and back.part_blocks(1).equal(kv.part_blocks(1))
    for field, value in [("first_block", 0), ("num_blocks", 1), ("num_layers", 2)]:
        bad = type(reply)()
        bad.CopyFrom(reply)
        setattr(bad.groups[1], field, value)
        with pytest.raises(KvTransferError, match="does not match the receiver's layout"):
            announced_layout(bad, prefill.layout)
