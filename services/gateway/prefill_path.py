"""Where a request's prompt is computed: on a prefill worker, its KV then handed off to a decode worker (the remote
path, disaggregated), or on the decode worker itself (the local path: no hand-off). A pure function of signals the
gateway has (path_signals.py gathers them from the workers' heartbeats); no I/O, no clock, no torch.

The predictions (seconds; P prompt tokens, C of them cached on the worker that computes them):

    remote  TTFT  = queued / prefill_rate + prefill_step + (P - C) / prefill_rate      (the best prefill worker)
            ready = TTFT + pull_overhead + P · kv_bytes_per_token · transfer_s_per_byte  (the hand-off: every token's
                    KV moves, cached or not; the first token reaches the client before it, the second after it)
    local   TTFT  = ready = decode_step + (P - C) / decode_prefill_rate                 (the best decode worker: the
                    prompt rides in a step of its running batch)
            decode slowdown = (P - C) / decode_prefill_rate: what that step adds to every running request's next token

The rule (auto), in order; the first that fails answers "remote" and names itself as the reason:

    1. a decode worker and a prefill worker are live (else: "no decode worker" / "no prefill worker": the prefill
       queue's taker is then a mixed worker, which computes the prompt where it decodes it anyway);
    2. TPOT: decode_step + decode slowdown <= tpot_slo. Disaggregation exists to keep prompts out of decode steps;
       a prompt is let in only where the step it lengthens still meets the TPOT target ("tpot"). It is counted as
       one step's worth even when chunked prefill would spread it (erring towards remote), and it is applied with
       an empty batch too (requests that arrive meanwhile wait behind it; the gateway cannot see them coming);
    3. TTFT: local TTFT <= ttft_slo, or < the remote TTFT ("ttft");
    4. sooner, all requests counted: remote ready - local ready > batch · decode slowdown — what the request gains
       by skipping the hand-off exceeds what its prompt costs the decode worker's running requests, each of whose
       next token waits the slowdown (on the remote path the prompt is computed elsewhere) ("slower"). With an
       empty batch: local is ready first. Ties go remote.

`remote` and `local` settings answer their path whatever the predictions ("setting"), local only while a decode
worker is live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.settings import PrefillPath


@dataclass(frozen=True)
class PrefillSide:
    """One live prefill worker, as the gateway sees it."""

    worker_id: str
    queued_tokens: int  # prompt tokens waiting in its engine before this one
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


@dataclass(frozen=True)
class Prediction:
    """One path for one request."""

    worker_id: str  # the worker the prediction assumed
    ttft_s: float
    ready_s: float  # when the request can decode on (remote: after the hand-off)


@dataclass(frozen=True)
class PathChoice:
    path: PrefillPath  # REMOTE or LOCAL
    reason: str  # the rule that decided (see the module)
    remote: Prediction | None  # None where no prefill worker is live
    local: Prediction | None  # None where no decode worker is live
    decode_slowdown_s: float | None  # what the local path adds to its decode worker's next step

    @property
    def predicted_ttft_s(self) -> float | None:
        chosen = self.local if self.path is PrefillPath.LOCAL else self.remote
        return None if chosen is None else chosen.ttft_s


def predict_remote(prompt_tokens: int, workers: Sequence[PrefillSide], transfer: Transfer) -> Prediction | None:
    """The remote path on the prefill worker that gives the first token soonest; None without one."""
    handoff_s = transfer.overhead_s + prompt_tokens * transfer.bytes_per_token * transfer.s_per_byte
    best: Prediction | None = None
    for w in workers:
        uncached = max(prompt_tokens - w.cached_tokens, 0)
        ttft = (w.queued_tokens + uncached) / w.tokens_per_s + w.step_s
        if best is None or ttft < best.ttft_s:
            best = Prediction(w.worker_id, ttft, ttft + handoff_s)
    return best


def predict_local(prompt_tokens: int, workers: Sequence[DecodeSide]) -> tuple[Prediction, float] | None:
    """The local path on the decode worker that gives the first token soonest, and the slowdown it causes there;
    None without one."""
    best: tuple[Prediction, float] | None = None
    for w in workers:
        slowdown = max(prompt_tokens - w.cached_tokens, 0) / w.prefill_tokens_per_s
        ttft = w.step_s + slowdown
        if best is None or ttft < best[0].ttft_s:
            best = (Prediction(w.worker_id, ttft, ttft), slowdown)
    return best


def choose_path(
    prompt_tokens: int,
    prefill: Sequence[PrefillSide],
    decode: Sequence[DecodeSide],
    transfer: Transfer,
    slos: Slos,
    mode: PrefillPath = PrefillPath.AUTO,
) -> PathChoice:
    """The path for one request of `prompt_tokens` tokens, by the rule of the module."""
    remote = predict_remote(prompt_tokens, prefill, transfer)
    local_and_slowdown = predict_local(prompt_tokens, decode)
    local, slowdown = local_and_slowdown if local_and_slowdown is not None else (None, None)

    def answer(path: PrefillPath, reason: str) -> PathChoice:
        return PathChoice(path, reason, remote, local, slowdown)

    if local is None or slowdown is None:
        return answer(PrefillPath.REMOTE, "no decode worker")
    if mode is not PrefillPath.AUTO:
        return answer(mode, "setting")
    if remote is None:
        return answer(PrefillPath.REMOTE, "no prefill worker")
    step_s = next(w.step_s for w in decode if w.worker_id == local.worker_id)
    if step_s + slowdown > slos.tpot_s:
        return answer(PrefillPath.REMOTE, "tpot")
    if local.ttft_s > slos.ttft_s and local.ttft_s >= remote.ttft_s:
        return answer(PrefillPath.REMOTE, "ttft")
    batch = next(w.batch for w in decode if w.worker_id == local.worker_id)
    if remote.ready_s - local.ready_s <= batch * slowdown:
        return answer(PrefillPath.REMOTE, "slower")
    return answer(PrefillPath.LOCAL, "sooner")
