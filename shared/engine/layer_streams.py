"""Per-layer readiness of a request's KV while its last prefill chunk runs: what a layer-streamed send waits on.

A request registered with `Engine.stream_kv(request_id, on_start)` is watched by the engine's `LayerStreams`.
When a step schedules the chunk that completes its prompt (the one that samples its first token), the engine
calls `on_start(StreamStart)` on its own thread, before the forward pass: the blocks are allocated by then and
every earlier chunk's KV is written, so layer l of the request is complete as soon as layer l of this step
is. During the forward the model calls `mark(layer)` after each layer (`CausalLM.on_layer`); after the step the
sampled first token ends the stream. A sender (another thread) waits on `LayerProgress.wait_layer` before it
reads layer l and on `wait_token` for the trailer.

Host-memory pools only: a layer done on the CPU is written when the layer's call returns. (A CUDA pool would
need an event per layer recorded on the compute stream and the send on a side stream: not built; its requests
are handed off unstreamed.) Sliding-window models are not streamed either: a step may free blocks behind the
window after the forward, under a send that already announced them.

Invariant: every progress that started ends exactly once: `finish` (first token), or `fail` (the step
raised, the request was aborted, or the holder stopped the stream). A waiter never blocks past its timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.scheduler import SchedulePlan


class StreamFailed(RuntimeError):
    """The stream ended without its KV: the request was aborted, its step raised, or the holder stopped it."""


class LayerProgress:
    """How many layers of one request's KV are complete, and its first token once sampled. Thread-safe."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._done = 0  # layers 0 .. _done - 1 are complete
        self._token: int | None = None
        self._error: str | None = None
        self._cond = threading.Condition()
        self.started_at = time.monotonic()  # when the last chunk's step began (benchmarks)
        self.layers_at: list[float] = []  # when each layer completed (benchmarks, tests)

    @property
    def layers_done(self) -> int:
        return self._done

    @property
    def ended(self) -> bool:
        return self._token is not None or self._error is not None

    def mark(self, layer: int) -> None:
        """Layer `layer` of the last chunk is written (engine thread, in layer order)."""
        with self._cond:
            if self._error is None and layer == self._done:
                self._done = layer + 1
                self.layers_at.append(time.monotonic())
                self._cond.notify_all()

    def finish(self, token: int) -> None:
        with self._cond:
            if self._error is None and self._token is None:
                self._done, self._token = self.num_layers, token
                self._cond.notify_all()

    def fail(self, why: str) -> None:
        """End the stream without its KV (a no-op once finished)."""
        with self._cond:
            if self._token is None and self._error is None:
                self._error = why
                self._cond.notify_all()

    def wait_layer(self, layer: int, timeout_s: float) -> None:
        """Return once layer `layer` is complete; StreamFailed if the stream failed, TimeoutError past timeout_s."""
        self._wait(lambda: self._done > layer, timeout_s, f"layer {layer}")

    def wait_token(self, timeout_s: float) -> int:
        self._wait(lambda: self._token is not None, timeout_s, "the first token")
        assert self._token is not None
        return self._token

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout_s):
                raise TimeoutError(f"{what} of the streamed KV not ready within {timeout_s:.1f} s")
            if self._error is not None and not ready():
                raise StreamFailed(self._error)


@dataclass(frozen=True)
class StreamStart:
    """What `on_start` is told when a watched request's last chunk begins: its KV's final extent."""

    request_id: str
    num_tokens: int  # the prompt's: the KV the hand-off carries
    block_ids: list[int]
    progress: LayerProgress


OnStart = Callable[[StreamStart], None]


class LayerStreams:
    """The engine's watched requests and the streams of the step in flight (engine thread only, except
    `progress`, which hands the live progress to a sender)."""

    def __init__(self, num_layers: int, block_size: int) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self._watched: dict[str, OnStart] = {}
        self._live: dict[str, LayerProgress] = {}  # started, not ended

    def watch(self, request_id: str, on_start: OnStart) -> None:
        self._watched[request_id] = on_start

    def progress(self, request_id: str) -> LayerProgress | None:
        """The live stream of `request_id` (started, not ended), else None."""
        return self._live.get(request_id)

    def is_streaming(self, request_id: str) -> bool:
        return request_id in self._live

    @property
    def active(self) -> bool:
        """Whether a request is watched or streaming (its steps run in lockstep: shared/engine/overlap.py)."""
        return bool(self._watched or self._live)

    def begin(self, plan: SchedulePlan) -> Callable[[int], None] | None:
        """Before the step's forward: start the streams whose last chunk this step runs; → the per-layer hook
        for the model (None: nothing of this step is streamed)."""
        started: list[LayerProgress] = []
        for seq in plan.seqs:
            req = seq.request
            on_start = self._watched.get(req.request_id)
            if on_start is None or not seq.samples or req.output_token_ids:
                continue
            del self._watched[req.request_id]
            num_tokens = req.num_computed_tokens + seq.num_tokens
            blocks = list(req.block_table[: -(-num_tokens // self.block_size)])
            progress = self._live[req.request_id] = LayerProgress(self.num_layers)
            started.append(progress)
            on_start(StreamStart(req.request_id, num_tokens, blocks, progress))
        if not self._live:
            return None
        live = list(self._live.values())  # streams started in an earlier step but not ended cannot exist

        def mark(layer: int) -> None:
            for progress in live:
                progress.mark(layer)

        return mark

    def end(self, sampled: dict[str, int]) -> None:
        """After the step: each live stream's first token (every one samples in the step it started)."""
        for rid, progress in list(self._live.items()):
            token = sampled.get(rid)
            if token is None:
                progress.fail("its last chunk sampled no token")
            else:
                progress.finish(token)
            del self._live[rid]

    def fail_all(self, why: str) -> None:
        """The step raised: every live stream fails."""
        for progress in self._live.values():
            progress.fail(why)
        self._live.clear()

    def drop(self, request_id: str, why: str = "the request was aborted") -> None:
        """The request is gone (aborted): forget it, failing its stream if live."""
        self._watched.pop(request_id, None)
        progress = self._live.pop(request_id, None)
        if progress is not None:
            progress.fail(why)
