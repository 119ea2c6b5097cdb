"""The worker runtime without NATS: the job ledger with fake messages, the cancel memory, and a worker built on
the tiny demo engine — admission from the engine-load snapshot, the capacity gate of the job loop, the one
cancel path and the one failure path."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
from opentelemetry.trace import INVALID_SPAN, Span

from services.mixed.worker import MixedWorker
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.messages import Cancel, FailedEvent, PrefillJob, Sampling, Sibling, TakenEvent, TokenEvent
from shared.settings import WorkerSettings
from shared.worker import JobLedger, Phase, sampling_params
from shared.worker.cancels import CancelMemory
from tests.job_msg import FakeMsg


def job(rid: str = "r", attempt: int = 0, prompt: tuple[int, ...] = (1, 2, 3), max_tokens: int = 50) -> PrefillJob:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return PrefillJob(rid, "demo", list(prompt), sampling, f"pd.tokens.g.{rid}", attempt=attempt)


def run(coro):
    return asyncio.run(coro)


class OpenSpan:
    """JobLedger.take's `open_span`: counts the process spans opened (a no-op span each)."""

    def __init__(self) -> None:
        self.opened = 0

    def __call__(self) -> Span:
        self.opened += 1
        return INVALID_SPAN


# ---- ledger ---------------------------------------------------------------------------------------------------


def test_take_registers_a_job_and_reports_it_in_progress_until_acked():
    async def scenario():
        ledger, msg, opened = JobLedger(CancelMemory()), FakeMsg(), OpenSpan()
        entry = await ledger.take(msg, job(), Phase.PREFILLING, opened)
        assert entry is not None and entry.phase is Phase.PREFILLING and ledger.get("r") is entry
        assert entry.span is INVALID_SPAN and opened.opened == 1  # its process span, opened with the entry
        assert ledger.in_progress() == [msg] and msg.calls == []
        await ledger.ack("r")
        assert msg.calls == ["ack"] and ledger.in_progress() == [] and len(ledger) == 1  # acked, still in hand

    run(scenario())


def test_a_redelivery_in_hand_replaces_the_message_and_a_copy_of_an_acked_one_is_acked():
    async def scenario():
        ledger, first, second, third = JobLedger(CancelMemory()), FakeMsg(), FakeMsg(), FakeMsg()
        opened = OpenSpan()
        entry = await ledger.take(first, job(), Phase.PULLING, opened)
        assert await ledger.take(second, job(), Phase.PULLING, opened) is None
        assert entry.msg is second and first.calls == [] and second.calls == []  # the newer one is settled
        await ledger.ack("r")
        assert second.calls == ["ack"] and first.calls == []
        assert await ledger.take(third, job(), Phase.PULLING, opened) is None  # runs here, acked: the copy is done
        assert third.calls == ["ack"] and ledger.get("r") is entry
        assert opened.opened == 1  # no span for a copy: nothing would end it

    run(scenario())


def test_cancelled_attempts_and_jobs_the_engine_runs_already_are_acked_and_dropped():
    async def scenario():
        cancels = CancelMemory()
        ledger = JobLedger(cancels)
        cancels.remember(Cancel("r", up_to_attempt=1))
        old, new, running, opened = FakeMsg(), FakeMsg(), FakeMsg(), OpenSpan()
        assert await ledger.take(old, job(attempt=1), Phase.PREFILLING, opened) is None and old.calls == ["ack"]
        assert await ledger.take(new, job(attempt=2), Phase.PREFILLING, opened) is not None and new.calls == []
        assert await ledger.take(running, job("s"), Phase.PREFILLING, opened, in_engine=True) is None
        assert running.calls == ["ack"] and ledger.get("s") is None
        assert opened.opened == 1  # only the job taken has a span

    run(scenario())


def test_term_finish_and_forget_end_an_entry():
    async def scenario():
        ledger = JobLedger(CancelMemory())
        a, b, c, opened = FakeMsg(), FakeMsg(), FakeMsg(), OpenSpan()
        await ledger.take(a, job("a"), Phase.PREFILLING, opened)
        await ledger.take(b, job("b"), Phase.RUNNING, opened)
        await ledger.take(c, job("c"), Phase.RUNNING, opened)
        assert (await ledger.term("a")).job.request_id == "a" and a.calls == ["term"]
        assert ledger.finish("b") is not None and ledger.get("b") is None
        await asyncio.sleep(0)  # the ack of a finished job is settled in a task
        assert b.calls == ["ack"]
        ledger.forget_message(c)
        assert len(ledger) == 0 and c.calls == [] and ledger.in_progress() == []

    run(scenario())


def test_covered_by_selects_the_request_and_the_attempts_a_cancel_covers():
    async def scenario():
        ledger = JobLedger(CancelMemory())
        for rid, attempt in (("r", 0), ("r", 1), ("r", 2), ("other", 0)):
            await ledger.take(FakeMsg(), job(rid, attempt), Phase.RUNNING, OpenSpan())
        assert sorted(e.key for e in ledger.covered_by(Cancel("r", up_to_attempt=1))) == ["r", "r~1"]
        assert sorted(e.key for e in ledger.covered_by(Cancel("r"))) == ["r", "r~1", "r~2"]
        assert ledger.covered_by(Cancel("nobody")) == []
        assert ledger.count(Phase.RUNNING) == 4 and ledger.count(Phase.PULLING) == 0

    run(scenario())


def test_cancel_memory_widens_and_is_bounded_by_count_and_age():
    memory = CancelMemory(memory_s=10.0, max_count=2)
    memory.remember(Cancel("r", up_to_attempt=3), now=0.0)
    memory.remember(Cancel("r", up_to_attempt=1), now=1.0)  # never narrows
    assert memory.is_cancelled("r", 3) and not memory.is_cancelled("r", 4)
    memory.remember(Cancel("r"), now=2.0)
    assert memory.is_cancelled("r", 99)
    memory.remember(Cancel("a"), now=3.0)
    memory.remember(Cancel("b"), now=4.0)  # three remembered > 2: the oldest ("r") goes
    assert not memory.is_cancelled("r", 0) and memory.is_cancelled("a", 0) and len(memory) == 2
    memory.remember(Cancel("c"), now=13.5)  # "a" is older than 10 s now
    assert not memory.is_cancelled("a", 0) and memory.is_cancelled("c", 0)


# ---- a worker on the tiny engine ------------------------------------------------------------------------------


@pytest.fixture
def worker(model_dir):
    config = EngineConfig(
        str(model_dir), max_model_len=256, num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    return MixedWorker(WorkerSettings(engine=config, worker_id="w1", metrics_port=None), engine=Engine.build(config))


def test_connections_are_there_only_once_run_made_them(worker):
    with pytest.raises(RuntimeError, match="the mixed worker is not connected: run"):
        _ = worker.conn
    worker.stop()  # before run(): nothing to drain, it stops at once
    assert worker.stopping.is_set() and not worker.draining


def test_has_room_answers_from_the_load_snapshot(worker):
    assert worker.has_room()
    full = worker.load
    worker.load = dataclasses.replace(full, running=full.max_num_seqs)
    assert not worker.has_room()
    worker.load = dataclasses.replace(full, free_blocks=0)
    assert not worker.has_room()
    worker.load = dataclasses.replace(full, waiting_tokens=full.max_num_batched_tokens)
    assert not worker.has_room()


def test_the_engine_thread_publishes_a_snapshot_before_a_call_returns(worker):
    async def scenario():
        worker.engine.start()
        try:
            assert worker.load.requests == frozenset()  # the snapshot taken at construction
            params = sampling_params(job().sampling)
            await worker.engine.call(lambda e: e.add_request("x", [1, 2, 3], params))
            assert "x" in worker.load.requests  # published on the engine thread before the call's result
            await worker.engine.call(lambda e: e.abort("x"))
            assert "x" not in worker.load.requests and worker.load.free_blocks == worker.load.total_blocks
        finally:
            await worker.engine.stop()

    run(scenario())


class FakeConsumer:
    def __init__(self) -> None:
        self.fetches = 0

    async def fetch(self, batch: int, timeout: float) -> list:
        self.fetches += 1
        await asyncio.sleep(0.01)
        return []


def test_a_worker_with_no_room_fetches_no_job(worker):
    async def scenario():
        consumer = FakeConsumer()
        room = worker.load
        worker.load = dataclasses.replace(room, running=room.max_num_seqs)  # no sequence slot left
        loop = asyncio.create_task(worker.fetch_jobs(consumer))
        await asyncio.sleep(0.2)
        assert consumer.fetches == 0
        worker.load = room  # room again: it fetches
        for _ in range(100):
            if consumer.fetches:
                break
            await asyncio.sleep(0.01)
        assert consumer.fetches > 0
        worker.stopping.set()
        await asyncio.wait_for(loop, 5)

    run(scenario())


class ScriptedConsumer:
    """A consumer whose fetches return the given batches in turn, then nothing (each after `delay_s`)."""

    def __init__(self, *batches: list, delay_s: float = 0.01) -> None:
        self.batches, self.delay_s, self.fetches = list(batches), delay_s, 0

    async def fetch(self, batch: int, timeout: float) -> list:
        self.fetches += 1
        await asyncio.sleep(self.delay_s)
        return self.batches.pop(0) if self.batches else []


def test_a_worker_fetches_its_own_queue_and_the_shared_one_at_once_its_own_first(worker):
    async def scenario():
        handled = []

        async def handle(msg) -> None:
            handled.append(msg.subject)

        worker.handle_job = handle
        own = ScriptedConsumer([FakeMsg(job("a"), subject="pd.jobs.prefill.demo.w")])
        shared = ScriptedConsumer([FakeMsg(job("b"))])  # both come back in the same round
        loop = asyncio.create_task(worker.fetch_jobs(own, shared))
        for _ in range(200):
            if len(handled) == 2:
                break
            await asyncio.sleep(0.01)
        assert handled == ["pd.jobs.prefill.demo.w", "pd.jobs.prefill.demo"]
        # a slow shared fetch does not hold up the own queue's: a fetch is in flight on each
        worker.stopping.set()
        await asyncio.wait_for(loop, 5)
        worker.stopping.clear()
        handled.clear()
        slow = ScriptedConsumer(delay_s=0.5)
        own.batches = [[FakeMsg(job("c"), subject="pd.jobs.prefill.demo.w")]]
        loop = asyncio.create_task(worker.fetch_jobs(own, slow))
        await asyncio.sleep(0.2)
        assert handled == ["pd.jobs.prefill.demo.w"] and slow.fetches == 1
        worker.stopping.set()
        await asyncio.wait_for(loop, 5)

    run(scenario())


def _events(worker) -> list[TokenEvent]:
    events = []
    while not worker.outbox.empty():
        events.append(worker.outbox.queue.get_nowait()[1])
    return events


def test_a_cancel_drops_the_job_in_hand_everywhere(worker):
    async def scenario():
        worker.engine.start()
        try:
            msg = FakeMsg(job(max_tokens=200))
            await worker.handle_job(msg)
            assert msg.calls == ["ack"] and worker.ledger.get("r") is not None  # in the engine, streaming
            assert [type(e) for e in _events(worker)][:1] == [TakenEvent]  # announced
            await worker.on_cancel(Cancel("r"))
            assert worker.ledger.get("r") is None and worker.cancels.is_cancelled("r", 0)
            await worker.engine.call(lambda e: None)  # the snapshot after the abort
            assert "r" not in worker.load.requests and worker.load.free_blocks == worker.load.total_blocks
            late = FakeMsg(job(max_tokens=200))  # a redelivery of the cancelled attempt: acked, not run
            await worker.handle_job(late)
            assert late.calls == ["ack"] and len(worker.ledger) == 0
        finally:
            await worker.engine.stop()

    run(scenario())


@pytest.mark.parametrize("error, status", [(ValueError("refused"), 400), (RuntimeError("a bug"), 500)])
def test_a_job_the_engine_refuses_is_answered_and_terminated(worker, error, status):
    async def scenario():
        def refuse(*args, **kwargs):
            raise error

        worker.engine.engine.add_request = refuse
        worker.engine.start()
        try:
            msg = FakeMsg(job())
            await worker.handle_job(msg)
            assert msg.calls == ["term"] and len(worker.ledger) == 0
            *_, last = _events(worker)
            assert isinstance(last, FailedEvent)
            assert last.finish_reason == "error" and last.status == status
            assert str(error) in last.error
        finally:
            await worker.engine.stop()

    run(scenario())


def test_a_job_of_n_choices_is_split_once_as_it_is_taken(worker):
    """Worker.take_choices: one entry per choice, the job's own first (its job that choice alone), the others
    holding no message and sharing its span; a choice cancelled before it came is left out; each is announced."""

    async def scenario():
        worker.cancels.remember(Cancel("r_c2"))
        siblings = [Sibling(f"r_c{i}", f"pd.tokens.g.r_c{i}", i) for i in (1, 2, 3)]
        msg = FakeMsg(msgspec.structs.replace(job(), siblings=siblings))
        entries = await worker.take_choices(msg, PrefillJob, Phase.PREFILLING)  # pyright: ignore[reportArgumentType]
        assert [e.key for e in entries] == ["r", "r_c1", "r_c3"]
        head, *others = entries
        assert head.job.siblings == [] and head.msg is msg and head.group_key is None
        assert all(e.msg is None and e.span is head.span and e.group_key == "r" for e in others)
        assert [e.job.sampling.seed for e in others] == [1, 3]
        assert [e.request_id for e in _events(worker)] == ["r", "r_c1", "r_c3"]  # announced, in choice order
        assert await worker.take_choices(FakeMsg(job("r")), PrefillJob, Phase.PREFILLING) == []  # pyright: ignore[reportArgumentType]

    run(scenario())
