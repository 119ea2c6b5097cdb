"""Blocks behind the sliding window are freed (a model whose every layer slides), and no step attends to them
again: freed blocks are poisoned with huge values (finite: a masked-out padding slot may still be multiplied
by its zero weight, as with any junk in a free block), and the tokens still equal those of a run that keeps
every block."""

from __future__ import annotations

import json

import pytest

from services.demo_model import write_demo_checkpoint
from shared.engine.block_manager import FREED
from shared.engine.config import SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_pool import KVLayout
from shared.engine.sampling import SamplingParams

WINDOW, BLOCK = 16, 8
PROMPTS = [list(range(3, 103)), list(range(40, 63)), [5, 6, 7]]  # 100 tokens (chunked), 23, 3
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_demo_checkpoint(tmp_path_factory.mktemp("mixtral-window"), arch="mixtral")
    config = json.loads((path / "config.json").read_text()) | {"sliding_window": WINDOW}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _engine(checkpoint) -> Engine:
    return Engine.from_dir(
        checkpoint,
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
        num_kv_blocks=64,
        block_size=BLOCK,
        max_model_len=256,
    )


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_blocks_behind_the_window_are_freed_and_never_read(checkpoint):
    keep_all = _engine(checkpoint)
    keep_all.scheduler.window = None  # the same model, every block kept
    expected = keep_all.generate(PROMPTS, _params())
    assert keep_all.scheduler.freed_behind_window == 0

    engine = _engine(checkpoint)
    assert engine.scheduler.window == WINDOW
    free = engine.blocks.free

    def poisoning_free(blocks: list[int]) -> None:
        free(blocks)
        for b in blocks:
            if b != FREED and engine.blocks.ref_count(b) == 0:
                engine.pool.tensor[:, :, b] = 1e4

    engine.blocks.free = poisoning_free
    held_while_decoding = []
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, prompt, _params())
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            results[o.request_id] += o.new_token_ids
        engine.check_integrity()
        for req in engine.scheduler.running:
            if req.num_computed_tokens == req.num_tokens - 1:
                held_while_decoding.append(sum(b != FREED for b in req.block_table))
    assert [results[rid] for rid in ids] == expected
    assert engine.scheduler.freed_behind_window > 0
    # decoding, a request holds the blocks of the window's WINDOW - 1 earlier keys and the block of its
    # current token: at most cdiv(WINDOW - 1, BLOCK) + 1 (+ 1 when the window straddles a block boundary)
    assert max(held_while_decoding) <= -(-(WINDOW - 1) // BLOCK) + 2
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("decode_block", [BLOCK, 4, 16], ids=lambda b: f"decode-block{b}")
def test_the_hand_off_moves_only_the_window_and_decodes_alike(checkpoint, decode_block):
    """A prefill engine holding a request's KV for the hand-off frees behind the window too; the export carries
    the blocks from the first unfreed one (at any receiving block size); the decode engine continues it to the
    tokens one engine writes."""
    (expected,) = _engine(checkpoint).generate([PROMPTS[0]], _params())
    prefill = _engine(checkpoint)
    prefill.add_request("held", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first: list[int] = []
    while prefill.has_unfinished():
        for o in prefill.step():
            first += o.new_token_ids
    assert first == expected[:1]
    kv = prefill.export_kv("held")
    total = -(-len(PROMPTS[0]) // BLOCK)
    assert kv.num_tokens == len(PROMPTS[0]) and kv.first_block > 0
    assert kv.blocks.shape[2] == total - kv.first_block  # only the window's blocks move
    assert prefill.scheduler.freed_behind_window == kv.first_block
    prefill.release_kv("held")
    assert prefill.blocks.num_free == prefill.blocks.num_blocks

    decode = Engine.from_dir(checkpoint, num_kv_blocks=64, block_size=decode_block, max_model_len=256)
    decode.import_kv("held", PROMPTS[0], first, _params(), kv)
    held = sum(b != FREED for b in decode.requests["held"].block_table)
    assert held == -(-len(PROMPTS[0]) // decode_block) - kv.first_block_at(decode_block)
    out = list(first)
    while decode.has_unfinished():
        for o in decode.step():
            out += o.new_token_ids
        decode.check_integrity()
    assert out == expected
    assert decode.stats.prefill_tokens == 0
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_the_layout_fingerprint_carries_the_windows():
    plain = KVLayout(2, 2, 16, 16, "float32")
    assert plain.fingerprint == KVLayout(2, 2, 16, 16, "float32", layer_windows=()).fingerprint
    windowed = KVLayout(2, 2, 16, 16, "float32", layer_windows=(16, None))
    assert windowed.fingerprint not in (plain.fingerprint, KVLayout(2, 2, 16, 16, "float32", (), (8, None)).fingerprint)
    assert windowed.fingerprint == KVLayout(2, 2, 16, 16, "float32", layer_windows=(16, None)).fingerprint
