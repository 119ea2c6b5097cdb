"""Overlap scheduling: the next step is planned and its inputs built while the current step's forward runs.

Without it a step is plan → inputs → forward → sample → update, one after the other on the engine thread. With
it (`EngineConfig.overlap_scheduling`) the forward and the sampling run on a forward thread, and each
`Engine.step` call on the engine thread does

    plan step k+1 → build its inputs (metadata included) → launch it → wait for step k's tokens → update with them

so the planning, the input building, the update of step k and whatever the caller does between calls (streaming
the outputs out, taking new requests) run while step k+1's forward does. The state runs one step ahead of the
tokens: a launched plan's tokens count as computed at once, and each sampling request gets a PENDING output
token (Scheduler.advance) that is step k+1's input; the forward thread writes the sampled id into step k+1's
inputs before it runs it (ModelRunner.run_prepared). The one-step lag then costs this:

- **Stops.** A token that ends a request by length is known before it is sampled: such a request gets no PENDING
  token and is never planned again. One that ends by a stop token (EOS, stop_token_ids) is found when step k
  resolves, after step k+1 was launched with a row for it: that row is wasted (computed, not sampled: the forward
  thread sees the stop in the token it fills in and draws nothing for it; the update skips it). Stop strings are
  the gateway's (services/gateway/textstream.py): it cancels the request, which arrives as an abort.
- **Aborts** between calls free the request's blocks while a step that writes to them may run. Nothing but the
  forward thread writes the KV pool's free blocks: the next plan's steps run after the one in flight (one forward
  thread, in launch order), and every engine call that writes or reads KV on the engine thread (export, import,
  release, fork, pins, streams) first waits for the step in flight and takes its update (`Engine._drain`).
- **Lockstep fallback.** A step runs the classic way (the step in flight resolved first) whenever a live request
  needs its previous token before its next step is built, or touches the forward: a grammar (its mask follows
  the token just sampled), penalties (the history holds it), prompt logprobs or score-only requests (scored
  inside the forward), choices waiting to be forked at their parent's first token, a watched layer stream, a
  traced prompt; and always on a worker group (its op stream is the leader's forward). `needs_lockstep` below.

Greedy and seeded tokens are the same as in lockstep, whatever the batch (tests/unit/test_overlap_scheduling.py);
an unseeded draw from the engine's own random stream is reproducible only for the same batches in the same order,
which the lag can change (a wasted row holds its slot for one more plan).

On CPU torch ops block the thread that calls them, so the forward runs on its own thread: the model's kernels
(torch's intra-op threads, the C kernels' OpenMP team) release the GIL, and the engine thread plans meanwhile. On
CUDA the forward thread launches the kernels and syncs only on the sampled ids, as a lockstep step does; the
engine thread builds the next inputs meanwhile (the decode graphs are replayed from the forward thread).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from shared.engine.runner import ModelRunner, PreparedStep, RunnerOutput
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import SchedulePlan

Stops = Callable[[SamplingParams, int], bool]  # Scheduler.stops


def needs_lockstep(params: SamplingParams) -> bool:
    """A request of `params` needs its previous token before its next step is built, or touches the forward:
    its steps run in lockstep."""
    return (
        params.structured is not None
        or params.has_penalties
        or params.prompt_logprobs is not None
        or params.max_tokens == 0
    )


@dataclass
class InFlight:
    """A launched step: its plan, what `Scheduler.advance` returned for it, and its output to come."""

    plan: SchedulePlan
    tokens: tuple[int, int]  # (prefill, decode) tokens it computes, counted in EngineStats when it resolves
    samples: list[bool]
    pending: dict[str, int]
    output: Future[RunnerOutput]


class ForwardThread:
    """One thread that runs launched steps in launch order (so a step's KV writes come before the next's). Its
    thread ends with the engine (the executor's, when it is collected) or at interpreter exit."""

    def __init__(self, runner: ModelRunner, stops: Stops) -> None:
        self._runner, self._stops = runner, stops
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._last: Future[RunnerOutput] | None = None  # the step launched before: its tokens fill the next's

    def launch(self, step: PreparedStep) -> Future[RunnerOutput]:
        previous = self._last if step.fills else None
        self._last = self._pool.submit(self._run, step, previous)
        return self._last

    def _run(self, step: PreparedStep, previous: Future[RunnerOutput] | None) -> RunnerOutput:
        # done already (it ran before on this thread); a step that failed fails the one that follows it too
        sampled = previous.result().sampled if previous is not None else {}
        return self._runner.run_prepared(step, sampled, self._stops)
