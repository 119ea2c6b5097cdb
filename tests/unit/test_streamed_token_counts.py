"""Who counts a layer-streamed request's first token in `pdserve:generation_tokens_total`: the worker that emits
it, so the workers' counts sum to the tokens the client got (docs/observability.md) whether the pull works or
fails. A real prefill worker streams a job on the tiny engine (its decode job published before the first token
exists); a real decode worker takes that job and either gets the KV with its first token (the pull's trailer,
handed over by a stand-in transfer client) or sees the pull fail and recomputes, sampling the first token itself.
NATS, Redis and the gRPC pull are stand-ins; everything from the job message to the token events is the
workers' own code."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.decode.worker import DecodeWorker
from services.prefill.worker import PrefillWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.registry import KvLocation
from shared.kv.transfer import EngineKvBlocks, FailureReason, KvTransferError
from shared.kv.transfer.layer_stream import StreamedKv
from shared.messages import DecodeJob, FinishedEvent, PrefillJob, Sampling, TokenEvent, TokensEvent, decode
from shared.settings import KvTransferSettings, WorkerRole, WorkerSettings
from tests.job_msg import FakeMsg

MAX_TOKENS = 6
PROMPT = list(range(3, 40))
SECRET = "s" * 16
TIMEOUT_S = 60.0


class Published:
    """The prefill worker's JetStream: keeps what it publishes."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes, timeout=None, headers=None) -> None:
        self.messages.append((subject, payload))


class Location:
    """The decode worker's KV registry: the prefill worker holds every key."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def get(self, key: str) -> KvLocation:
        return KvLocation(key, "p", self.address, len(PROMPT), "")


class Puller:
    """The decode worker's transfer client: hands over `kv(key)`, or fails as a send broken midway does."""

    def __init__(self, kv=None) -> None:
        self.kv, self.pulled = kv, []

    async def pull(
        self, address: str, key: str, layout, num_tokens: int | None = None, skip_tokens: int = 0
    ) -> StreamedKv:
        assert num_tokens is None, "a streamed job's receives are never posted before the Pull"
        assert skip_tokens == 0, "a layer-streamed KV is pulled whole"
        self.pulled.append(key)
        if self.kv is None:
            raise KvTransferError(FailureReason.UNAVAILABLE, "the send broke midway")
        return await self.kv(key)

    def recycle(self, kv) -> None:
        pass


def _settings(model_dir, role: WorkerRole, worker_id: str) -> WorkerSettings:
    engine = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    kv = KvTransferSettings(stream_layers=True)
    return WorkerSettings(role=role, worker_id=worker_id, engine=engine, kv=kv, cluster_secret=SECRET,
                          metrics_port=None)  # fmt: skip


def _events(worker) -> list[TokenEvent]:
    events = []
    while not worker.outbox.empty():
        events.append(worker.outbox.queue.get_nowait()[1])
    return events


async def _until(done, what: str) -> None:
    for _ in range(int(TIMEOUT_S / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _streamed_hand_off(model_dir, pull_works: bool) -> tuple[DecodeWorker, list[TokenEvent]]:
    """One request through both workers; → the decode worker and the token events the client would get."""
    prefill = PrefillWorker(_settings(model_dir, WorkerRole.PREFILL, "p"))
    decoder = DecodeWorker(_settings(model_dir, WorkerRole.DECODE, "d"))
    js = Published()
    prefill._conn = SimpleNamespace(js=js)  # pyright: ignore[reportAttributeAccessIssue]
    prefill.blocks = EngineKvBlocks(prefill.engine.engine, call=prefill.engine.call)
    prefill.held = HeldKv(prefill.blocks, lease_s=TIMEOUT_S)  # no registry: the decode side's stand-in answers
    puller = Puller(functools.partial(_pulled_from, prefill) if pull_works else None)
    decoder.registry = Location("prefill:1")  # pyright: ignore[reportAttributeAccessIssue]
    decoder.kv.client = puller  # pyright: ignore[reportAttributeAccessIssue]
    prefill.engine.start()
    decoder.engine.start()
    try:
        sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        job = PrefillJob("r", "demo", PROMPT, sampling, "pd.tokens.g.r")
        await prefill.handle_job(FakeMsg(job, "pd.jobs.prefill.demo"))  # pyright: ignore[reportArgumentType]
        await _until(lambda: js.messages and not prefill.ledger, "the prefill worker's hand-on")
        ((_, payload),) = js.messages
        decode_job = decode(payload, DecodeJob)
        assert decode_job.kv_streamed and decode_job.output_token_ids == []  # published before its first token
        msg = FakeMsg(decode_job, "pd.jobs.decode.demo")
        await decoder.handle_job(msg)  # pyright: ignore[reportArgumentType]
        await _until(lambda: not decoder.ledger, "the decode worker to finish the request")
        assert msg.calls[-1] == "ack" and puller.pulled == ["r"]
        return decoder, _events(prefill) + _events(decoder)
    finally:
        await prefill.held.release_all()
        await prefill.engine.stop()
        await decoder.engine.stop()


async def _pulled_from(prefill: PrefillWorker, key: str) -> StreamedKv:
    """What a working pull gives: the prefill engine's held KV and the first token it sampled (the trailer)."""

    def export(engine: Engine) -> StreamedKv:
        kv, first = engine.export_kv(key), engine.requests[key].output_token_ids[0]
        return StreamedKv(**{f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)}, first_token=first)

    return await prefill.engine.call(export)


def _tokens(events: list[TokenEvent]) -> list[int]:
    """The client's stream: every token event's tokens by position, no position twice."""
    by_seq: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, TokensEvent | FinishedEvent) and e.token_ids:
            assert e.seq not in by_seq, f"position {e.seq} sent twice"
            by_seq[e.seq] = e.token_ids
    return [t for seq in sorted(by_seq) for t in by_seq[seq]]


def _generated(role: str) -> float:
    labels = {"model_name": "demo", "role": role}
    return REGISTRY.get_sample_value("pdserve:generation_tokens_total", labels) or 0.0


@pytest.mark.parametrize("pull_works", [True, False], ids=["pulled", "pull-failed"])
def test_the_first_token_is_counted_once_by_the_worker_that_emits_it(model_dir, pull_works):
    prefill_before, decode_before = _generated("prefill"), _generated("decode")
    decoder, events = asyncio.run(_streamed_hand_off(model_dir, pull_works))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert _tokens(events) == Engine.from_dir(model_dir, max_model_len=256).generate([PROMPT], params)[0]
    outputs = [e for e in events if isinstance(e, TokensEvent | FinishedEvent)]
    assert all(e.worker_id == "d" for e in outputs if e.token_ids)  # the prefill worker emitted none
    assert (decoder.load.prefill_tokens > 0) is not pull_works  # recomputed exactly when the pull failed
    assert _generated("prefill") - prefill_before == 0  # sampled there, but emitted (and counted) by decode
    assert _generated("decode") - decode_before == MAX_TOKENS
