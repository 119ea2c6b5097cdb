"""Rank agents: the leader calls named handlers on any rank of its group, outside the step loop.

Every rank (leader included) has a `RankAgent`: async handlers registered by name, `handler(payload) -> result`
(both picklable). The leader's agent runs its handlers on the caller's event loop (the worker's); a follower's
runs them on an asyncio loop of its own, in a side thread (`serve_in_thread`), fed by its "agent" channel
(channel.py). The leader reaches all of them through `GroupAgents.call(rank, name, payload)` / `call_all`.

A handler that must change the pool does not touch it (the step loop owns it): it stages data, and an op of
the op stream applies it between steps (ops.py). `StagedKv` is that staging for imported KV: each rank stages
the KV heads it pulled itself under a key; the leader's import then writes them into the same blocks on every
rank (`import_staged`). Reads of blocks no step writes (held, pinned blocks) may run on the agent thread.

Events go the other way: `RankAgent.notify(name, payload)` reports something to the leader without being asked
(a prefill rank's KV send that ended). A follower's notify sends a frame on its "events" channel; the leader's
`GroupAgents.on_event(name, handler)` runs `handler(rank, payload)` on the leader's loop for each, its own
rank's notifications included (called directly).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine.kv_export import KVExport
from shared.ranklink.channel import recv_frame, send_frame

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]


class AgentError(RuntimeError):
    """A handler raised on its rank (the message names the rank, the handler and the error)."""


@dataclass
class StagedExport(KVExport):
    """An import whose data each rank staged under `key` (the leader's own staged export describes it)."""

    key: str = ""


class StagedKv:
    """key → this rank's part of an imported request's KV, until the import op takes it. Thread-safe (staged on
    the agent thread, taken on the step loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, KVExport] = {}

    def stage(self, key: str, kv: KVExport) -> None:
        with self._lock:
            self._by_key[key] = kv

    def ref(self, key: str) -> StagedExport:
        """What the leader's `Engine.import_kv` takes to import the staged `key` on every rank."""
        with self._lock:
            kv = self._by_key[key]
        return StagedExport(kv.layout, kv.num_tokens, kv.blocks, key, first_block=kv.first_block)

    def take(self, key: str) -> KVExport:
        with self._lock:
            kv = self._by_key.pop(key, None)
        if kv is None:
            raise KeyError(f"no KV staged under {key!r} on this rank")
        return kv

    def drop(self, key: str) -> bool:
        with self._lock:
            return self._by_key.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


EventHandler = Callable[[int, Any], Awaitable[None]]  # (the reporting rank, payload)


class RankAgent:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._handlers: dict[str, Handler] = {}
        # where notify() goes: a follower's "events" channel, or (the leader) its GroupAgents' dispatch
        self._notify: Callable[[str, Any], Awaitable[None]] | None = None

    def events_to(self, channel: socket.socket) -> None:
        """A follower: notify() sends on `channel` (the leader's GroupAgents reads it)."""
        sending = threading.Lock()

        async def send(name: str, payload: Any) -> None:
            with sending:
                send_frame(channel, (name, payload))

        self._notify = send

    async def notify(self, name: str, payload: Any) -> None:
        """Report `name` to the leader (its `on_event` handler). OSError: the leader is gone."""
        if self._notify is None:
            raise RuntimeError(f"rank {self.rank}'s agent has nowhere to send events")
        await self._notify(name, payload)

    def register(self, name: str, handler: Handler, replace: bool = False) -> None:
        """replace: a handler set up again (a worker that switched role and back sets up its KV puller anew)."""
        if name in self._handlers and not replace:
            raise ValueError(f"handler {name!r} is already registered on rank {self.rank}")
        self._handlers[name] = handler

    async def handle(self, name: str, payload: Any) -> Any:
        handler = self._handlers.get(name)
        if handler is None:
            raise AgentError(f"rank {self.rank} has no handler {name!r}")
        return await handler(payload)

    def serve_in_thread(self, channel: socket.socket) -> threading.Thread:
        """A follower: answer the leader's calls on `channel` in a daemon thread with its own event loop, until
        the channel closes."""
        thread = threading.Thread(target=asyncio.run, args=(self._serve(channel),), name="rank-agent", daemon=True)
        thread.start()
        return thread

    async def _serve(self, channel: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sending = threading.Lock()
        tasks: set[asyncio.Task] = set()
        while True:
            frame = await loop.run_in_executor(None, recv_frame, channel)
            if frame is None:
                return
            call_id, name, payload = frame
            task = asyncio.ensure_future(self._answer(channel, sending, call_id, name, payload))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _answer(self, channel: socket.socket, sending: threading.Lock, call_id: int, name: str, payload: Any):
        try:
            reply = (call_id, True, await self.handle(name, payload))
        except Exception as exc:  # the caller gets it; the agent serves on
            reply = (call_id, False, f"{type(exc).__name__}: {exc}")
        with sending:
            try:
                send_frame(channel, reply)
            except OSError:
                log.warning("rank %d: the leader's agent channel is gone", self.rank)


class GroupAgents:
    """The leader's handle on every rank's agent. One call in flight per follower at a time (its channel is a
    request/reply pipe); different ranks are called concurrently."""

    def __init__(
        self, local: RankAgent, channels: dict[int, socket.socket], events: dict[int, socket.socket] | None = None
    ) -> None:
        self.local = local  # rank 0's own agent
        self._channels = channels  # follower rank → its agent channel
        self._events = events or {}  # follower rank → its events channel
        self._locks = {rank: threading.Lock() for rank in channels}
        self._next_id = 0
        self._event_handlers: dict[str, EventHandler] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None
        local._notify = lambda name, payload: self._dispatch(0, name, payload)

    def on_event(self, name: str, handler: EventHandler, replace: bool = False) -> None:
        """Run `handler(rank, payload)` on the calling (running) loop for every rank's notify(name, ...). The
        first call starts one reader thread per follower's events channel. replace: the role that handled it
        before is gone (a switch back to it sets its KV hand-off up anew)."""
        if name in self._event_handlers and not replace:
            raise ValueError(f"an event handler for {name!r} is registered already")
        self._event_handlers[name] = handler
        if self._event_loop is None:
            self._event_loop = asyncio.get_running_loop()
            for rank, sock in self._events.items():
                threading.Thread(
                    target=self._read_events, args=(rank, sock), name=f"events-r{rank}", daemon=True
                ).start()

    async def _dispatch(self, rank: int, name: str, payload: Any) -> None:
        handler = self._event_handlers.get(name)
        if handler is None:
            log.warning("rank %d reported %r, which no handler takes", rank, name)
            return
        await handler(rank, payload)

    def _read_events(self, rank: int, sock: socket.socket) -> None:
        loop = self._event_loop
        assert loop is not None  # set before the readers start
        while (frame := recv_frame(sock)) is not None:  # None: the rank is gone (the watch handles that)
            name, payload = frame
            try:
                asyncio.run_coroutine_threadsafe(self._logged(rank, name, payload), loop)
            except RuntimeError:  # the loop is closed: the worker is stopping
                return

    async def _logged(self, rank: int, name: str, payload: Any) -> None:
        try:
            await self._dispatch(rank, name, payload)
        except Exception:
            log.exception("handling rank %d's event %r failed", rank, name)

    @property
    def ranks(self) -> list[int]:
        return [0, *sorted(self._channels)]

    async def call(self, rank: int, name: str, payload: Any = None) -> Any:
        """Run handler `name` on `rank`; its result, or AgentError for what it raised / a rank that is gone."""
        if rank == 0:
            return await self.local.handle(name, payload)
        if rank not in self._channels:
            raise AgentError(f"the group has no rank {rank}")
        self._next_id += 1
        return await asyncio.to_thread(self._call_blocking, rank, self._next_id, name, payload)

    async def call_all(self, name: str, payloads_by_rank: dict[int, Any]) -> dict[int, Any]:
        """Handler `name` on each rank of `payloads_by_rank` with its payload, concurrently; results by rank."""
        ranks = list(payloads_by_rank)
        results = await asyncio.gather(*(self.call(r, name, payloads_by_rank[r]) for r in ranks))
        return dict(zip(ranks, results, strict=True))

    def _call_blocking(self, rank: int, call_id: int, name: str, payload: Any) -> Any:
        sock = self._channels[rank]
        with self._locks[rank]:
            try:
                send_frame(sock, (call_id, name, payload))
            except OSError as exc:
                raise AgentError(f"rank {rank} is gone ({exc!r})") from exc
            reply = recv_frame(sock)
        if reply is None:
            raise AgentError(f"rank {rank} is gone (its agent channel closed during {name!r})")
        got_id, ok, result = reply
        if got_id != call_id:
            raise AgentError(f"rank {rank} answered call {got_id}, expected {call_id}")
        if not ok:
            raise AgentError(f"rank {rank}: {name!r} failed: {result}")
        return result


def pool_digest(tensor: torch.Tensor) -> str:
    """sha256 of a pool's bytes (the group's replicated-pool check; read while no step runs)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
