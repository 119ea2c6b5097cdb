"""HeldKv, transition by transition: a fake engine side, an in-memory registry, a real loop with short leases.

Each test checks the three things a transition moves: the state, the engine's release (exactly once per
key) and the Redis entry (written on hold, deleted on the free).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from shared.kv.held import Freed, HeldKv, HeldState
from shared.kv.registry import KvLocation
from shared.kv.transfer.source import AlreadySending
from shared.messages import Cancel

LEASE_S = 0.05  # short enough to expire within a test
LONG_S = 60.0  # never expires within a test


class FakeBlocks:
    """The engine side: pinned keys, releases counted; an export may be made to wait or to fail."""

    layout = "layout"

    def __init__(self) -> None:
        self.pinned: set[str] = set()
        self.releases: Counter[str] = Counter()
        self.exports: Counter[str] = Counter()
        self.gate: asyncio.Event | None = None  # set: exports wait for it
        self.export_error: Exception | None = None

    def pin(self, *keys: str) -> None:
        self.pinned.update(keys)

    async def export_kv(self, key: str) -> str:
        assert key in self.pinned, f"export of {key} after its blocks were freed"
        self.exports[key] += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.export_error is not None:
            raise self.export_error
        return f"kv-of-{key}"

    async def release_kv(self, key: str) -> None:
        self.releases[key] += 1
        self.pinned.discard(key)


class FakeRegistry:
    """Redis in memory; put/delete can be made to fail, put to wait."""

    def __init__(self) -> None:
        self.entries: dict[str, KvLocation] = {}
        self.fail_put = self.fail_delete = False
        self.put_gate: asyncio.Event | None = None

    async def put(self, loc: KvLocation) -> None:
        if self.put_gate is not None:
            await self.put_gate.wait()
        if self.fail_put:
            raise ConnectionError("redis is away")
        self.entries[loc.request_id] = loc

    async def delete(self, request_id: str) -> None:
        if self.fail_delete:
            raise ConnectionError("redis is away")
        self.entries.pop(request_id, None)


def _held(lease_s: float = LONG_S) -> tuple[HeldKv, FakeBlocks, FakeRegistry]:
    blocks, registry = FakeBlocks(), FakeRegistry()
    return HeldKv(blocks, lease_s, registry=registry), blocks, registry


async def _hold(held: HeldKv, blocks: FakeBlocks, key: str, request_id: str = "r", attempt: int = 0) -> bool:
    blocks.pin(key)
    return await held.hold(key, request_id, attempt, KvLocation(key, "prefill-1", "host:1", 40, "fp"))


async def _settle(seconds: float = 0.0) -> None:
    """Let timers and the tasks they start run."""
    await asyncio.sleep(seconds)
    for _ in range(5):
        await asyncio.sleep(0)


def _assert_freed(held: HeldKv, blocks: FakeBlocks, registry: FakeRegistry, key: str) -> None:
    assert held.state(key) is HeldState.FREED
    assert key not in held.keys()
    assert blocks.releases[key] == 1  # exactly once
    assert key not in registry.entries


def test_hold_then_pull_frees_once_and_deletes_the_entry():
    async def run():
        held, blocks, registry = _held(LEASE_S)
        assert await _hold(held, blocks, "r#0")
        assert held.state("r#0") is HeldState.HELD and held.count() == 1
        assert registry.entries["r#0"].worker_id == "prefill-1"
        assert await held.begin_send("r#0") == "kv-of-r#0"
        assert held.state("r#0") is HeldState.SENDING and held.is_sending("r#0") and held.count() == 1
        assert blocks.releases["r#0"] == 0 and "r#0" in registry.entries  # nothing freed mid-send
        await held.end_send("r#0", ok=True)
        _assert_freed(held, blocks, registry, "r#0")
        assert held.count() == 0 and held.freed == Counter({Freed.PULLED: 1})
        await _settle(3 * LEASE_S)  # the lease timer was cancelled: its expiry frees nothing again
        assert blocks.releases["r#0"] == 1 and held.freed == Counter({Freed.PULLED: 1})

    asyncio.run(run())


def test_lease_expiry_frees_a_held_key(caplog):
    caplog.set_level(logging.WARNING, logger="shared.kv.held")

    async def run():
        held, blocks, registry = _held(LEASE_S)
        assert await _hold(held, blocks, "r#0")
        await _settle(LEASE_S / 3)
        assert held.state("r#0") is HeldState.HELD and blocks.releases["r#0"] == 0
        await _settle(LEASE_S)
        _assert_freed(held, blocks, registry, "r#0")
        assert held.freed == Counter({Freed.LEASE_EXPIRED: 1})
        with pytest.raises(KeyError, match="no KV held for request 'r#0'"):
            await held.begin_send("r#0")  # a late pull finds nothing (NOT_FOUND)

    asyncio.run(run())
    assert "expired before any pull" in caplog.text


def test_lease_expiry_during_a_send_waits_for_the_send_to_end():
    async def run():
        held, blocks, registry = _held(LEASE_S)
        assert await _hold(held, blocks, "r#0")
        await held.begin_send("r#0")
        await _settle(3 * LEASE_S)  # the lease ran out mid-send: the blocks stay pinned, the entry stays
        assert held.state("r#0") is HeldState.SENDING
        assert blocks.releases["r#0"] == 0 and "r#0" in blocks.pinned and "r#0" in registry.entries
        await held.end_send("r#0", ok=True)
        _assert_freed(held, blocks, registry, "r#0")
        assert held.freed == Counter({Freed.PULLED: 1})

    asyncio.run(run())


def test_lease_expiry_during_an_export_that_fails_frees_instead_of_holding_again():
    async def run():
        held, blocks, registry = _held(LEASE_S)
        assert await _hold(held, blocks, "r#0")
        blocks.gate, blocks.export_error = asyncio.Event(), RuntimeError("engine refused")
        send = asyncio.create_task(held.begin_send("r#0"))
        await _settle(3 * LEASE_S)  # the lease ends while the export is out
        assert held.state("r#0") is HeldState.SENDING and blocks.releases["r#0"] == 0
        blocks.gate.set()
        with pytest.raises(RuntimeError, match="engine refused"):
            await send
        await _settle()
        _assert_freed(held, blocks, registry, "r#0")  # not back to HELD with no lease left
        assert held.freed == Counter({Freed.LEASE_EXPIRED: 1})

    asyncio.run(run())


def test_a_failed_export_leaves_the_kv_held_and_pullable():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        blocks.export_error = RuntimeError("engine refused")
        with pytest.raises(RuntimeError):
            await held.begin_send("r#0")
        assert held.state("r#0") is HeldState.HELD and blocks.releases["r#0"] == 0 and "r#0" in registry.entries
        blocks.export_error = None
        assert await held.begin_send("r#0") == "kv-of-r#0"
        await held.end_send("r#0", ok=True)
        _assert_freed(held, blocks, registry, "r#0")

    asyncio.run(run())


def test_cancel_frees_the_covered_attempts_only():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0", "r", 0)
        assert await _hold(held, blocks, "r#1", "r", 1)
        assert await _hold(held, blocks, "q#0", "q", 0)
        assert await held.cancel("r", Cancel("r", up_to_attempt=0).covers) == 1
        _assert_freed(held, blocks, registry, "r#0")
        assert held.state("r#1") is HeldState.HELD and held.state("q#0") is HeldState.HELD
        assert await held.cancel("r", Cancel("r").covers) == 1  # every attempt
        _assert_freed(held, blocks, registry, "r#1")
        assert held.keys() == ["q#0"] and blocks.releases["q#0"] == 0 and "q#0" in registry.entries
        assert held.freed == Counter({Freed.CANCELLED: 2})

    asyncio.run(run())


def test_cancel_during_a_send_frees_when_the_send_ends():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        await held.begin_send("r#0")
        assert await held.cancel("r", Cancel("r").covers) == 1
        assert held.state("r#0") is HeldState.SENDING  # the send owns the blocks until it ends
        assert blocks.releases["r#0"] == 0 and "r#0" in blocks.pinned
        await held.end_send("r#0", ok=True)
        _assert_freed(held, blocks, registry, "r#0")

    asyncio.run(run())


def test_cancel_during_an_export_that_fails_frees_it():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        blocks.gate, blocks.export_error = asyncio.Event(), RuntimeError("engine refused")
        send = asyncio.create_task(held.begin_send("r#0"))
        await _settle()
        await held.cancel("r", Cancel("r").covers)
        assert blocks.releases["r#0"] == 0
        blocks.gate.set()
        with pytest.raises(RuntimeError):
            await send
        await _settle()
        _assert_freed(held, blocks, registry, "r#0")
        assert held.freed == Counter({Freed.CANCELLED: 1})

    asyncio.run(run())


def test_a_failed_send_frees_the_kv():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        await held.begin_send("r#0")
        await held.end_send("r#0", ok=False)
        _assert_freed(held, blocks, registry, "r#0")  # as today: decode recomputes, nothing stays pinned
        assert held.freed == Counter({Freed.SEND_FAILED: 1})
        with pytest.raises(KeyError):
            await held.begin_send("r#0")

    asyncio.run(run())


def test_a_second_pull_of_a_key_being_sent_is_refused():
    async def run():
        held, blocks, _ = _held()
        assert await _hold(held, blocks, "r#0")
        await held.begin_send("r#0")
        with pytest.raises(AlreadySending, match="already being pulled"):
            await held.begin_send("r#0")
        assert blocks.exports["r#0"] == 1 and held.state("r#0") is HeldState.SENDING
        with pytest.raises(KeyError):
            await held.begin_send("never-held")

    asyncio.run(run())


def test_release_twice_and_late_ends_are_harmless():
    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        await held.release("r#0")
        await held.release("r#0")
        await held.end_send("r#0", ok=True)
        await held.release("never-held")
        _assert_freed(held, blocks, registry, "r#0")
        assert held.freed == Counter({Freed.CANCELLED: 1})
        assert await _hold(held, blocks, "q#0")
        with pytest.raises(ValueError, match="held already"):  # a key is held once at a time
            await _hold(held, blocks, "q#0")

    asyncio.run(run())


def test_a_freed_key_held_again_keeps_its_new_lease():
    async def run():
        held, blocks, registry = _held(0.4)
        assert await _hold(held, blocks, "r#0")
        await held.release("r#0")  # its lease timer is cancelled with it
        await _settle(0.2)
        assert await _hold(held, blocks, "r#0")  # the same key again (its new lease ends at ~0.6 s)
        await _settle(0.3)  # past the first lease's end
        assert held.state("r#0") is HeldState.HELD and blocks.releases["r#0"] == 1
        await _settle(0.2)
        assert held.state("r#0") is HeldState.FREED and blocks.releases["r#0"] == 2
        assert held.freed == Counter({Freed.CANCELLED: 1, Freed.LEASE_EXPIRED: 1})

    asyncio.run(run())


def test_release_all_frees_every_key_whatever_its_state():
    async def run():
        held, blocks, registry = _held(LEASE_S)
        for key in ("a#0", "b#0", "c#0"):
            assert await _hold(held, blocks, key, key[0])
        await held.begin_send("b#0")
        await held.release_all()
        for key in ("a#0", "b#0", "c#0"):
            _assert_freed(held, blocks, registry, key)
        assert held.count() == 0 and held.freed == Counter({Freed.SHUTDOWN: 3})
        await held.end_send("b#0", ok=True)  # the send ending afterwards frees nothing twice
        await _settle(3 * LEASE_S)  # nor do the lease timers
        assert blocks.releases == Counter({"a#0": 1, "b#0": 1, "c#0": 1})

    asyncio.run(run())


def test_a_failed_redis_write_means_not_held(caplog):
    caplog.set_level(logging.WARNING, logger="shared.kv.held")

    async def run():
        held, blocks, registry = _held(LEASE_S)
        registry.fail_put = True
        assert not await _hold(held, blocks, "r#0")
        _assert_freed(held, blocks, registry, "r#0")  # the blocks go back at once: nobody could find them
        assert held.count() == 0 and held.freed == Counter({Freed.NOT_RECORDED: 1})
        await _settle(3 * LEASE_S)
        assert blocks.releases["r#0"] == 1

    asyncio.run(run())
    assert "decode will recompute" in caplog.text


@pytest.mark.parametrize("put_fails", [False, True])
def test_a_cancel_during_the_redis_write_leaves_no_entry_and_frees_once(put_fails):
    async def run():
        held, blocks, registry = _held()
        registry.put_gate, registry.fail_put = asyncio.Event(), put_fails
        holding = asyncio.create_task(_hold(held, blocks, "r#0"))
        await _settle()
        assert held.state("r#0") is HeldState.HELD  # counted (and cancellable) from the start
        await held.cancel("r", Cancel("r").covers)
        registry.put_gate.set()
        assert not await holding
        _assert_freed(held, blocks, registry, "r#0")

    asyncio.run(run())


def test_a_failed_redis_delete_still_frees_the_blocks(caplog):
    caplog.set_level(logging.WARNING, logger="shared.kv.held")

    async def run():
        held, blocks, registry = _held()
        assert await _hold(held, blocks, "r#0")
        registry.fail_delete = True
        await held.release("r#0")
        assert held.state("r#0") is HeldState.FREED and blocks.releases["r#0"] == 1
        assert "r#0" in registry.entries  # left to its TTL

    asyncio.run(run())
    assert "could not delete the KV location" in caplog.text


def test_settings_are_checked():
    with pytest.raises(ValueError, match="lease_s"):
        HeldKv(FakeBlocks(), 0)

    async def run():
        with pytest.raises(ValueError, match="location"):
            await HeldKv(FakeBlocks(), LONG_S, registry=FakeRegistry()).hold("r#0", "r", 0)

    asyncio.run(run())
