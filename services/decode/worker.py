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
from shared.kv.decode_kv import DecodeKv
from shared.kv.registry import KvRegistry
from shared.kv.transfer.layer_stream import StreamedKv
from shared.messages import DecodeJob, Role, decode_subject
from shared.ranklink.agents import StagedExport
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, StreamingWorker, error_event, sampling_params, spans
from shared.worker.choices import choice_jobs, engine_choices, import_and_fork
from shared.worker.events import streamed_first_token_event
from shared.worker.kv_ranks import kv_ranks

log = logging.getLogger(__name__)
MAX_CONCURRENT_PULLS = 4


class DecodeWorker(StreamingWorker[DecodeJob]):
    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.registry: KvRegistry | None = None  # set up once Redis is connected (setup)
        # the pulls of this worker's ranks (one, or a group's: each its own heads), started in setup
        self.kv = DecodeKv(self.settings.kv, self.settings.worker_id, self.engine.engine.layout,
                           secret=self.settings.ticket_secret, model_name=self.model_name,
                           ranks=kv_ranks(self.group))  # fmt: skip

    def job_subject(self) -> str:
        return decode_subject(self.model_name)

    async def setup(self) -> None:
        self.registry = KvRegistry(self.conn.redis, self.settings.kv.lease_s)
        await self.kv.start()

    async def teardown(self) -> None:
        await self.kv.close()

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
                    self.kv.recycle(kv)
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
                self.kv.recycle(kv)  # its receive buffer serves the next pull (no fresh page faults)
                span.set_attribute(tracing.KV_OUTCOME, "pulled")
            except (NoFreeBlocksError, BorrowRevoked) as exc:
                if isinstance(kv, BorrowedKv):
                    self.kv.recycle(kv)  # given back (a revoked loan: to a connection that is over already)
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
            if staged is not None:  # pulled, not imported: dropped
                await self.kv.drop(staged)

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
        assert self.registry is not None  # set up (setup) before any job is taken
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
        return await self.kv.pull(key, loc, streamed=job.kv_streamed)


def first_token_end(engine: Engine, job: DecodeJob, outputs: list[int]) -> FinishReason | None:
    """Whether a layer-streamed job's first token (the last of `outputs`) ends it, as the prefill engine's
    scheduler decided (Scheduler._finish_reason): a stop token or EOS, max_tokens, or the model's length."""
    s, token, scheduler = job.sampling, outputs[-1], engine.scheduler
    if token in s.stop_token_ids or (not s.ignore_eos and token in scheduler.eos_token_ids):
        return FinishReason.STOP
    if len(outputs) >= s.max_tokens or len(job.prompt_token_ids) + len(outputs) >= engine.max_model_len:
        return FinishReason.LENGTH
    return None
