"""A worker's prefix-cache block announcements (shared/worker/block_announcer.py) against a fake engine with the
prefix-cache API (prefix_cache_events / prefix_cache_hashes) and a recording NATS client: numbered updates in
bounded messages, a snapshot in the numbering after an overflow, snapshot answers to the gateway that asks — and
a gateway's index (kv_sync.py) fed those messages ends up holding exactly what the engine holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.gateway.kv_index import PrefixIndex
from services.gateway.kv_sync import IndexSync
from shared.messages import (
    KV_HASHES_PER_MESSAGE,
    KvBlockEvents,
    KvBlockSnapshot,
    KvSnapshotRequest,
    decode_kv_blocks_or_drop,
    encode,
    kv_snapshot_subject,
)
from shared.worker.block_announcer import BlockAnnouncer, announces_blocks
from tests.prefix_engine import FakePrefixEngine


@dataclass
class Sent:
    subject: str
    data: bytes


class RecordingNats:
    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.subscriptions: dict[str, object] = {}

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append(Sent(subject, data))

    async def subscribe(self, subject: str, cb) -> None:
        self.subscriptions[subject] = cb


@dataclass
class Request:
    data: bytes
    reply: str
    subject: str = kv_snapshot_subject("m")


def announcer(engine: FakePrefixEngine) -> tuple[BlockAnnouncer, RecordingNats]:
    nc = RecordingNats()

    async def call(fn):
        return fn(engine)

    return BlockAnnouncer(nc, call, "m", "p1", block_size=16), nc  # type: ignore[arg-type]


def updates(nc: RecordingNats, subject: str | None = None) -> list[KvBlockEvents | KvBlockSnapshot]:
    out = [decode_kv_blocks_or_drop(s.data, s.subject) for s in nc.sent if subject is None or s.subject == subject]
    assert all(u is not None for u in out)
    return out  # type: ignore[return-value]


def test_changes_go_out_numbered_removed_before_stored_and_bounded_per_message():
    async def scenario():
        engine = FakePrefixEngine()
        a, nc = announcer(engine)
        await a.announce()
        assert nc.sent == []  # nothing changed: nothing sent, no number used
        engine.cache(1, 2, 3)
        await a.announce()
        many = list(range(100, 100 + KV_HASHES_PER_MESSAGE + 10))
        engine.evict(2)
        engine.cache(*many)
        await a.announce()
        sent = updates(nc)
        assert all(s.subject == "pd.kv.blocks.m.p1" for s in nc.sent)
        assert [u.seq for u in sent] == [1, 2, 3] and a.seq == 3
        assert all(isinstance(u, KvBlockEvents) and u.epoch == a.epoch and u.block_size == 16 for u in sent)
        assert sent[0].stored == [1, 2, 3]
        assert sent[1].removed == [2] and sent[1].stored == many[: KV_HASHES_PER_MESSAGE - 1]
        assert sent[2].stored == many[KV_HASHES_PER_MESSAGE - 1 :]
        assert max(len(u.stored) + len(u.removed) for u in sent) <= KV_HASHES_PER_MESSAGE

    asyncio.run(scenario())


def test_an_overflow_sends_a_snapshot_in_the_numbering():
    async def scenario():
        engine = FakePrefixEngine()
        a, nc = announcer(engine)
        engine.cache(1, 2)
        await a.announce()
        engine.cache(3)
        engine.evict(1)
        engine.overflowed = True  # the engine lost track of some changes
        await a.announce()
        first, second = updates(nc)
        assert isinstance(second, KvBlockSnapshot) and second.seq == 2 and second.hashes == [2, 3]

    asyncio.run(scenario())


def test_a_snapshot_request_is_answered_to_its_reply_subject_after_the_pending_changes():
    async def scenario():
        engine = FakePrefixEngine()
        a, nc = announcer(engine)
        await a.start()
        ask = nc.subscriptions[kv_snapshot_subject("m")]
        engine.cache(*range(KV_HASHES_PER_MESSAGE + 5))
        await a.announce()
        engine.cache(9_999_999)  # not announced yet when the request comes
        await ask(Request(encode(KvSnapshotRequest(["other"])), "_INBOX.gw"))
        assert len(nc.sent) == 2  # the request names another worker: no answer
        await ask(Request(encode(KvSnapshotRequest()), "_INBOX.gw"))
        broadcast, answer = updates(nc, "pd.kv.blocks.m.p1"), updates(nc, "_INBOX.gw")
        assert broadcast[-1].seq == 3 and broadcast[-1].stored == [9_999_999]  # everyone's copy stays in step
        assert [(p.seq, p.part, p.parts) for p in answer] == [(3, 0, 2), (3, 1, 2)]
        assert sorted(h for p in answer for h in p.hashes) == sorted(engine.held)

    asyncio.run(scenario())


def test_a_late_gateway_fed_the_messages_holds_what_the_engine_holds():
    async def scenario():
        engine = FakePrefixEngine()
        a, nc = announcer(engine)
        await a.start()
        engine.cache(*range(50))
        await a.announce()
        engine.evict(*range(10))
        await a.announce()
        index = PrefixIndex()
        sync = IndexSync(index)  # starts now: it missed updates 1 and 2
        sync.on_heartbeat("p1", a.epoch, a.seq)
        assert sync.wanted(now=0.0) == ["p1"]
        engine.cache(77)
        await nc.subscriptions[kv_snapshot_subject("m")](Request(encode(KvSnapshotRequest(["p1"])), "_INBOX.gw"))
        engine.evict(20)
        await a.announce()
        for u in updates(nc)[2:]:  # the update sent with the answer, the answer, the next update
            sync.on_update(u)
        assert sync.in_step("p1") and index.held("p1") == engine.held

    asyncio.run(scenario())


def test_an_engine_without_a_prefix_cache_announces_nothing():
    class Plain:
        pass

    assert announces_blocks(FakePrefixEngine()) and not announces_blocks(Plain())
