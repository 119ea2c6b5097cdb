"""The decode worker's admission pipeline (services/decode/worker.py), stage by stage with fakes, then whole on the
tiny engine: locate (a miss is recomputed), pull (a failure is recomputed or failed per kv_fallback), import and
the fork for n choices (one pull, one import), and who emits token 0 (the decode worker only for a job handed on
before its first token existed, the layer-streamed one)."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest

from services.decode.first_token import owes_first_token, with_first_token
from services.decode.into_engine import import_and_fork
from services.decode.locate import Missing, locate
from services.decode.worker import DecodeWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVLayout
from shared.engine.sampling import SamplingParams
from shared.kv.decode_kv import DecodeKv
from shared.kv.registry import KvLocation
from shared.kv.transfer import FailureReason, KvTransferError
from shared.kv.transfer.layer_stream import StreamedKv
from shared.messages import (
    Cancel,
    DecodeJob,
    FailedEvent,
    FinishedEvent,
    Sampling,
    Sibling,
    TakenEvent,
    TokenEvent,
    TokensEvent,
)
from shared.settings import KvFallback, KvTransferSettings, WorkerRole, WorkerSettings
from tests.job_msg import FakeMsg

PROMPT = list(range(3, 30))
MAX_TOKENS = 5
SECRET = "s" * 16
TIMEOUT_S = 60.0


def _job(streamed: bool = False, holder: str | None = "p", siblings=(), **sampling) -> DecodeJob:
    s = Sampling(max_tokens=sampling.pop("max_tokens", MAX_TOKENS), temperature=0.0, ignore_eos=True, **sampling)
    outputs = [] if streamed else [7]
    return DecodeJob("r", "demo", PROMPT, outputs, s, "pd.tokens.g.r", prefill_worker=holder,
                     siblings=list(siblings), kv_streamed=streamed)  # fmt: skip


class Registry:
    """The KV records in Redis: `records` by key, or an error for every read."""

    def __init__(self, records: dict[str, KvLocation] | None = None, error: Exception | None = None) -> None:
        self.records, self.error, self.read = records or {}, error, []

    async def get(self, key: str) -> KvLocation | None:
        self.read.append(key)
        if self.error is not None:
            raise self.error
        return self.records.get(key)


def _loc(key: str = "r") -> KvLocation:
    return KvLocation(key, "p", "prefill:1", len(PROMPT), "")


# ---- locate ---------------------------------------------------------------------------------------------------


def test_locate_finds_the_record_under_the_kv_key_and_says_why_on_a_miss():
    found = asyncio.run(locate(Registry({"r": _loc()}), _job()))
    assert isinstance(found, KvLocation) and found.rpc_address == "prefill:1"
    group = Registry({"q": _loc("q")})  # a group's KV is held under its first choice's key
    assert isinstance(asyncio.run(locate(group, msgspec.structs.replace(_job(), kv_key="q"))), KvLocation)
    assert group.read == ["q"]
    miss = asyncio.run(locate(Registry(), _job()))
    assert isinstance(miss, Missing) and miss.may_fail and "no KV location" in miss.reason
    down = asyncio.run(locate(Registry(error=ConnectionError("refused")), _job()))
    assert isinstance(down, Missing) and down.may_fail and "refused" in down.reason


def test_a_job_with_nothing_to_pull_is_a_miss_no_policy_fails():
    registry = Registry({"r": _loc()})
    miss = asyncio.run(locate(registry, _job(holder=None)))
    assert isinstance(miss, Missing) and not miss.may_fail and registry.read == []


# ---- pull -----------------------------------------------------------------------------------------------------


class Client:
    """The transfer client: hands over `kv`, or fails as a broken send does; records pulls and recycles."""

    def __init__(self, kv=None) -> None:
        self.kv, self.pulls, self.recycled = kv, [], []

    async def pull(self, address: str, key: str, layout, num_tokens: int | None = None, skip_tokens: int = 0):
        self.pulls.append((address, key, num_tokens))
        self.skipped = skip_tokens
        if self.kv is None:
            raise KvTransferError(FailureReason.UNAVAILABLE, "the send broke midway")
        return self.kv

    def recycle(self, kv) -> None:
        self.recycled.append(kv)


def _kv_pull(client: Client) -> DecodeKv:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    pull = DecodeKv(KvTransferSettings(), "d", layout, secret=SECRET, model_name="demo")
    pull.client = client  # pyright: ignore[reportAttributeAccessIssue]
    return pull


def test_pull_posts_its_receives_unless_streamed_and_hands_the_kv_back():
    kv = object()
    client = Client(kv)
    pull = _kv_pull(client)
    assert asyncio.run(pull.pull("r", _loc())) == (kv, None)
    assert asyncio.run(pull.pull("r", _loc(), streamed=True)) == (kv, None)
    assert client.pulls == [("prefill:1", "r", len(PROMPT)), ("prefill:1", "r", None)]
    pull.recycle(kv)  # pyright: ignore[reportArgumentType]
    asyncio.run(pull.drop(kv))  # pyright: ignore[reportArgumentType]  # not staged: nothing to drop
    assert client.recycled == [kv]


def test_a_failed_pull_says_why_and_raises_nothing():
    kv, failure = asyncio.run(_kv_pull(Client()).pull("r", _loc()))
    assert kv is None and failure is not None and "broke midway" in failure


# ---- import, and the fork for n choices -----------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def import_kv(self, key, prompt, outputs, params, kv, cache_salt="", pinned=None) -> None:
        self.calls.append(("import", key, outputs, params.prompt_logprobs))

    def fork(self, parent, children) -> list:
        self.calls.append(("fork", parent, [c.request_id for c in children]))
        return []


def test_the_first_choice_imports_the_kv_and_the_others_fork_from_it():
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    choices = [Choice("r", params, (7,)), Choice("r_c1", params, (8,)), Choice("r_c2", params, (9,))]
    engine = Recorder()
    import_and_fork(engine, PROMPT, KVExport.__new__(KVExport), choices)  # pyright: ignore[reportArgumentType]
    # the prompt's logprobs were reported by the prefill worker: not asked of the import
    assert engine.calls == [("import", "r", [7], None), ("fork", "r", ["r_c1", "r_c2"])]
    alone = Recorder()
    import_and_fork(alone, PROMPT, KVExport.__new__(KVExport), choices[:1])  # pyright: ignore[reportArgumentType]
    assert [c[0] for c in alone.calls] == ["import"]


def test_only_a_job_handed_on_before_its_first_token_owes_it():
    assert owes_first_token(_job(streamed=True)) and not owes_first_token(_job())
    assert with_first_token(_job(streamed=True), 42).output_token_ids == [42]


# ---- the whole pipeline on the tiny engine --------------------------------------------------------------------


def _engine_config(model_dir) -> EngineConfig:
    return EngineConfig(str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4))


def _prefilled(model_dir, streamed: bool) -> tuple[KVExport, int]:
    """The prompt's KV as a prefill engine holds it after sampling token 0 (the job's 7 is a stand-in: the KV
    covers the prompt only), as a streamed pull hands it over (with token 0) or a plain one."""
    engine = Engine.from_dir(str(model_dir), max_model_len=256)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first: list[int] = []
    while engine.has_unfinished():
        first += [t for out in engine.step() for t in out.new_token_ids]
    kv = engine.export_kv("r")
    if streamed:
        kv = StreamedKv(**{f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)}, first_token=first[0])
    return kv, first[0]


async def _admit(model_dir, job: DecodeJob, kv, fallback: KvFallback = KvFallback.RECOMPUTE, record: bool = True):
    """One job through a real decode worker; → the worker, the job's message, the client and the events."""
    kv_settings = KvTransferSettings(fallback=fallback)
    settings = WorkerSettings(role=WorkerRole.DECODE, worker_id="d", engine=_engine_config(model_dir), kv=kv_settings,
                              cluster_secret=SECRET, metrics_port=None)  # fmt: skip
    worker = DecodeWorker(settings)
    client = Client(kv)
    worker.registry = Registry({"r": _loc()} if record else {})  # pyright: ignore[reportAttributeAccessIssue]
    worker.kv.client = client  # pyright: ignore[reportAttributeAccessIssue]
    worker.engine.start()
    try:
        msg = FakeMsg(job)
        await worker.handle_job(msg)  # pyright: ignore[reportArgumentType]
        for _ in range(int(TIMEOUT_S / 0.01)):
            if not worker.ledger:
                break
            await asyncio.sleep(0.01)
        assert not worker.ledger, "the decode worker did not finish the request"
        events = []
        while not worker.outbox.empty():
            events.append(worker.outbox.queue.get_nowait()[1])
        return worker, msg, client, events
    finally:
        await worker.engine.stop()


def _by_request(events: list[TokenEvent]) -> dict[str, dict[int, list[int]]]:
    """Each request's tokens by position (no position twice)."""
    seen: dict[str, dict[int, list[int]]] = {}
    for e in events:
        if isinstance(e, TokensEvent | FinishedEvent) and e.token_ids:
            assert e.seq not in seen.setdefault(e.request_id, {}), f"{e.request_id} position {e.seq} twice"
            seen[e.request_id][e.seq] = e.token_ids
    return seen


def test_a_located_pulled_job_is_imported_and_decoded_without_its_prompt(model_dir):
    kv, _ = _prefilled(model_dir, streamed=False)
    worker, msg, client, events = asyncio.run(_admit(model_dir, _job(), kv))
    tokens = _by_request(events)["r"]
    assert min(tokens) == 1 and sum(map(len, tokens.values())) == MAX_TOKENS - 1  # token 0 was prefill's
    assert worker.load.prefill_tokens == 0 and len(client.pulls) == 1 and client.recycled == [kv]
    assert msg.calls[-1] == "ack"


@pytest.mark.parametrize("fallback", [KvFallback.RECOMPUTE, KvFallback.FAIL])
def test_a_location_miss_or_a_failed_pull_is_recomputed_or_failed_per_kv_fallback(model_dir, fallback):
    for kv, record in [(None, True), (object(), False)]:  # the pull fails; no record in Redis
        worker, msg, client, events = asyncio.run(_admit(model_dir, _job(), kv, fallback, record))
        assert msg.calls[-1] == "ack"  # answered either way: never redelivered
        assert len(client.pulls) == (1 if record else 0)
        if fallback is KvFallback.FAIL:
            (failed,) = [e for e in events if isinstance(e, FailedEvent)]
            assert failed.status == 502 and "kv_fallback is 'fail'" in (failed.error or "")
            assert not _by_request(events) and worker.load.prefill_tokens == 0
        else:
            assert sum(map(len, _by_request(events)["r"].values())) == MAX_TOKENS - 1
            assert worker.load.prefill_tokens > 0  # recomputed here


def test_a_job_with_nothing_to_pull_is_recomputed_even_under_fail(model_dir):
    worker, _, client, events = asyncio.run(_admit(model_dir, _job(holder=None), None, KvFallback.FAIL))
    assert not client.pulls and worker.load.prefill_tokens > 0
    assert not [e for e in events if isinstance(e, FailedEvent)]


def test_n_choices_are_pulled_once_imported_once_and_forked(model_dir):
    kv, _ = _prefilled(model_dir, streamed=False)
    siblings = [Sibling("r_c1", "pd.tokens.g.r_c1", 1, [8]), Sibling("r_c2", "pd.tokens.g.r_c2", 2, [9])]
    worker, msg, client, events = asyncio.run(_admit(model_dir, _job(siblings=siblings), kv))
    tokens = _by_request(events)
    assert sorted(tokens) == ["r", "r_c1", "r_c2"] and len(client.pulls) == 1
    for rid in tokens:  # each continues after its own token 0
        assert min(tokens[rid]) == 1 and sum(map(len, tokens[rid].values())) == MAX_TOKENS - 1
    assert worker.load.prefill_tokens == 0 and msg.calls.count("ack") == 1
    taken = [e.request_id for e in events if isinstance(e, TakenEvent)]
    assert taken == ["r", "r_c1", "r_c2"]  # every choice announced as it was taken


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "handed-on-after-token-0"])
def test_token_0_is_emitted_by_decode_only_when_the_job_came_without_it(model_dir, streamed):
    kv, first = _prefilled(model_dir, streamed)
    _, _, _, events = asyncio.run(_admit(model_dir, _job(streamed=streamed), kv))
    tokens = _by_request(events)["r"]
    if streamed:
        assert tokens[0] == [first] and sum(map(len, tokens.values())) == MAX_TOKENS
    else:
        assert 0 not in tokens  # the prefill worker emitted it


def test_a_streamed_token_0_that_ends_the_request_is_all_decode_sends(model_dir):
    kv, first = _prefilled(model_dir, streamed=True)
    worker, msg, client, events = asyncio.run(_admit(model_dir, _job(streamed=True, stop_token_ids=[first]), kv))
    outputs = [e for e in events if isinstance(e, TokensEvent | FinishedEvent) and e.token_ids]
    assert [(type(e), e.seq, e.token_ids) for e in outputs] == [(FinishedEvent, 0, [first])]
    assert worker.load.prefill_tokens == 0 and worker.load.decode_tokens == 0  # never entered the engine
    assert client.recycled == [kv] and msg.calls[-1] == "ack"


def test_a_job_cancelled_during_its_pull_gives_the_kv_back_and_ends_there(model_dir):
    kv, _ = _prefilled(model_dir, streamed=False)

    class Slow(Client):
        """A pull that completes only once the test let it."""

        def __init__(self, kv) -> None:
            super().__init__(kv)
            self.go = asyncio.Event()

        async def pull(self, address: str, key: str, layout, num_tokens: int | None = None, skip_tokens: int = 0):
            await self.go.wait()
            return await super().pull(address, key, layout, num_tokens)

    async def scenario():
        settings = WorkerSettings(role=WorkerRole.DECODE, worker_id="d", engine=_engine_config(model_dir),
                                  cluster_secret=SECRET, metrics_port=None)  # fmt: skip
        worker = DecodeWorker(settings)
        client = Slow(kv)
        worker.registry = Registry({"r": _loc()})  # pyright: ignore[reportAttributeAccessIssue]
        worker.kv.client = client  # pyright: ignore[reportAttributeAccessIssue]
        worker.engine.start()
        try:
            msg = FakeMsg(_job())
            await worker.handle_job(msg)  # pyright: ignore[reportArgumentType]
            await asyncio.sleep(0.05)
            await worker.on_cancel(Cancel("r"))  # the entry is the pull's: only marked
            assert worker.ledger.get("r") is not None and worker.ledger.get("r").cancelled  # pyright: ignore[reportOptionalMemberAccess]
            client.go.set()
            for _ in range(int(TIMEOUT_S / 0.01)):
                if not worker.ledger:
                    break
                await asyncio.sleep(0.01)
            await worker.engine.call(lambda e: None)  # the snapshot after the last call
            assert not worker.ledger and msg.calls[-1] == "ack" and client.recycled == [kv]
            assert worker.load.prefill_tokens == 0 and not worker.load.requests  # never entered the engine
        finally:
            await worker.engine.stop()

    asyncio.run(scenario())


# ---- the local prefill path: a job the gateway sent to be prefilled here --------------------------------------


def _local_job(siblings=()) -> DecodeJob:
    s = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return DecodeJob("r", "demo", PROMPT, [], s, "pd.tokens.g.r", siblings=list(siblings), prefill_here=True)


def _in_order(tokens: dict[int, list[int]]) -> list[int]:
    return [t for seq in sorted(tokens) for t in tokens[seq]]


def test_a_job_to_prefill_here_is_computed_here_from_token_0_and_never_pulled(model_dir):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (reference,) = Engine.from_dir(str(model_dir), max_model_len=256).generate([PROMPT], params)
    # kv_fallback fail: a job prefilled here by choice is no lost KV
    worker, msg, client, events = asyncio.run(_admit(model_dir, _local_job(), None, KvFallback.FAIL))
    tokens = _by_request(events)["r"]
    assert min(tokens) == 0 and _in_order(tokens) == reference  # token 0 sampled here, greedy as one engine
    assert not client.pulls and worker.registry.read == []  # pyright: ignore[reportAttributeAccessIssue]
    assert worker.load.prefill_tokens == len(PROMPT) and msg.calls[-1] == "ack"
    assert not [e for e in events if isinstance(e, FailedEvent)]
    costs = worker.step_costs.costs  # its own prefill step measured its rate on prompts
    assert costs.prefill_tokens_per_s is not None and costs.decode_step_ms is not None


def test_n_choices_prefilled_here_compute_the_prompt_once(model_dir):
    siblings = [Sibling("r_c1", "pd.tokens.g.r_c1", 1), Sibling("r_c2", "pd.tokens.g.r_c2", 2)]
    worker, msg, _, events = asyncio.run(_admit(model_dir, _local_job(siblings), None))
    tokens = _by_request(events)
    assert sorted(tokens) == ["r", "r_c1", "r_c2"]
    assert {rid: len(_in_order(t)) for rid, t in tokens.items()} == dict.fromkeys(tokens, MAX_TOKENS)
    assert _in_order(tokens["r_c1"]) == _in_order(tokens["r"])  # greedy: every choice the same
    assert worker.load.prefill_tokens == len(PROMPT) and msg.calls.count("ack") == 1


def test_a_pull_is_a_sample_of_the_transfer_cost(model_dir):
    kv, _ = _prefilled(model_dir, streamed=False)
    worker, _, _, _ = asyncio.run(_admit(model_dir, _job(), kv))
    per_mb, overhead = worker.pull_costs.fitted()
    assert per_mb is not None and per_mb > 0 and overhead == 0.0  # one pull: the line through the origin
    calibration = worker.heartbeat().path_calibration
    assert calibration is not None and calibration.kv_transfer_ms_per_mb == per_mb


@pytest.mark.parametrize("pulled", [True, False])
def test_the_jobs_cache_salt_names_the_blocks_it_leaves_in_the_prefix_cache(model_dir, pulled):
    """Imported or recomputed, a request's blocks join the engine's prefix cache under its job's salt (and the
    served model's name), never unsalted: another tenant's prompt cannot hit them."""
    from shared.prefix_hash import block_hashes, root_hash

    kv = _prefilled(model_dir, streamed=False)[0] if pulled else None
    job = msgspec.structs.replace(_job(holder="p" if pulled else None), cache_salt="tenant-a")
    worker, *_ = asyncio.run(_admit(model_dir, job, kv))
    engine = worker.engine.engine
    held, size = set(engine.prefix_cache_hashes()), engine.config.block_size
    salted = block_hashes(PROMPT, size, root_hash("demo", "tenant-a"))
    assert salted and set(salted) <= held
    assert not set(block_hashes(PROMPT, size, root_hash("demo"))) & held
