"""Partial pulls (docs/kv_transfer.md "Partial pulls"): the source cuts a KV down to the blocks from a token on
(shared/kv/transfer/skip.py), and a decode engine imports them behind the cached blocks of the prompt it pinned
(shared/engine/prefix_pins.py). A multi-turn follow-up decodes the same greedy tokens as a single engine, block
accounting checked after every step."""

from __future__ import annotations

import random

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport, KVPart
from shared.engine.sampling import SamplingParams
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.skip import skip_cached
from shared.model.loader import load_model

B = 4
SALT = "conversation-1"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


def _engine(checkpoint, model, caching: bool = True, **kw) -> Engine:
    base = dict(block_size=B, num_kv_blocks=64, max_model_len=160, threads=1, prefix_cache_namespace="demo")
    return Engine.build(EngineConfig(model=str(checkpoint), enable_prefix_caching=caching, **(base | kw)), model=model)


def _prefill(engine: Engine, rid: str, prompt: list[int]) -> tuple[int, KVExport]:
    """The prefill side: the prompt computed, its first token, its KV exported (held until released)."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True, cache_salt=SALT)
    first: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            first += o.new_token_ids
    kv = engine.export_kv(rid)
    engine.release_kv(rid)
    return first[0], kv


def _decode(engine: Engine, rid: str) -> list[int]:
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
        engine.check_integrity()
    return out


def _reference(checkpoint, model, prompt: list[int]) -> list[int]:
    return _engine(checkpoint, model, caching=False).generate([prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def conversation(checkpoint, model):
    """Turn 1 decoded on a decode engine (its prompt and answer now cached there), and turn 2's prompt: turn 1's
    prompt, its answer and a new user message."""
    prefill, decode = _engine(checkpoint, model), _engine(checkpoint, model)
    turn1 = _tokens(30, 1)
    first, kv = _prefill(prefill, "t1", turn1)
    decode.import_kv("t1", turn1, [first], GREEDY, kv, cache_salt=SALT)
    answer = [first] + _decode(decode, "t1")
    turn2 = turn1 + answer + _tokens(9, 2)
    return prefill, decode, turn2


def test_a_follow_up_pulls_only_the_blocks_the_decode_cache_lacks(checkpoint, model, conversation):
    prefill, decode, turn2 = conversation
    cached = decode.pin_prefix("t2", turn2, SALT)
    assert cached >= 32 and cached % B == 0  # turn 1's prompt and most of its answer, whole blocks
    decode.check_integrity()  # the pin holds its blocks
    first, whole = _prefill(prefill, "t2", turn2)
    cut = skip_cached(whole, cached)
    assert cut.first_block == cached // B
    assert cut.blocks.shape[2] == -(-len(turn2) // B) - cached // B  # only the blocks past the cached ones
    assert cut.nbytes < whole.nbytes
    assert cut.blocks.equal(whole.blocks[:, :, cached // B :])
    decode.import_kv("t2", turn2, [first], GREEDY, cut, cache_salt=SALT, pinned="t2")
    tokens = [first] + _decode(decode, "t2")
    assert tokens == _reference(checkpoint, model, turn2)
    assert not decode.unpin_prefix("t2")  # the import took the pin


def test_a_whole_kv_behind_a_pin_is_imported_whole_and_the_pin_given_back(checkpoint, model, conversation):
    """A source that ignores the skip (a grouped or layer-streamed send): the pulled copy serves, the pinned
    blocks are given back."""
    prefill, decode, turn2 = conversation
    assert decode.pin_prefix("whole", turn2, SALT) > 0
    first, whole = _prefill(prefill, "whole", turn2)
    decode.import_kv("whole", turn2, [first], GREEDY, whole, cache_salt=SALT, pinned="whole")
    assert [first] + _decode(decode, "whole") == _reference(checkpoint, model, turn2)
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_pinned_blocks_survive_pressure_and_unpin_returns_them(checkpoint, model, conversation):
    _, decode, turn2 = conversation
    cached = decode.pin_prefix("p", turn2, SALT)
    pinned = decode.handoff.pins.pinned()
    assert len(pinned) == cached // B
    with pytest.raises(ValueError):
        decode.pin_prefix("p", turn2, SALT)
    assert decode.pin_prefix("other-salt", turn2, "another") == 0  # salts isolate
    taken = decode.blocks.allocate(decode.blocks.num_free)  # every free and evictable block: evicts the rest
    assert not set(taken) & set(pinned)
    decode.blocks.check_integrity()
    decode.blocks.free(taken)
    assert decode.unpin_prefix("p") and not decode.unpin_prefix("p")
    decode.check_integrity()
    assert decode.pin_prefix("p", turn2, SALT) == cached  # still cached: evictable again, not evicted
    assert decode.unpin_prefix("p")


def test_an_import_that_fails_gives_the_pin_back(checkpoint, model, conversation):
    prefill, decode, turn2 = conversation
    cached = decode.pin_prefix("bad", turn2, SALT)
    first, whole = _prefill(prefill, "bad", turn2)
    cut = skip_cached(whole, cached)
    with pytest.raises(ValueError):  # no first token: refused
        decode.import_kv("bad", turn2, [], GREEDY, cut, cache_salt=SALT, pinned="bad")
    assert not decode.unpin_prefix("bad")
    decode.check_integrity()
    assert decode.blocks.num_free == decode.blocks.num_blocks
    with pytest.raises(ValueError):  # a KV without its first blocks and no pin in front of it
        decode.import_kv("bad", turn2, [first], GREEDY, cut, cache_salt=SALT)
    decode.check_integrity()


def test_a_latent_cache_follow_up(tmp_path_factory):
    """MLA's latent cache (one plane): the same cut and import behind the pinned blocks."""
    path = write_demo_checkpoint(tmp_path_factory.mktemp("mla"), arch="deepseek_v3", size="tiny")
    mla = load_model(path)
    prefill, decode = _engine(path, mla), _engine(path, mla)
    turn1 = _tokens(30, 3)
    first, kv = _prefill(prefill, "t1", turn1)
    decode.import_kv("t1", turn1, [first], GREEDY, kv, cache_salt=SALT)
    turn2 = turn1 + [first] + _decode(decode, "t1") + _tokens(9, 4)
    cached = decode.pin_prefix("t2", turn2, SALT)
    assert cached > 0
    first, whole = _prefill(prefill, "t2", turn2)
    decode.import_kv("t2", turn2, [first], GREEDY, skip_cached(whole, cached), cache_salt=SALT, pinned="t2")
    assert [first] + _decode(decode, "t2") == _reference(path, mla, turn2)


def test_engines_that_do_not_pin(checkpoint, model, tmp_path_factory):
    """Prefix caching off; a hybrid model's full and sliding groups (its window group needs the window's blocks
    too): nothing pinned, the KV is pulled whole."""
    off = _engine(checkpoint, model, caching=False)
    assert off.pin_prefix("k", _tokens(30, 1)) == 0 and not off.unpin_prefix("k")
    path = write_demo_checkpoint(tmp_path_factory.mktemp("hybrid"), arch="gpt_oss", size="tiny")
    hybrid = _engine(path, load_model(path))
    prompt = _tokens(30, 1)
    hybrid.generate([prompt], GREEDY)
    assert hybrid.prefix_cache_hashes()  # cached, but not pinned
    assert hybrid.pin_prefix("k", prompt + [7]) == 0


# ---- the source's cut ------------------------------------------------------------------------------------


def test_the_cut_keeps_the_last_block_and_leaves_grouped_exports_whole(checkpoint, model):
    engine = _engine(checkpoint, model)
    prompt = _tokens(17, 5)  # 5 blocks, the last with one token
    _, kv = _prefill(engine, "s", prompt)
    assert skip_cached(kv, 0) is kv and skip_cached(kv, 3) is kv  # less than a block: nothing to cut
    assert skip_cached(kv, 8).first_block == 2
    assert skip_cached(kv, 1000).first_block == 4  # never past the last block
    two = skip_cached(skip_cached(kv, 8), 4)  # a cut asks from before the tensor's first block: as it is
    assert two.first_block == 2
    flat = torch.zeros(kv.blocks.numel())
    grouped = KVExport(kv.layout, kv.num_tokens, flat, parts=(KVPart(kv.layout.num_layers, 0, 5),))
    assert skip_cached(grouped, 8) is grouped


@pytest.mark.parametrize("mode", ["flat", "direct"])
def test_the_cut_of_a_send_from_the_pool(checkpoint, model, mode):
    engine = _engine(checkpoint, model)
    prompt = _tokens(21, 6)  # 6 blocks
    engine.add_request("s", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    num_tokens, block_ids, first = engine.kv_blocks("s")
    small = 1 << 40 if mode == "flat" else 0
    kv = PoolKv.plan(engine.pool, num_tokens, block_ids, lambda s, d: torch.empty(s, dtype=d), small, 0)
    assert kv.mode == mode
    cut = skip_cached(kv, 9)
    assert cut.first_block == 2 and cut.block_ids == block_ids[2:] and cut.mode == mode
    out = torch.empty(cut.shape, dtype=engine.pool.tensor.dtype)
    cut.copy_into(out)
    assert out.equal(engine.export_kv("s").blocks[:, :, 2:])
    if mode == "flat":
        assert cut.staging is not None and cut.staging.shape == cut.shape and cut.staging.is_contiguous()
        assert cut.staging.data_ptr() == kv.staging.data_ptr()  # the front of the same buffer
        pieces = torch.cat([p.reshape(-1) for p in cut.pieces(0)])
        assert pieces.equal(out.reshape(-1))
