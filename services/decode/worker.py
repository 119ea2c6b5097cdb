"""The decode worker: takes prefilled requests, pulls their KV from the prefill worker, decodes.

Per job: read the KV location from Redis, pull the blocks over the pair's channel (negotiated over
gRPC), import them into freshly allocated blocks, ack, and stream tokens until the request finishes.
Pulls run as tasks on the event loop while the engine thread keeps stepping the running batch. When the
KV cannot be had (no location, transfer failed), the request is recomputed from its prompt and the tokens
so far (kv_fallback `recompute`), or fails with a clear error (`fail`). A job with nothing to pull (moved
here from a worker that died) and one with no room to import its KV are always recomputed.

A layer-streamed job (`kv_streamed`: published by the prefill worker before its first token existed) carries no
first token: the pull's trailer does (`StreamedKv.first_token`), and this worker emits it to the client before
decoding on (or ends the request there when that token finished it). When the pull fails it recomputes as
above, and samples the first token itself: the client only ever sees one of the two.

A request's entry: PULLING (its KV pull in flight, owned by `_admit`) → RUNNING (in the engine) → forgotten
with its last token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgspec
from nats.aio.msg import Msg

from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.borrowed_kv import BorrowedKv, BorrowRevoked
from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.request import FinishReason
from shared.kv.rank_agents import RankPuller
from shared.kv.rank_transfer import drop_group_kv, pull_group_kv, pull_rank_kv
from shared.kv.registry import KvLocation, KvRegistry
from shared.kv.reslice import IncompatibleKv, check_compatible, group_record
from shared.kv.transfer.channel_tls import KvTls
from shared.kv.transfer.client import KvTransferClient
from shared.kv.transfer.errors import KvTransferError
from shared.kv.transfer.layer_stream import StreamedKv
from shared.messages import DecodeJob, Role, decode_subject
from shared.parallel.agents import StagedExport
from shared.parallel.group_engine import WorkerGroup
from shared.sharding.layout import LayoutError
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, StreamingWorker, error_event, sampling_params, spans
from shared.worker.choices import choice_jobs, engine_choices, import_and_fork
from shared.worker.events import streamed_first_token_event

log = logging.getLogger(__name__)
MAX_CONCURRENT_PULLS = 4


class DecodeWorker(StreamingWorker[DecodeJob]):
    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.registry: KvRegistry | None = None  # both set up once Redis is connected (setup)
        self.client: KvTransferClient | None = None

    def job_subject(self) -> str:
        return decode_subject(self.model_name)

    @property
    def _kv_group(self) -> WorkerGroup | None:
        """This worker's group when its ranks hold KV head slices (each rank pulls its own heads), else None."""
        group = self.engine.engine.worker_group
        return group if group is not None and group.layout.tp > 1 else None

    async def setup(self) -> None:
        self.registry = KvRegistry(self.conn.redis, self.settings.kv.lease_s)
        if (group := self._kv_group) is not None:  # every rank its own transfer client, pulling its own heads
            puller = RankPuller(self.settings.worker_id, self.settings.kv, self.settings.ticket_secret, self.model_name)
            await group.agents.call_all("kv.puller", dict.fromkeys(range(group.layout.tp), puller))
        self.client = KvTransferClient(
            self.settings.worker_id,
            secret=self.settings.ticket_secret,
            backend=self.settings.kv.backend,
            timeout_s=self.settings.kv.timeout_s,
            model_name=self.model_name,
            tls=KvTls.load(*self.settings.kv.tls_files),
            shared_memory=self.settings.kv.shm_bytes > 0,
        )

    async def teardown(self) -> None:
        if self.client is not None:
            await self.client.close()
        if (group := self._kv_group) is not None:
            await group.agents.call_all("kv.stop", dict.fromkeys(range(group.layout.tp)))

    def has_room(self) -> bool:
        return super().has_room() and self.ledger.count(Phase.PULLING) < MAX_CONCURRENT_PULLS

    async def handle_job(self, msg: Msg) -> None:
        entry = await self.take(msg, DecodeJob, Phase.PULLING)
        if entry is not None:
            # n > 1: every choice is announced now (this worker holds them all), and forked from one KV pull
            self.adopt(entry, choice_jobs(entry.job)[1:], Phase.PULLING)
            asyncio.create_task(self._admit_traced(entry))

    async def _admit_traced(self, entry: Entry[DecodeJob]) -> None:
        with tracing.use_span(entry.span):  # the pull's span and log lines join the request's trace
            await self._admit(entry)
        spans.end_once(entry.span)

    async def _admit(self, entry: Entry[DecodeJob]) -> None:
        assert self.client is not None  # set up (setup) before any job is taken
        job, key, span = entry.job, entry.key, entry.span
        staged: StagedExport | None = None  # KV each rank of this group staged, until imported
        try:
            # the prefill worker reported the prompt's logprobs: a recomputation here need not score it again
            params = dataclasses.replace(sampling_params(job.sampling), prompt_logprobs=None)
            kv, failure = await self._pull(job)
            if isinstance(kv, StagedExport):  # each rank staged its heads: imported on every rank, or dropped
                staged = kv
            if job.kv_streamed and kv is not None and not isinstance(kv, StreamedKv):  # no first token came with it
                kv, failure = None, "the streamed KV came without its first token"  # recomputed (or failed)
            group = self._choices(entry)
            if entry.cancelled:  # during the pull (the gateway cancels a group's choices together)
                for e in group:
                    self.ledger.finish(e.key)
                return
            if failure is not None and self.settings.kv.fallback == "fail":
                self._fail_unpulled(group, failure, span)
                return
            prompt, outputs, jobs = job.prompt_token_ids, job.output_token_ids, [e.job for e in group]
            if job.kv_streamed and isinstance(kv, StreamedKv):  # its first token came with the KV: emitted here
                outputs = [*outputs, kv.first_token]
                jobs = [msgspec.structs.replace(job, output_token_ids=outputs)]  # streamed jobs have one choice
                end = first_token_end(self.engine.engine, job, outputs)
                first = streamed_first_token_event(job, kv.first_token, end, self.settings.worker_id)
                self.emit(job.reply_subject, first)
                metrics.GENERATION_TOKENS.labels(*self.labels).inc()  # emitted here, so counted here (not by prefill)
                if end is not None:  # that token finished it: nothing to decode
                    self.client.recycle(kv)
                    self.ledger.finish(key)
                    span.set_attribute(tracing.KV_OUTCOME, "pulled")
                    return
            choices = engine_choices(jobs, [sampling_params(j.sampling) for j in jobs])
            # Running before the engine sees it: its first outputs may reach the loop before this resumes.
            for e in group:
                e.phase = Phase.RUNNING
                self.start_decode_span(e, span)
            try:
                if kv is None:
                    raise NoFreeBlocksError("no KV to import")
                done = await self.engine.call(lambda e: import_and_fork(e, key, prompt, outputs, params, kv, choices))
                staged = None  # written into the blocks on every rank (the import_staged op)
                self.handle_outputs(done)
                if not isinstance(kv, StagedExport):
                    self.client.recycle(kv)  # its receive buffer serves the next pull (no fresh page faults)
                span.set_attribute(tracing.KV_OUTCOME, "pulled")
            except (NoFreeBlocksError, BorrowRevoked) as exc:
                if isinstance(kv, BorrowedKv):
                    self.client.recycle(kv)  # given back (a revoked loan: to a connection that is over already)
                if isinstance(exc, BorrowRevoked):  # the prefill worker took the blocks back: a failed pull
                    log.warning("the KV of %s was taken back before it was copied (%s)", key, exc)
                    if self.settings.kv.fallback == "fail":
                        self._fail_unpulled(group, str(exc), span)
                        return
                await self.engine.call(lambda e: e.add_group(prompt, choices))
                span.set_attribute(tracing.KV_OUTCOME, "recompute")
                metrics.PROMPT_TOKENS.labels(*self.labels).inc(len(prompt) * len(choices))  # computed here, each
            await self.ledger.ack(key)
        except Exception as exc:  # ValueError: the job was refused; anything else: a bug, answered as such
            for e in self._choices(entry):
                await self.fail(e, exc)
        finally:
            if staged is not None and (kv_group := self._kv_group) is not None:  # pulled, not imported: dropped
                await drop_group_kv(kv_group.agents, kv_group.layout.tp, staged.key)

    def _fail_unpulled(self, group: list[Entry[DecodeJob]], failure: str, span) -> None:
        """kv_fallback 'fail': answer the group's choices with an error, since their KV could not be had."""
        message = f"the request's KV could not be had ({failure}) and kv_fallback is 'fail'"
        for e in group:
            self.emit(e.reply_subject, error_event(e.job, message, self.settings.worker_id, status=502))
            self.ledger.finish(e.key)  # answered: the job is done
        span.set_attribute(tracing.KV_OUTCOME, "failed")

    def _choices(self, entry: Entry[DecodeJob]) -> list[Entry[DecodeJob]]:
        """The entry and those of its group's other choices still in hand (a cancelled one is left out)."""
        group = [entry]
        for job in choice_jobs(entry.job)[1:]:
            sibling = self.ledger.get(job.key)
            if sibling is not None and sibling.cancelled:  # cancelled during the pull: done here
                self.ledger.finish(job.key)
            elif sibling is not None:
                group.append(sibling)
        return group

    async def _pull(self, job: DecodeJob) -> tuple[KVExport | None, str | None]:
        """The job's KV from the prefill worker that holds it, or None and why it could not be had; (None, None)
        when there is nothing to pull."""
        assert self.registry is not None and self.client is not None  # set up (setup) before any job is taken
        if job.prefill_worker is None:
            return None, None
        key = job.kv_key or job.key  # a group's KV is held under its first choice's key
        try:
            loc = await self.registry.get(key)
        except Exception as exc:  # Redis unreachable: the KV cannot be found
            log.warning("reading the KV location of %s failed (%s)", key, exc)
            return None, f"reading its location failed: {exc}"
        if loc is None:
            log.warning("no KV location for %s (lease expired?)", key)
            return None, f"no KV location (prefill worker {job.prefill_worker} freed it, or its lease expired)"
        if (group := self._kv_group) is not None:
            return await self._pull_group(group, key, loc)
        try:
            if loc.group is not None:  # a prefill group: its ranks' heads, rank by rank, assembled here
                kv = await pull_rank_kv(self.client, loc.group, key, self.engine.engine.layout, 1, 0)
            else:
                # The location's token count lets the receives be posted before the Pull (kv/transfer/posted.py);
                # a streamed KV is not sent into them (its trailer follows the layers).
                expected = None if job.kv_streamed else loc.num_tokens
                kv = await self.client.pull(loc.rpc_address, key, self.engine.engine.layout, num_tokens=expected)
            return kv, None
        except KvTransferError as exc:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, exc)
            return None, f"pulling it from {loc.worker_id} failed: {exc}"

    async def _pull_group(self, group: WorkerGroup, key: str, loc: KvLocation) -> tuple[KVExport | None, str | None]:
        """Every rank of this group pulls its own KV heads from the prefill rank(s) holding them (the leader's
        plan, reslice.plan_pulls), all at once, and stages them; → the leader's reference to the staged KV,
        which the import writes on every rank. A single prefill worker is a group of one rank (tp 1)."""
        model = dataclasses.replace(self.engine.engine.layout, kv_heads=())
        record = loc.group or group_record(model, 1, [loc.rpc_address])
        try:
            check_compatible(record, model, group.layout.tp)
        except (IncompatibleKv, LayoutError) as exc:
            log.warning("the KV of %s cannot be pulled from %s: %s", key, loc.worker_id, exc)
            return None, f"incompatible KV at {loc.worker_id}: {exc}"
        failure = await pull_group_kv(group.agents, group.layout.tp, key, record)
        if failure is not None:
            log.warning("KV pull of %s from %s failed (%s)", key, loc.worker_id, failure)
            return None, f"pulling it from {loc.worker_id} failed: {failure}"
        return group.ops.state.staged.ref(key), None


def first_token_end(engine: Engine, job: DecodeJob, outputs: list[int]) -> FinishReason | None:
    """Whether a layer-streamed job's first token (the last of `outputs`) ends it, as the prefill engine's
    scheduler decided (Scheduler._finish_reason): a stop token or EOS, max_tokens, or the model's length."""
    s, token, scheduler = job.sampling, outputs[-1], engine.scheduler
    if token in s.stop_token_ids or (not s.ignore_eos and token in scheduler.eos_token_ids):
        return FinishReason.STOP
    if len(outputs) >= s.max_tokens or len(job.prompt_token_ids) + len(outputs) >= engine.max_model_len:
        return FinishReason.LENGTH
    return None
