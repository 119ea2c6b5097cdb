"""KV export from one engine, import into another, continue decoding: the disaggregation hand-off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams


def _engine(checkpoint, model, **overrides) -> Engine:
    """An engine sharing the already loaded weights (each engine has its own KV pool and scheduler)."""
    opts = dict(num_kv_blocks=48, max_model_len=512, scheduler=SchedulerConfig(max_num_batched_tokens=64)) | overrides
    return Engine.build(EngineConfig(model=str(checkpoint), **opts), model)


PROMPT = torch.randint(0, 259, (70,), generator=torch.Generator().manual_seed(7)).tolist()


def _handoff(prefill: Engine, decode: Engine, params: SamplingParams, rid: str = "r") -> list[int]:
    """Prefill on one engine (first token), move the KV, decode the rest on the other."""
    prefill.add_request(rid, PROMPT, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    first = []
    while prefill.has_unfinished():
        for out in prefill.step():
            first += out.new_token_ids
    kv = prefill.export_kv(rid)
    assert kv.num_tokens == len(PROMPT)
    assert prefill.release_kv(rid)
    prefill.check_integrity()
    assert prefill.blocks.num_free == prefill.blocks.num_blocks

    decode.import_kv(rid, PROMPT, first, params, kv)
    tokens = list(first)
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert decode.stats.prefill_tokens == 0  # the decode side never ran the prompt
    decode.check_integrity()
    assert decode.blocks.num_free == decode.blocks.num_blocks
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_handoff_continues_exactly(checkpoint, model, params):
    baseline = _engine(checkpoint, model)
    baseline.add_request("r", PROMPT, params)
    expected = []
    while baseline.has_unfinished():
        for out in baseline.step():
            expected += out.new_token_ids
    assert len(expected) == 24
    got = _handoff(_engine(checkpoint, model), _engine(checkpoint, model), params)
    assert got == expected


def test_handoff_across_block_sizes(checkpoint, model):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    same = _handoff(_engine(checkpoint, model), _engine(checkpoint, model), params)
    recut = _handoff(
        _engine(checkpoint, model, block_size=16), _engine(checkpoint, model, block_size=8, num_kv_blocks=96), params
    )
    assert recut == same


def test_import_rejects_bad_input_and_takes_nothing(checkpoint, model):
    prefill, decode = _engine(checkpoint, model), _engine(checkpoint, model, num_kv_blocks=40)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prefill.add_request("r", PROMPT, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    first = []
    while prefill.has_unfinished():
        first += [t for o in prefill.step() for t in o.new_token_ids]
    kv = prefill.export_kv("r")

    with pytest.raises(ValueError, match="expected prompt"):
        decode.import_kv("r", PROMPT[:-1], first, params, kv)
    with pytest.raises(ValueError, match="first sampled token"):
        decode.import_kv("r", PROMPT, [], params, kv)
    other = dataclasses.replace(kv, layout=dataclasses.replace(kv.layout, num_kv_heads=kv.layout.num_kv_heads * 2))
    with pytest.raises(ValueError, match="layout"):
        decode.import_kv("r", PROMPT, first, params, other)

    # Fill the decode pool so the import cannot fit: it must fail whole, taking no block.
    hog = decode.blocks.allocate(decode.blocks.num_free - 2)
    with pytest.raises(NoFreeBlocksError):
        decode.import_kv("r", PROMPT, first, params, kv)
    assert decode.blocks.num_free == 2 and "r" not in decode.requests
    decode.blocks.free(hog)
    decode.import_kv("r", PROMPT, first, params, kv)
    decode.check_integrity()


def test_export_requires_finished_prefill_and_abort_frees_held_blocks(checkpoint, model):
    engine = _engine(checkpoint, model, scheduler=SchedulerConfig(max_num_batched_tokens=32))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    with pytest.raises(ValueError, match="prefill"):
        engine.export_kv("r")
    engine.step()  # first chunk of 32: still prefilling
    with pytest.raises(ValueError, match="prefill"):
        engine.export_kv("r")
    while engine.has_unfinished():
        engine.step()
    assert engine.export_kv("r").num_tokens == len(PROMPT)
    assert engine.blocks.num_free < engine.blocks.num_blocks  # held after finishing
    assert engine.abort("r")
    engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    with pytest.raises(KeyError):
        engine.export_kv("r")


def test_waiting_tokens_shrink_as_prompts_are_scheduled(checkpoint, model):
    """What a worker's admission reads (from another thread) to keep one step's worth of prompts queued."""
    engine = _engine(checkpoint, model, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("a", list(range(1, 41)), params)
    engine.add_request("b", list(range(1, 31)), params)
    assert engine.num_waiting_tokens == 70
    engine.step()  # a (40) whole and b's first 24 tokens: chunked under the 64-token budget
    assert engine.num_waiting == 0 and engine.num_waiting_tokens == 0
    engine.add_request("c", list(range(1, 11)), params)
    assert engine.num_waiting_tokens == 10
