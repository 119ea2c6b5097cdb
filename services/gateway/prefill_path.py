"""Where a request's prompt is computed: on a prefill worker, its KV then handed off to a decode worker (the remote
path, disaggregated), or on the decode worker itself (the local path: no hand-off). A pure function of signals the
gateway has (path_signals.py gathers them from the workers' heartbeats and its own dispatches); no I/O, no clock,
no torch.

The predictions (seconds; P prompt tokens, C of them cached on the worker that computes them):

    remote  TTFT  = queued / prefill_rate + prefill_step + (P - C) / prefill_rate      (the best prefill worker)
            ready = TTFT + pull_overhead + P · kv_bytes_per_token · transfer_s_per_byte  (the hand-off: every token's
                    KV moves, cached or not; the first token reaches the client before it, the second after it)
    local   TTFT  = ready = decode_step + (queued + P - C) / decode_prefill_rate        (the best decode worker: the
                    prompt rides in a step of its running batch, after the local prompts queued there)
            decode slowdown = (P - C) / decode_prefill_rate: what that step adds to every running request's next token
            both TTFTs add the path's measured serving-plane time (PlaneOverhead: the hops, and what the queues
            above miss, learnt from this gateway's requests: actual TTFT - predicted, averaged)
            decode load     u = (recent + P - C) / (decode_prefill_rate · LOCAL_WINDOW_S): the share of the decode
                    worker's time its local prompts take, `recent` the prompt tokens sent there to compute over the
                    last window (this gateway's); its requests' mean TPOT becomes decode_step / (1 - u)

The rule (auto), in order; the first clause that fails answers "remote" and names itself as the reason:

    1. a decode worker and a prefill worker are live (else: "no decode worker" / "no prefill worker": the prefill
       queue's taker is then a mixed worker, which computes the prompt where it decodes it anyway);
    2. stall: decode_step + decode slowdown <= the stall bound (`local_prefill_max_stall_ms`): the pause one local
       prompt puts in the token streams of the requests decoding beside it, an inter-token latency. It is counted
       as one step even where chunked prefill would spread it (erring towards remote), with an empty batch too
       (requests arriving meanwhile would wait behind it) ("stall");
    3. TPOT: decode_step / (1 - u) <= TPOT_HEADROOM · tpot_slo. A TPOT is a request's mean over its output, so
       the prompts a decode worker computes cost its requests their share of its time, not one step's stall each;
       the headroom keeps the worker's mean below the target by the spread of its requests' TPOTs ("tpot");
    4. TTFT: local TTFT <= ttft_slo, or < the remote TTFT ("ttft");
    5. worth it, either of:
       - relief: the remote path's first token is at risk (remote TTFT > RELIEF_SHARE · ttft_slo: the prefill
         workers are queued) and the local one comes sooner: the decode worker's spare time takes prompts off a
         backlog that would break the TTFT target ("relief");
       - sooner, all requests counted: remote ready - local ready > batch · decode slowdown: what the request gains
         by skipping the hand-off exceeds what its prompt costs the decode worker's running requests, each of whose
         next token waits the slowdown ("sooner"). With an empty batch: local is ready first.
       Neither: "slower". Ties go remote.

`remote` and `local` settings answer their path whatever the predictions ("setting"), local only while a decode
worker is live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.settings import PrefillPath

LOCAL_WINDOW_S = 10.0  # the decode load's window: about one request's decode life at the SLO (128 tokens ≈ 10 s)
TPOT_HEADROOM = 0.8  # per-request TPOTs spread 1.1–1.25x above the worker's median (compare_pd's p99 / p50)
RELIEF_SHARE = 0.25  # remote TTFT past a quarter of the target: the prefill queue is building (predictions run
#                      1.1–1.7x under the measured p50 below the knee: benchmarks.md, "Colocated vs disaggregated")


@dataclass(frozen=True)
class PrefillSide:
    """One live prefill worker, as the gateway sees it."""

    worker_id: str
    queued_tokens: int  # prompt tokens waiting in its engine and the job queues before this one
    tokens_per_s: float  # its prefill rate
    step_s: float  # what a prefill step costs before its prompt tokens
    cached_tokens: int = 0  # of this prompt, already in its prefix cache


@dataclass(frozen=True)
class DecodeSide:
    """One live decode worker, as the gateway sees it."""

    worker_id: str
    batch: int  # requests it is decoding
    step_s: float  # one decode step of that batch
    prefill_tokens_per_s: float  # its rate on prompt tokens
    cached_tokens: int = 0
    queued_tokens: int = 0  # local prompt tokens waiting in its engine and the job queue before this one
    recent_local_tokens: int = 0  # local prompt tokens sent to it over the last LOCAL_WINDOW_S


@dataclass(frozen=True)
class Transfer:
    """The KV hand-off between a prefill and a decode worker."""

    s_per_byte: float
    overhead_s: float  # a pull's fixed cost
    bytes_per_token: int


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tpot_s: float
    stall_s: float = 0.25  # the longest pause a local prompt may put in its decode batch (PrefillPathSettings)


@dataclass(frozen=True)
class PlaneOverhead:
    """What each path's first token takes beyond the engines' work the model predicts (the job's publish, fetch and
    token-event hops; the queue the signals missed), as measured: the mean of actual - predicted TTFT."""

    remote_s: float = 0.0
    local_s: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """One path for one request."""

    worker_id: str  # the worker the prediction assumed
    ttft_s: float
    ready_s: float  # when the request can decode on (remote: after the hand-off)
    plane_s: float = 0.0  # the serving-plane time included in ttft_s (PlaneOverhead)
    queue_s: float = 0.0  # the part of ttft_s spent behind the worker's queued prompt tokens (what waiting drains)


@dataclass(frozen=True)
class PathChoice:
    path: PrefillPath  # REMOTE or LOCAL
    reason: str  # the rule that decided (see the module)
    remote: Prediction | None  # None where no prefill worker is live
    local: Prediction | None  # None where no decode worker is live
    decode_slowdown_s: float | None  # what the local path adds to its decode worker's next step
    decode_tpot_s: float | None = None  # its requests' mean TPOT with this prompt's share of its time added

    @property
    def chosen(self) -> Prediction | None:
        return self.local if self.path is PrefillPath.LOCAL else self.remote

    @property
    def predicted_ttft_s(self) -> float | None:
        return None if self.chosen is None else self.chosen.ttft_s


def predict_remote(
    prompt_tokens: int, workers: Sequence[PrefillSide], transfer: Transfer, plane_s: float = 0.0
) -> Prediction | None:
    """The remote path on the prefill worker that gives the first token soonest; None without one."""
    handoff_s = transfer.overhead_s + prompt_tokens * transfer.bytes_per_token * transfer.s_per_byte
    best: Prediction | None = None
    for w in workers:
        uncached = max(prompt_tokens - w.cached_tokens, 0)
        queue = w.queued_tokens / w.tokens_per_s
        ttft = max(queue + uncached / w.tokens_per_s + w.step_s + plane_s, 0.0)
        if best is None or ttft < best.ttft_s:
            best = Prediction(w.worker_id, ttft, ttft + handoff_s, plane_s, queue)
    return best


@dataclass(frozen=True)
class LocalPrediction:
    """The local path on one decode worker."""

    worker: DecodeSide
    prediction: Prediction
    slowdown_s: float  # the prompt's compute, added to one step of the worker's batch
    tpot_s: float  # the worker's mean TPOT with its recent local prompts and this one (inf past its capacity)


def predict_local(prompt_tokens: int, workers: Sequence[DecodeSide], plane_s: float = 0.0) -> LocalPrediction | None:
    """The local path on the decode worker that gives the first token soonest; None without one."""
    best: LocalPrediction | None = None
    for w in workers:
        uncached = max(prompt_tokens - w.cached_tokens, 0)
        slowdown = uncached / w.prefill_tokens_per_s
        queue = w.queued_tokens / w.prefill_tokens_per_s
        ttft = max(w.step_s + queue + slowdown + plane_s, 0.0)
        load = (w.recent_local_tokens + uncached) / (w.prefill_tokens_per_s * LOCAL_WINDOW_S)
        tpot = w.step_s / (1.0 - load) if load < 1.0 else float("inf")
        if best is None or ttft < best.prediction.ttft_s:
            best = LocalPrediction(w, Prediction(w.worker_id, ttft, ttft, plane_s, queue), slowdown, tpot)
    return best


def choose_path(
    prompt_tokens: int,
    prefill: Sequence[PrefillSide],
    decode: Sequence[DecodeSide],
    transfer: Transfer,
    slos: Slos,
    mode: PrefillPath = PrefillPath.AUTO,
    plane: PlaneOverhead = PlaneOverhead(),
) -> PathChoice:
    """The path for one request of `prompt_tokens` tokens, by the rule of the module."""
    remote = predict_remote(prompt_tokens, prefill, transfer, plane.remote_s)
    best_local = predict_local(prompt_tokens, decode, plane.local_s)

    def answer(path: PrefillPath, reason: str) -> PathChoice:
        if best_local is None:
            return PathChoice(path, reason, remote, None, None)
        return PathChoice(path, reason, remote, best_local.prediction, best_local.slowdown_s, best_local.tpot_s)

    if best_local is None:
        return answer(PrefillPath.REMOTE, "no decode worker")
    if mode is not PrefillPath.AUTO:
        return answer(mode, "setting")
    if remote is None:
        return answer(PrefillPath.REMOTE, "no prefill worker")
    local, worker, slowdown = best_local.prediction, best_local.worker, best_local.slowdown_s
    if worker.step_s + slowdown > slos.stall_s:
        return answer(PrefillPath.REMOTE, "stall")
    if best_local.tpot_s > TPOT_HEADROOM * slos.tpot_s:
        return answer(PrefillPath.REMOTE, "tpot")
    if local.ttft_s > slos.ttft_s and local.ttft_s >= remote.ttft_s:
        return answer(PrefillPath.REMOTE, "ttft")
    if remote.ttft_s > RELIEF_SHARE * slos.ttft_s and local.ttft_s < remote.ttft_s:
        return answer(PrefillPath.LOCAL, "relief")
    if remote.ready_s - local.ready_s > worker.batch * slowdown:
        return answer(PrefillPath.LOCAL, "sooner")
    return answer(PrefillPath.REMOTE, "slower")
