"""The KV location a prefill worker writes names as many tokens as the KV it holds, also for a request moved to it
mid-stream (prompt + tokens so far recomputed): a decode worker posts its receives for exactly that count before
the Pull (shared/kv/transfer/posted.py), so a count short of it cost the pair and the pull — the decode worker
recomputed the request. Between hosts every pull is posted (no shared memory), so every moved request paid it
(found by tests/e2e/test_across_hosts.py). A real prefill worker on the tiny engine; JetStream and Redis are
stand-ins."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.prefill.worker import PrefillWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.kv.held import HeldKv
from shared.kv.transfer import EngineKvBlocks
from shared.messages import PrefillJob, Sampling
from shared.settings import WorkerRole, WorkerSettings
from tests.job_msg import FakeMsg
from tests.kv_locations import Registry

PROMPT = list(range(3, 40))
TIMEOUT_S = 60.0


class Published:
    """The prefill worker's JetStream: counts what it publishes."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    async def publish(self, subject: str, payload: bytes, timeout=None, headers=None) -> None:
        self.messages.append(subject)


async def _held_and_located(model_dir, tokens_so_far: list[int]) -> tuple[int, int]:
    """(tokens of the KV the worker holds, tokens its KV location names) after one prefill job."""
    scheduler = SchedulerConfig(max_num_seqs=4)
    engine = EngineConfig(str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=scheduler)
    worker = PrefillWorker(WorkerSettings(role=WorkerRole.PREFILL, worker_id="p", engine=engine,
                                          cluster_secret="s" * 16, metrics_port=None))  # fmt: skip
    js, registry = Published(), Registry()
    worker._conn = SimpleNamespace(js=js)  # pyright: ignore[reportAttributeAccessIssue]
    worker.blocks = EngineKvBlocks(worker.engine.engine, call=worker.engine.call)
    worker.held = held = HeldKv(worker.blocks, lease_s=TIMEOUT_S, registry=registry)  # pyright: ignore[reportAttributeAccessIssue]
    worker.engine.start()
    try:
        sampling = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)
        job = PrefillJob("r", "demo", PROMPT, sampling, "pd.tokens.g.r", attempt=1, output_token_ids=tokens_so_far)
        await worker.handle_job(FakeMsg(job, "pd.jobs.prefill.demo"))  # pyright: ignore[reportArgumentType]
        for _ in range(int(TIMEOUT_S / 0.01)):
            if js.messages and not worker.ledger:
                break
            await asyncio.sleep(0.01)
        assert js.messages, "no decode job was published"
        kv_tokens = await worker.engine.call(lambda e: e.kv_blocks(job.key)[0])
        return kv_tokens, registry.entries[job.key].num_tokens
    finally:
        await held.release_all()
        await worker.engine.stop()


@pytest.mark.parametrize("tokens_so_far", [[], [7, 8, 9, 10, 11]], ids=["fresh", "moved"])
def test_the_location_names_every_token_the_held_kv_covers(model_dir, tokens_so_far):
    held, located = asyncio.run(_held_and_located(model_dir, tokens_so_far))
    assert held == len(PROMPT) + len(tokens_so_far)
    assert located == held
