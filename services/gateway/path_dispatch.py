"""The prefill path at dispatch: choose it for a job (prefill_path.py on path_signals.py's signals) and say where
the job goes.

- remote: the prefill job onto the prefill queue, as ever (a prefill or mixed worker takes it);
- local: the same request as a decode job with `prefill_here` onto the decode queue: the decode worker that takes it
  computes the prompt in its own engine and decodes on (services/decode/worker.py), no KV to pull.

Whichever path a request came by, a move (the watchdog's, nats_backend.py) sends it back to the prefill queue with its
tokens so far, as every moved request.

The chooser remembers what only the gateway knows: the prompts it sent local over the last window (`LocalLoad`, the
decode load of the rule's TPOT clause) and each path's serving-plane time, learnt from its first tokens
(`PlaneTime`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from services.gateway.liveness import WorkerTable
from services.gateway.path_signals import OwnLoad, PathSignals
from services.gateway.prefill_path import LOCAL_WINDOW_S, PathChoice, PlaneOverhead, Slos, choose_path
from shared.messages import DecodeJob, PrefillJob, Sibling, decode_subject, prefill_subject
from shared.settings import PrefillPath, PrefillPathSettings


class LocalLoad:
    """The prompt tokens this gateway sent down the local path over the last LOCAL_WINDOW_S, by model: the decode
    load the rule's TPOT clause counts (local jobs go to the shared decode queue: spread over its decode workers).
    Other gateways' local prompts are not seen."""

    def __init__(self, window_s: float = LOCAL_WINDOW_S) -> None:
        self.window_s = window_s
        self._sent: dict[str, deque[tuple[float, int]]] = {}  # model → (when, prompt tokens), oldest first

    def add(self, model: str, now: float, tokens: int) -> None:
        self._sent.setdefault(model, deque()).append((now, tokens))

    def recent(self, model: str, now: float) -> int:
        sent = self._sent.get(model)
        if sent is None:
            return 0
        while sent and sent[0][0] <= now - self.window_s:
            sent.popleft()
        return sum(tokens for _, tokens in sent)


PLANE_ALPHA = 0.1  # the serving-plane time is the mean over about the last ten first tokens of a path


class PlaneTime:
    """Each path's serving-plane time (prefill_path.PlaneOverhead), learnt from this gateway's first tokens: the
    exponentially weighted mean of actual - predicted TTFT, over first attempts (a moved request's TTFT is not its
    path's)."""

    def __init__(self, alpha: float = PLANE_ALPHA) -> None:
        self.alpha = alpha
        self._mean: dict[PrefillPath, float] = {}

    def observe(self, choice: PathChoice, ttft_s: float) -> None:
        chosen = choice.chosen
        if chosen is None:
            return
        residual = ttft_s - (chosen.ttft_s - chosen.plane_s)  # against the engines' part of the prediction
        old = self._mean.get(choice.path)
        self._mean[choice.path] = residual if old is None else old + self.alpha * (residual - old)

    def overhead(self) -> PlaneOverhead:
        return PlaneOverhead(self._mean.get(PrefillPath.REMOTE, 0.0), self._mean.get(PrefillPath.LOCAL, 0.0))


class PathChooser:
    def __init__(self, settings: PrefillPathSettings) -> None:
        self.settings = settings
        self.slos = Slos(
            settings.ttft_slo_ms / 1e3, settings.tpot_slo_ms / 1e3, settings.local_prefill_max_stall_ms / 1e3
        )
        self.local_load = LocalLoad()
        self.plane = PlaneTime()

    def choose(
        self,
        workers: WorkerTable,
        model: str,
        prompt_tokens: int,
        now: float,
        prefill_cached: Mapping[str, int] | None = None,
        prefill_load: OwnLoad | None = None,
        decode_load: OwnLoad | None = None,
        remember: bool = True,
    ) -> PathChoice:
        """The path of a request of `prompt_tokens` for `model`, from the workers live at `now`; `prefill_cached`:
        the prompt tokens a prefill worker is expected to find in its prefix cache, by worker id; `prefill_load`,
        `decode_load`: this gateway's requests the heartbeats do not show yet (PathSignals). A local choice is
        remembered for the decode load of the choices after it; `remember=False` leaves that to `remember()`, once
        the request is known to be sent (admission may still refuse it)."""
        live = self.settings.prefill_path_live_calibration
        serving = workers.serving(model, now)
        recent = self.local_load.recent(model, now)
        signals = PathSignals(serving, live, prefill_cached, prefill_load, decode_load, recent)
        choice = choose_path(
            prompt_tokens,
            signals.prefill(),
            signals.decode(),
            signals.transfer(),
            self.slos,
            self.settings.prefill_path,
            self.plane.overhead() if live else PlaneOverhead(),
        )
        if remember:
            self.remember(choice, model, now, prompt_tokens)
        return choice

    def remember(self, choice: PathChoice, model: str, now: float, prompt_tokens: int) -> None:
        """Count a sent request's prompt in the decode load of the choices after it, if it went local."""
        if choice.path is PrefillPath.LOCAL:
            self.local_load.add(model, now, prompt_tokens)  # (a decode worker's cache hit is not predicted)


def dispatch(choice: PathChoice, job: PrefillJob) -> tuple[str, PrefillJob | DecodeJob]:
    """(subject, message) that sends `job` (a fresh request, its other choices as siblings) down the chosen path."""
    if choice.path is PrefillPath.REMOTE:
        return prefill_subject(job.model), job
    return decode_subject(job.model), local_job(job)


def local_job(job: PrefillJob) -> DecodeJob:
    """The prefill job as a decode job to be prefilled where it is taken: nothing sampled yet, nothing to pull."""
    return DecodeJob(
        request_id=job.request_id,
        model=job.model,
        prompt_token_ids=job.prompt_token_ids,
        output_token_ids=list(job.output_token_ids),
        sampling=job.sampling,
        reply_subject=job.reply_subject,
        attempt=job.attempt,
        created_at=job.created_at,
        siblings=[Sibling(s.request_id, s.reply_subject, s.seed) for s in job.siblings],
        cache_salt=job.cache_salt,
        prefill_here=True,
    )
