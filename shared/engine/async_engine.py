"""Drives an `Engine` on its own thread for an asyncio service.

The engine is single-threaded: only this thread touches it. The service's event loop asks for work with
`call(fn)` (fn(engine) runs between two steps, its result comes back as an awaitable) and receives every
step's outputs through `on_outputs`, called on the event loop. Steps run back to back while there is
work, so NATS, gRPC and KV transfers on the loop never stop a running batch. A step that raises ends the
thread and is reported through `on_failure` (on the loop): the engine's state is unknown after it, so the
service must stop rather than serve on without an engine. From then on every `call` — queued or new — raises
EngineFailed at once instead of waiting for a thread that is gone.

`on_state(engine)`, when given, runs on the engine thread whenever the engine may have changed: at start, after
each call's fn (before its result reaches the caller) and after each step (before its outputs do). A service
takes immutable snapshots there, so that its loop never reads the engine's counters while this thread changes them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from shared.engine.engine import Engine, RequestOutput
from shared.thread_names import name_this_thread

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFailed(RuntimeError):
    """The engine thread died on a failed step; nothing more runs on it."""


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[BaseException], None] | None = None,
        on_state: Callable[[Engine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._on_state = on_state
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future, asyncio.AbstractEventLoop]]
        self._commands = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._failing = threading.Lock()  # orders `call`'s check-and-queue against the thread's death
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the engine thread; outputs and the failure report go to the running loop."""
        self._state_changed()
        self._thread = threading.Thread(
            target=self._run, args=(asyncio.get_running_loop(),), name="engine", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread.is_alive():
            loop = asyncio.get_running_loop()
            self._commands.put((lambda e: None, loop.create_future(), loop))  # wakes a blocked _drain
            await asyncio.to_thread(self._thread.join, 10)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; raises what fn raised, or EngineFailed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._failing:
            if self._failure is not None:
                raise EngineFailed(f"the engine failed: {self._failure!r}") from self._failure
            self._commands.put((fn, future, loop))
        return await future

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        name_this_thread("engine")  # its CPU apart from the loop's in `top -H` (benchmarks/thread_cpu.py)
        while not self._stopped.is_set():
            busy = self.engine.has_unfinished()
            self._drain(block=not busy)
            if self._stopped.is_set():
                break
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug in one step must not kill the worker silently
                    log.exception("engine step failed; the engine thread stops")
                    self._die(exc, loop)
                    return
                self._state_changed()
                if outputs:
                    loop.call_soon_threadsafe(self._on_outputs, outputs)
                clock = self.engine.step_clock
                if clock is not None and clock.steps:
                    clock.mark("stream_out")

    def _state_changed(self) -> None:
        if self._on_state is None:
            return
        try:
            self._on_state(self.engine)
        except Exception:  # a broken observer must not stop the engine
            log.exception("on_state failed")

    def _die(self, exc: BaseException, loop: asyncio.AbstractEventLoop) -> None:
        """Answer every queued call with EngineFailed (and every later one: see `call`), then report."""
        with self._failing:
            self._failure = exc
        error = EngineFailed(f"the engine failed: {exc!r}")
        while True:
            try:
                _, future, caller_loop = self._commands.get_nowait()
            except queue.Empty:
                break
            caller_loop.call_soon_threadsafe(_settle, future, None, error)
        if self._on_failure is not None:
            loop.call_soon_threadsafe(self._on_failure, exc)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future, loop = item
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # returned to the caller, not fatal to the engine
                result, error = None, exc
            self._state_changed()
            loop.call_soon_threadsafe(_settle, future, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
