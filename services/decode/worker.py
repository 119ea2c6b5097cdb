"""The decode worker: takes prefilled requests, pulls their KV from the prefill worker, decodes.

Admission is a pipeline, one stage a module, run per job as a task on the event loop while the engine thread
keeps stepping the running batch:

    locate (locate.py: the Redis record) → the cached prefix (cached_prefix.py: this engine's own prefix cache
    pins what it holds of the prompt, decode-side reuse) → pull (DecodeKv, shared/kv/decode_kv.py: ONE call into the KV
    plane, for this worker's R ranks, any transport) → token 0 (first_token.py: a layer-streamed job's, from
    the pull's trailer) → into the engine with the fork for n choices (into_engine.py) → ack; then every token
    streams back (StreamingWorker).

A stage that cannot have the KV says why (`Missing`); the request is then recomputed from its prompt and its
tokens so far (kv_fallback `recompute`), or failed with a clear error (`fail`). A job with nothing to pull
(moved here from a worker that died) and one with no room to import its KV are always recomputed. A job the
gateway sent here before any prefill (`prefill_here`: the local prefill path, docs/architecture.md) takes the same
road on purpose: its prompt is computed in this engine, which samples its first token and decodes on.

A job of n choices is split once, as it is taken (Worker.take_choices): one ledger entry per choice, the KV
pulled once and imported once, the other choices forked from it. A request's entry: PULLING (owned by the
admission task) → RUNNING (in the engine) → forgotten with its last token; a job prefilled here is PREFILLING in the
engine until its first token (its prefill recorded then, as the mixed worker records one).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from services.decode import cached_prefix
from services.decode.first_token import first_token_end, owes_first_token, with_first_token
from services.decode.into_engine import import_choices, recompute_choices
from services.decode.locate import Missing, kv_key, locate
from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.borrowed_kv import BorrowRevoked
from shared.engine.engine import RequestOutput
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport
from shared.kv.decode_kv import DecodeKv
from shared.kv.registry import KvRegistry
from shared.kv.transfer.layer_stream import StreamedKv
from shared.messages import DecodeJob, Role, decode_subject, routed_decode_subject
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, StreamingWorker, error_event, sampling_params, spans
from shared.worker.choices import engine_choices
from shared.worker.events import streamed_first_token_event
from shared.worker.kv_ranks import kv_ranks

__all__ = ["DecodeWorker", "first_token_end"]

log = logging.getLogger(__name__)
MAX_CONCURRENT_PULLS = 4


class DecodeWorker(StreamingWorker[DecodeJob]):
    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.registry: KvRegistry | None = None  # set up once Redis is connected (setup)
        # the pull stage: this worker's one way into the KV plane (a group's ranks each pull their own heads)
        self.kv = DecodeKv(self.settings.kv, self.settings.worker_id, self.engine.engine.layout,
                           secret=self.settings.ticket_secret, model_name=self.model_name,
                           ranks=kv_ranks(self.group))  # fmt: skip

    def job_subject(self) -> str:
        return decode_subject(self.model_name)

    def own_job_subject(self) -> str:
        """Decode jobs routed here for the prompt this worker's cache holds (decode-side reuse): fetched beside the
        shared queue's, handed back to it on a drain (runtime.py); its blocks are announced like a prefill's."""
        return routed_decode_subject(self.model_name, self.settings.worker_id)

    async def setup(self) -> None:
        self.registry = KvRegistry(self.conn.redis, self.settings.kv.lease_s)
        await self.kv.start()

    async def teardown(self) -> None:
        await self.kv.close()

    def has_room(self) -> bool:
        return super().has_room() and self.ledger.count(Phase.PULLING) < MAX_CONCURRENT_PULLS

    async def handle_job(self, msg: Msg) -> None:
        # n > 1: every choice is announced now (this worker holds them all), and forked from one KV pull
        entries = await self.take_choices(msg, DecodeJob, Phase.PULLING)
        if entries:
            asyncio.create_task(self._admit_traced(entries))

    async def _admit_traced(self, entries: list[Entry[DecodeJob]]) -> None:
        head = entries[0]
        with tracing.use_span(head.span):  # the pull's span and log lines join the request's trace
            await self._admit(entries)
        spans.end_once(head.span)

    async def _admit(self, entries: list[Entry[DecodeJob]]) -> None:
        """The pipeline for one job's choices (`entries`, the job's own first). Anything raised is a bug (or the
        engine refusing the job: ValueError) and fails every choice still in hand."""
        head = entries[0]
        kv: KVExport | None = None  # pulled and not yet in the engine: given up on the way out
        key, cached = kv_key(head.job), 0  # cached: prompt tokens pinned in this engine (a partial pull)
        try:
            if cached_prefix.may_reuse(head.job, self.kv.ranks is None):
                cached = await cached_prefix.pin(self.engine, key, head.job)
            got = await self._fetch(head.job, cached)
            kv = None if isinstance(got, Missing) else got
            entries = self._in_hand(entries)
            if head.cancelled:  # during the pull (the gateway cancels a group's choices together)
                for e in entries:
                    self.ledger.finish(e.key)
                return
            if isinstance(got, Missing) and got.may_fail and self.settings.kv.fallback == "fail":
                self._fail_unpulled(entries, got.reason, head)
                return
            jobs = [e.job for e in entries]
            if isinstance(kv, StreamedKv) and owes_first_token(head.job):  # token 0 came with the KV: out now
                jobs = [with_first_token(head.job, kv.first_token)]  # streamed jobs have one choice
                if self._emit_first_token(head.job, jobs[0]):  # that token finished it: nothing to decode
                    self.ledger.finish(head.key)
                    head.span.set_attribute(tracing.KV_OUTCOME, "pulled")
                    return
            choices = engine_choices(jobs, [sampling_params(j.sampling) for j in jobs])
            for e in entries:  # in the engine before it sees them: their first outputs may come before we resume
                if head.job.prefill_here:  # computed here: prefilling until its first token (on_output)
                    e.phase = Phase.PREFILLING
                else:
                    e.phase = Phase.RUNNING
                    self.start_decode_span(e, head.span)
            owned, kv = kv, None  # the next stage owns it
            pinned = key if cached else None
            outcome = await self._into_engine(entries, head.job.prompt_token_ids, choices, owned, pinned)
            if outcome is not None:
                head.span.set_attribute(tracing.KV_OUTCOME, outcome)
                await self.ledger.ack(head.key)
        except Exception as exc:  # ValueError: the job was refused; anything else: a bug, answered as such
            for e in self._in_hand(entries):
                await self.fail(e, exc)
        finally:
            if kv is not None:  # pulled, not imported: its buffer, loan or staged copies given back
                await self._give_up(kv)
            if cached:  # not imported behind its pinned prefix (the import takes the pin): given back
                await cached_prefix.unpin(self.engine, key)

    async def _fetch(self, job: DecodeJob, cached: int = 0) -> KVExport | Missing:
        """Locate, then pull (from token `cached` on: the rest of what this engine holds pinned): the job's KV here,
        or why not. A completed pull (not layer-streamed: that one waits
        for the prefill's forward) is a sample of this worker's transfer cost (shared/worker/calibration.py)."""
        assert self.registry is not None  # set up (setup) before any job is taken
        if job.prefill_here:  # the local prefill path: nothing was prefilled or held for it
            return Missing("the gateway sent it to be prefilled here", may_fail=False)
        loc = await locate(self.registry, job)
        if isinstance(loc, Missing):
            return loc
        started = time.perf_counter()
        kv, failure = await self.kv.pull(kv_key(job), loc, streamed=job.kv_streamed, skip_tokens=cached)
        if kv is None:
            return Missing(failure or "the pull brought no KV")
        if cached and not cached_prefix.fits_behind(kv, self.engine.engine.layout.block_size):
            await self._give_up(kv)  # cut inside one of our blocks: recomputed, mostly from the cache
            return Missing("the pulled KV starts inside a cached block", may_fail=False)
        if not job.kv_streamed:
            self.pull_costs.observe(kv.nbytes, time.perf_counter() - started)
        if owes_first_token(job) and not isinstance(kv, StreamedKv):  # no first token came with it
            await self._give_up(kv)
            return Missing("the streamed KV came without its first token")
        return kv

    async def _give_up(self, kv: KVExport) -> None:
        """A pulled KV that will not be imported (cancelled, no room, or its first token ended the request): its
        buffer or loan given back (a loan to a connection that is over already too), a group's staged copies
        dropped."""
        self.kv.recycle(kv)
        await self.kv.drop(kv)

    def _emit_first_token(self, job: DecodeJob, going_on: DecodeJob) -> bool:
        """Emit (and count) a streamed job's token 0, the last of `going_on`'s outputs; whether it ended it."""
        outputs = going_on.output_token_ids
        end = first_token_end(self.engine.engine, job, outputs)
        self.emit(job.reply_subject, streamed_first_token_event(job, outputs[-1], end, self.settings.worker_id))
        metrics.GENERATION_TOKENS.labels(*self.labels).inc()  # emitted here, so counted here (not by prefill)
        return end is not None

    async def _into_engine(
        self,
        entries: list[Entry[DecodeJob]],
        prompt: list[int],
        choices: list[Choice],
        kv: KVExport | None,
        pinned: str | None = None,
    ) -> str | None:
        """The choices into the engine: `kv` imported and the other choices forked from it, or, without it or
        without room for it, the prompt recomputed (or, on the local path, computed here for the first time). Owns
        `kv` (imported or given back). → the KV outcome ("pulled" | "recompute" | "local"), or None when the request
        was answered with an error instead (a loan revoked under kv_fallback `fail`). `pinned`: the key of the
        prompt's cached blocks the pulled KV goes behind (cached_prefix.py)."""
        head = entries[0]
        if kv is not None:
            try:
                done = await import_choices(self.engine, prompt, kv, choices, head.job.cache_salt, pinned)
            except (NoFreeBlocksError, BorrowRevoked) as exc:
                await self._give_up(kv)  # given back (a revoked loan: to a connection that is over already)
                if isinstance(exc, BorrowRevoked):  # the prefill worker took the blocks back: a failed pull
                    log.warning("the KV of %s was taken back before it was copied (%s)", head.key, exc)
                    if self.settings.kv.fallback == "fail":
                        self._fail_unpulled(entries, str(exc), head)
                        return None
            except BaseException:
                await self._give_up(kv)
                raise
            else:
                if pinned is not None:  # the blocks in front came from this worker's cache, not the wire
                    skipped = cached_prefix.skipped_blocks(kv, self.engine.engine.layout.block_size)
                    metrics.KV_SKIPPED_BLOCKS.labels(*self.labels).inc(skipped)
                self.kv.recycle(kv)  # imported: its receive buffer serves the next pull
                self.handle_outputs(done)
                return "pulled"
        await recompute_choices(self.engine, prompt, choices, head.job.cache_salt)
        if head.job.prefill_here:  # its prefill is recorded (spans, metrics) at its first token: on_output
            return "local"
        metrics.PROMPT_TOKENS.labels(*self.labels).inc(len(prompt) * len(choices))  # computed here, each
        return "recompute"

    def on_output(self, entry: Entry[DecodeJob], out: RequestOutput) -> None:
        if entry.phase is Phase.PREFILLING:  # a job prefilled here (the local path): its first output
            entry.phase = Phase.RUNNING
            if entry.group_key is None:  # a group's prompt is computed once, by its first choice
                spans.record_prefill(entry.job, out, entry.span, self.labels)
            self.start_decode_span(entry, entry.span, time.time())

    def _fail_unpulled(self, entries: list[Entry[DecodeJob]], failure: str, head: Entry[DecodeJob]) -> None:
        """kv_fallback 'fail': answer the choices with an error, since their KV could not be had."""
        message = f"the request's KV could not be had ({failure}) and kv_fallback is 'fail'"
        for e in entries:
            self.emit(e.reply_subject, error_event(e.job, message, self.settings.worker_id, status=502))
            self.ledger.finish(e.key)  # answered: the job is done
        head.span.set_attribute(tracing.KV_OUTCOME, "failed")

    def _in_hand(self, entries: list[Entry[DecodeJob]]) -> list[Entry[DecodeJob]]:
        """The job's own entry and its other choices still in hand (one cancelled meanwhile is done here)."""
        head, *others = entries
        kept = [head]
        for e in others:
            if self.ledger.get(e.key) is not e:
                continue
            if e.cancelled:
                self.ledger.finish(e.key)
            else:
                kept.append(e)
        return kept
