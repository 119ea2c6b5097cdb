"""A gpt-oss request's KV pulled across real processes (gRPC + a gloo pair, or the pair's shared segment):
its KV cache groups (shared/engine/kv_groups.py) travel as one flat tensor announced per group (wire.py), the
full layers' every block plus only the window's blocks of the sliding layers; the bytes equal the prefill
engine's export, the decode engine continues token for token, and the prefill side frees both groups.
The prefill process is test_kv_transfer.py's, on a gpt-oss checkpoint."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import pytest
import torch

from services.demo_model import GPT_OSS_WINDOW, write_demo_checkpoint
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.transfer import KvTransferClient
from tests.integration.test_kv_transfer import (
    ENGINE_OPTS,
    SECRET,
    TIMEOUT_S,
    PrefillProcess,
    _prefill_main,
    _prompt,
    _run,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", size="tiny")


@pytest.fixture(scope="module")
def prefill(checkpoint):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(theirs, str(checkpoint)), daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise RuntimeError(f"the prefill process did not start (exit code {proc.exitcode})")
        yield PrefillProcess(proc, ours, ours.recv())  # type: ignore[arg-type]  # a spawned Process
        ours.send(("stop",))
        proc.join(15)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _pull(address: str, rid: str, layout, shared_memory: bool):
    async def run():
        client = KvTransferClient(f"decode-{rid}", secret=SECRET, timeout_s=TIMEOUT_S, shared_memory=shared_memory)
        try:
            return await client.pull(address, rid, layout), client
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("shared_memory", [False, True], ids=["pair", "shm"])
def test_a_grouped_hand_off_moves_the_window_only_and_decodes_exactly(prefill, checkpoint, shared_memory):
    prompt = _prompt(150, seed=41)  # 10 blocks of 16; the window (16) reaches back into block 8
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    opts: dict[str, Any] = dict(ENGINE_OPTS)
    whole = Engine.build(EngineConfig(model=str(checkpoint), **opts))
    assert len(whole.pools) == 2
    whole.add_request("w", prompt, params)
    expected = _run(whole)

    rid = f"grouped-{'shm' if shared_memory else 'pair'}"
    first = prefill.prefill(rid, prompt)
    sent = prefill.call("export", rid)  # the prefill engine's export: both groups' blocks, flat
    decode = Engine.build(EngineConfig(model=str(checkpoint), **{**opts, "block_size": 8, "num_kv_blocks": 96}))
    kv, client = _pull(prefill.address, rid, decode.layout, shared_memory)
    assert torch.equal(kv.blocks, sent)
    assert client.stats.shm_pulls == (1 if shared_memory else 0)
    full, window = kv.parts
    assert (full.first_block, full.num_blocks) == (0, 10)
    assert (window.first_block, window.num_blocks) == ((150 - GPT_OSS_WINDOW + 1) // 16, 2)
    one_pool = whole.layout.bytes_per_block * 10  # what one pool of every layer moved: every block of both
    assert kv.nbytes == one_pool * (10 + 2) // 20
    decode.import_kv(rid, prompt, first, params, kv)
    assert first + _run(decode) == expected
    decode.check_integrity()
    assert all(b.num_free == b.num_blocks for b in decode.group_blocks)
    prefill.assert_all_free()
