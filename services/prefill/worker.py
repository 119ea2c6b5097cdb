"""The prefill worker: runs prompts to their first token, keeps the KV under a lease, hands off to decode.

Per job: announce it (this worker holds the request), add the prompt with max_tokens=1 and hold_kv →
first token → publish it (TTFT), hold the KV (HeldKv: its Redis location and lease), publish the decode job,
ack the prefill job, tell the gateway the request is queued for decode. The blocks stay pinned until a decode
worker's pull completes, the lease expires or the attempt is cancelled: HeldKv (shared/kv/held.py) owns them
from the hold on (held → sending → freed), for every rank of this worker (shared/kv/prefill_kv.py). Everything
inside the worker is keyed by the job's attempt key (engine request, held KV, Redis entry). A job's ledger
entry: PREFILLING (in the engine) → HANDING_ON (first token out; `_hand_off` owns it) → forgotten once the
decode job is published and the prefill job acked.

Layer-streamed (kv_stream_layers, docs/kv_transfer.md): a job that can stream (`_streams_kv`) is watched, and
its hand-on starts when its last chunk does, before the first token exists: HANDING_ON from then, the KV held
and the decode job published (`kv_streamed`, without the first token) while the forward runs, so the pull
overlaps it. The first token reaches decode as the pull's trailer and the client from the decode worker: this
worker records its prefill (the span, queue time, prompt tokens) but never emits it, nor counts it among the
generated tokens: the worker that emits a token counts it (services/decode/first_token.py). The entry's
hand-on state (`Entry.streamed`: the ledger record is the one record of the request here) tells when both the
publish and the first token are done; the entry is forgotten then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
from nats.aio.msg import Msg

from shared import bus, expert_affinity
from shared.engine.engine import RequestOutput
from shared.engine.request import FinishReason
from shared.kv.prefill_kv import PrefillKv
from shared.kv.registry import KvLocation, KvRegistry
from shared.kv.transfer.source import EngineKvBlocks
from shared.messages import (
    Cancel,
    DecodeJob,
    HotExperts,
    PrefillJob,
    Role,
    Sibling,
    encode,
    handed_on_subject,
    prefill_subject,
    routed_prefill_subject,
)
from shared.telemetry import metrics, tracing
from shared.worker import Entry, Phase, Worker, sampling_params, spans
from shared.worker.choices import engine_choices
from shared.worker.events import first_token_event, queued_event
from shared.worker.kv_ranks import kv_ranks
from shared.worker.ledger import StreamedHandOn

log = logging.getLogger(__name__)


class PrefillWorker(Worker[PrefillJob]):
    role = Role.PREFILL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # KV held for a pull, by attempt key (state, lease timer, Redis entry), served by every rank of this
        # worker (one rank, or a group's: each its own heads); built once Redis is connected.
        self.held: PrefillKv | None = None
        self.blocks: EngineKvBlocks | None = None  # a rank of one's engine blocks (layer streaming watches them)

    def job_subject(self) -> str:
        return prefill_subject(self.model_name)

    def own_job_subject(self) -> str:
        return routed_prefill_subject(self.model_name, self.settings.worker_id)

    def held_kv_count(self) -> int:
        return 0 if self.held is None else self.held.count()

    async def setup(self) -> None:
        kv, engine = self.settings.kv, self.engine.engine
        held = self.held = PrefillKv(kv, engine, self.engine.call, KvRegistry(self.conn.redis, kv.lease_s),
                                     secret=self.settings.ticket_secret, model_name=self.model_name,
                                     ranks=kv_ranks(self.group))  # fmt: skip
        self.blocks = held.blocks
        self.rpc_address = await held.start()

    async def teardown(self) -> None:
        if self.held is not None:
            await self.held.close()  # every rank's server (waits for sends in flight), then what is still held

    async def handle_job(self, msg: Msg) -> None:
        # Registered before the engine sees it: the first token may reach the loop before this resumes.
        # n > 1: the prompt is computed once and its KV held once; every choice samples its first token
        entries = await self.take_choices(msg, PrefillJob, Phase.PREFILLING)
        if not entries:
            return
        entry, job, live = entries[0], entries[0].job, [e.job for e in entries]
        try:
            # one token more than it has: a request moved here mid-stream resumes after its tokens so far
            # max_tokens 0: score the prompt only (prompt logprobs), nothing to sample or hand on
            params = [
                sampling_params(j.sampling, max_tokens=len(j.output_token_ids) + 1 if j.sampling.max_tokens else 0)
                for j in live
            ]
            choices = engine_choices(live, params)
            if self._streams_kv(job, len(live)):  # added and watched in one call: no step runs in between
                entry.streamed = StreamedHandOn()
                loop, key = asyncio.get_running_loop(), job.key
                announce = lambda _start: loop.call_soon_threadsafe(self._stream_started, key)  # noqa: E731
                await self.engine.call(
                    lambda e: (
                        e.add_group(job.prompt_token_ids, choices, hold_kv=True, cache_salt=job.cache_salt),
                        self._watch(e, key, announce),
                    )
                )
            else:  # expert affinity: the prompt's routing counted from its first step (trace_experts first)
                traced = job.key if job.decode_affinity is not None else None
                await self.engine.call(
                    lambda e: (
                        traced is not None and e.trace_experts(traced),
                        e.add_group(job.prompt_token_ids, choices, hold_kv=True, cache_salt=job.cache_salt),
                    )
                )
        except Exception as exc:  # ValueError: the engine refused the job; anything else: a bug, answered as such
            for e in entries:
                await self.fail(e, exc)

    def _streams_kv(self, job: PrefillJob, choices: int) -> bool:
        """Whether the job's KV is sent layer by layer (kv_stream_layers): one choice, a fresh prompt, more than
        one token to make (max_tokens 1 ends at the prefill: nothing to stream to), no logprobs (the trailer
        carries the token only), on an engine that can stream (CPU, one process, no windows)."""
        s = job.sampling
        return (
            self.settings.kv.stream_layers
            and self.blocks is not None
            and choices == 1
            and not job.output_token_ids
            and s.max_tokens > 1
            and s.logprobs is None
            and s.prompt_logprobs is None
            and self.engine.engine.can_stream_kv()
        )

    def _watch(self, engine, key: str, announce) -> None:
        assert self.blocks is not None
        self.blocks.watch(engine, key, announce)

    def _stream_started(self, key: str) -> None:
        """On the loop, as the job's last chunk starts: hand it on now (its first token is not sampled yet)."""
        entry = self.ledger.get(key)
        if entry is None or entry.streamed is None:
            return  # cancelled meanwhile (its abort failed the stream)
        if entry.phase is not Phase.PREFILLING:  # its first token came first: handed on as an unstreamed job
            entry.streamed = None
            return
        entry.phase = Phase.HANDING_ON
        asyncio.create_task(self._hand_on_streamed(entry))

    async def _hand_on_streamed(self, entry: Entry[PrefillJob]) -> None:
        """Hold the KV (the forward is writing it) and publish the decode job without its first token."""
        assert self.held is not None and entry.streamed is not None
        job, span, worker_id = entry.job, entry.span, self.settings.worker_id
        key, state = job.key, entry.streamed
        with tracing.use_span(span):
            try:
                if entry.cancelled or self.is_cancelled(job.request_id, job.attempt):
                    await self._drop_streamed(key, settle=True)  # nothing held yet
                    return
                location = KvLocation(key, worker_id, self.rpc_address or "", len(job.prompt_token_ids),
                                      self.held.layout.fingerprint)  # fmt: skip
                holder = worker_id if await self.held.hold(key, job.request_id, job.attempt, location) else None
                decode_job = _decode_job([(job, None)], holder, key, streamed=True)
                subject = handed_on_subject(self.model_name, job.decode_worker)
                with tracing.producer_span(subject, job.request_id):
                    await bus.publish_durably(self.conn.js, subject, encode(decode_job), tracing.carrier() or None)
                self.emit(job.reply_subject, queued_event(job, worker_id, streamed=True))
            except Exception as exc:  # NATS away: the job stays unacked, so JetStream hands it out again
                log.warning("handing %s on to decode failed (%s); freeing its KV", key, exc)
                tracing.mark_error(span, str(exc))
                await self._drop_streamed(key, settle=False)
                return
        state.published = True
        self._streamed_done(entry)
        # cancelled during the publish, or the location not written: its KV was freed (the running request
        # aborted), so no first token comes to forget it (a decode job without a holder recomputes)
        if entry.cancelled or holder is None:
            self._forget_streamed(entry, "cancelled" if entry.cancelled else "its KV location could not be written")

    async def _drop_streamed(self, key: str, settle: bool) -> None:
        """A streamed hand-on that cannot go on: its KV freed (the request aborted if still running), forgotten
        (its message acked when `settle`: cancelled; else left for JetStream to hand out again)."""
        assert self.held is not None
        await self.held.release(key)  # a no-op when not held
        await self.engine.call(lambda e: e.release_kv(key) or (key in e.requests and e.abort(key)))
        entry = self.ledger.finish(key) if settle else self.ledger.pop(key)
        if entry is not None:
            spans.end_once(entry.span)

    def _forget_streamed(self, entry: Entry[PrefillJob], why: str) -> None:
        """A published streamed job whose KV was freed (cancelled, not recorded): the running request was aborted,
        so no first token will come to forget it. Once: a later call finds it forgotten."""
        if self.ledger.get(entry.key) is entry:
            self.ledger.finish(entry.key)
            spans.end_once(entry.span, error=why)

    def _streamed_done(self, entry: Entry[PrefillJob]) -> None:
        """Forget a streamed job once its decode job is out and its first token came (acks the prefill job)."""
        if entry.streamed is not None and entry.streamed.done and self.ledger.get(entry.key) is entry:
            self.ledger.finish(entry.key)
            spans.end_once(entry.span)

    def handle_outputs(self, outputs: list[RequestOutput]) -> None:
        # A group's choices sample their first tokens in one step and are handed on together, its first choice
        # (the one whose engine request computed the prompt and holds the KV) at the head.
        groups: dict[str, list[tuple[Entry[PrefillJob], RequestOutput]]] = {}
        for out in outputs:
            entry = self.ledger.get(out.request_id)
            if entry is not None and entry.streamed is not None and entry.phase is Phase.HANDING_ON:
                # streamed: the decode worker emits this token (it has it from the pull's trailer) and counts it;
                # when its pull fails it samples one of its own, so a count here would count the request's twice
                spans.record_prefill(entry.job, out, entry.span, self.labels)
                entry.streamed.first_token_came = True
                self._streamed_done(entry)
                continue
            if entry is not None and entry.phase is Phase.PREFILLING:
                entry.phase = Phase.HANDING_ON
                groups.setdefault(entry.group_key or entry.key, []).append((entry, out))
        for (entry, out), *rest in groups.values():
            asyncio.create_task(self._hand_off(entry, out, rest))

    async def _hand_off(
        self, entry: Entry[PrefillJob], out: RequestOutput, group: list[tuple[Entry[PrefillJob], RequestOutput]]
    ) -> None:
        job, span = entry.job, entry.span
        spans.record_prefill(job, out, span, self.labels)
        metrics.GENERATION_TOKENS.labels(*self.labels).inc(sum(len(o.new_token_ids) for _, o in [(entry, out), *group]))
        with tracing.use_span(span):  # log lines and the decode publish join its trace
            try:
                await self._hand_on(job, [(entry, out), *group])
            except Exception as exc:  # NATS away: the job stays unacked, so JetStream hands it out again
                log.warning("handing %s on to decode failed (%s); freeing its KV", job.key, exc)
                tracing.mark_error(span, str(exc))
                if self.held is not None:
                    await self.held.release(job.key)
                for e, _ in [(entry, out), *group]:
                    await self.engine.call(lambda eng, k=e.key: eng.release_kv(k))
                    self.ledger.pop(e.key)
        spans.end_once(span)

    async def _hand_on(self, job: PrefillJob, group: list[tuple[Entry[PrefillJob], RequestOutput]]) -> None:
        """Publish each choice's first token; hold the KV (computed once, under the job's key) and publish one
        decode job for the choices that go on (or free it: nothing to decode)."""
        assert self.held is not None  # set up before any job is taken
        rid, key, worker_id = job.request_id, job.key, self.settings.worker_id
        going_on: list[tuple[PrefillJob, int]] = []
        for e, out in group:
            one = e.job  # the choice alone (Worker.take_choices)
            finished = out.finish_reason is FinishReason.STOP or out.num_output_tokens >= one.sampling.max_tokens
            reason = out.finish_reason if finished else None
            self.emit(one.reply_subject, first_token_event(one, out, finished, reason, worker_id))
            if not finished and not self.is_cancelled(one.request_id, one.attempt):
                going_on.append((one, out.new_token_ids[0]))
        others = [e.key for e, _ in group if e.key != key]
        if others:  # forked choices that ended at once hold no block: forgotten
            await self.engine.call(lambda e: [e.release_kv(k) for k in others])
        if not going_on:  # nothing left to decode here
            await self.engine.call(lambda e: e.release_kv(key))
            for e, _ in group:
                self.ledger.finish(e.key)
            return
        fingerprint = self.held.layout.fingerprint
        # The KV held covers every token but the last sampled: the prompt, and a moved request's tokens so far (the
        # decode side posts its receives for exactly this many; a count short of it cost the pair and the pull)
        head_out = group[0][1]
        kv_tokens = head_out.num_prompt_tokens + head_out.num_output_tokens - 1
        location = KvLocation(key, worker_id, self.rpc_address or "", kv_tokens, fingerprint)
        # False: Redis unreachable, so no decode worker could find the KV: it is freed and decode recomputes
        # held for the first choice that goes on: its cancel (the client went away) frees the group's KV
        head = going_on[0][0].request_id
        holder = worker_id if await self.held.hold(key, head, job.attempt, location) else None
        hot, decode_worker = await self._by_affinity(job)
        decode_job = msgspec.structs.replace(_decode_job(going_on, holder, key), hot_experts=hot)
        subject = handed_on_subject(self.model_name, decode_worker)
        with tracing.producer_span(subject, rid):
            await bus.publish_durably(self.conn.js, subject, encode(decode_job), tracing.carrier() or None)
        for e, _ in group:
            self.ledger.finish(e.key)
        for one, _ in going_on:  # no worker holds them until a decode worker does (or the routed one, at once)
            routed = msgspec.structs.replace(one, decode_worker=decode_worker)
            self.emit(one.reply_subject, queued_event(routed, worker_id))

    async def _by_affinity(self, job: PrefillJob) -> tuple[HotExperts | None, str | None]:
        """With the gateway's expert-affinity candidates: the experts the prompt activated (summarised) and the
        decode worker whose hot experts match best (None: the shared queue). Without: None and the job's own."""
        if job.decode_affinity is None:
            return None, job.decode_worker
        load = await self.engine.call(lambda e: e.take_request_experts(job.key))
        hot = expert_affinity.summarise(load, job.decode_affinity.top_k)
        chosen = expert_affinity.choose(hot, job.decode_affinity.candidates)
        outcome = "shared" if chosen is None else "matched"
        metrics.DECODE_AFFINITY_ROUTES.labels(*self.labels, outcome).inc()
        return hot, chosen

    async def on_cancel(self, cancel: Cancel) -> None:
        await super().on_cancel(cancel)  # the jobs in hand
        if self.held is not None:  # the KV held for a pull; KV being sent is freed when its send ends
            await self.held.cancel(cancel.request_id, cancel.covers)
        for entry in self.ledger:
            if entry.streamed is not None and entry.streamed.published and entry.cancelled:
                # streaming: its KV released above, the request aborted
                self._forget_streamed(entry, "cancelled")


def _decode_job(
    going_on: Sequence[tuple[PrefillJob, int | None]], holder: str | None, kv_key: str, streamed: bool = False
) -> DecodeJob:
    """One decode job for the choices that go on, each with its first token: the first of them is the job's
    own request, the others its siblings; the KV is the one held under `kv_key`. Streamed: one choice, whose
    first token (None) is not sampled yet: the decode worker takes it from the pull."""
    (head, token), rest = going_on[0], going_on[1:]
    siblings = [Sibling(j.request_id, j.reply_subject, j.sampling.seed, [*j.output_token_ids, t])
                for j, t in rest if t is not None]  # fmt: skip
    return DecodeJob(
        request_id=head.request_id,
        model=head.model,
        prompt_token_ids=head.prompt_token_ids,
        output_token_ids=[*head.output_token_ids] if token is None else [*head.output_token_ids, token],
        sampling=head.sampling,
        reply_subject=head.reply_subject,
        attempt=head.attempt,
        prefill_worker=holder,
        created_at=head.created_at,
        siblings=siblings,
        kv_key=None if head.key == kv_key else kv_key,
        kv_streamed=streamed,
        cache_salt=head.cache_salt,
        kv_reuse=head.decode_kv_reuse,
    )
