"""The gateway's prefix index (kv_index.py) and how the workers' numbered block updates keep it in step
(kv_sync.py): recorded update sequences, gaps, snapshots in parts, restarts, lost tail updates, dead workers."""

from __future__ import annotations

from services.gateway.kv_index import PrefixIndex
from services.gateway.kv_sync import SNAPSHOT_RETRY_S, IndexSync
from shared.messages import KvBlockEvents, KvBlockSnapshot
from shared.prefix_hash import block_hashes, root_hash

BS = 4


def events(seq: int, stored=(), removed=(), worker="w1", epoch="e1") -> KvBlockEvents:
    return KvBlockEvents(worker, epoch, seq, BS, removed=list(removed), stored=list(stored))


def snapshot(seq: int, hashes, part=0, parts=1, worker="w1", epoch="e1") -> KvBlockSnapshot:
    return KvBlockSnapshot(worker, epoch, seq, BS, part=part, parts=parts, hashes=list(hashes))


def synced() -> tuple[PrefixIndex, IndexSync]:
    index = PrefixIndex()
    return index, IndexSync(index)


def test_the_index_answers_the_leading_run_each_worker_holds():
    index = PrefixIndex()
    prompt = block_hashes(list(range(40)), BS, root_hash("m"))  # 10 blocks
    index.store("a", BS, prompt[:6])
    index.store("b", BS, prompt[:2] + prompt[3:10])  # block 2 missing: blocks past it are no use
    index.store("c", BS, prompt[5:])  # no first block: nothing usable
    assert index.prefix_blocks(prompt, ["a", "b", "c", "d"]) == {"a": 6, "b": 2, "c": 0, "d": 0}
    index.store("a", BS, prompt)
    assert index.prefix_blocks(prompt, ["a"]) == {"a": 10}
    index.remove("a", prompt[4:5])
    assert index.prefix_blocks(prompt, ["a", "b"]) == {"a": 4, "b": 2}
    index.drop("a")
    assert index.holders(prompt[0]) == {"b"} and index.workers() == {"b", "c"}
    index.replace("b", BS, [])
    assert index.holders(prompt[0]) == frozenset() and index.held("b") == frozenset()


def test_updates_in_order_from_the_first_are_applied_without_a_snapshot():
    index, sync = synced()
    sync.on_update(events(1, stored=[1, 2, 3]))
    sync.on_update(events(2, stored=[4], removed=[2]))
    sync.on_update(events(2, stored=[2]))  # a duplicate: ignored
    assert index.held("w1") == {1, 3, 4} and sync.in_step("w1")
    assert sync.wanted(now=0.0) == []


def test_a_gap_asks_for_a_snapshot_and_the_updates_past_it_are_applied_after_it():
    index, sync = synced()
    sync.on_update(events(1, stored=[1, 2]))
    sync.on_update(events(3, stored=[5]))  # update 2 was lost
    assert not sync.in_step("w1")
    assert sync.wanted(now=10.0) == ["w1"]
    assert sync.wanted(now=10.0 + SNAPSHOT_RETRY_S / 2) == []  # asked already: not again so soon
    sync.on_update(events(4, removed=[1]))
    # the worker answers: after update 3 it held 1, 2, 4 (update 2 stored 4) and 5
    sync.on_update(snapshot(3, [1, 2, 4, 5]))
    assert index.held("w1") == {2, 4, 5}  # update 4 (kept meanwhile) applied on top
    assert sync.in_step("w1") and sync.wanted(now=20.0) == []


def test_a_gateway_that_starts_late_learns_a_worker_from_its_snapshot_in_parts():
    index, sync = synced()
    sync.on_heartbeat("w1", "e1", seq=7)  # it has announced 7 updates this gateway never saw
    assert sync.wanted(now=0.0) == ["w1"]
    sync.on_update(events(8, stored=[9]))  # arrives before the answer
    sync.on_update(snapshot(7, [1, 2], part=1, parts=2))
    assert index.held("w1") == frozenset()  # half a snapshot is not applied
    sync.on_update(snapshot(7, [3], part=0, parts=2))
    assert index.held("w1") == {1, 2, 3, 9} and sync.in_step("w1")


def test_an_overflow_snapshot_in_the_numbering_replaces_everything():
    index, sync = synced()
    sync.on_update(events(1, stored=[1, 2]))
    sync.on_update(snapshot(2, [7, 8]))  # the worker's event log overflowed: update 2 is a snapshot
    sync.on_update(events(3, stored=[9]))
    assert index.held("w1") == {7, 8, 9} and sync.in_step("w1")


def test_a_restarted_worker_starts_afresh():
    index, sync = synced()
    sync.on_update(events(1, stored=[1, 2]))
    sync.on_update(events(1, stored=[5], epoch="e2"))  # a new incarnation: the old blocks are gone
    assert index.held("w1") == {5} and sync.in_step("w1")
    sync.on_heartbeat("w1", "e3", seq=0)  # another, that has announced nothing yet: it holds nothing
    assert index.held("w1") == frozenset() and sync.in_step("w1")


def test_an_update_lost_at_the_end_of_a_burst_is_noticed_by_the_next_beat():
    index, sync = synced()
    sync.on_update(events(1, stored=[1]))
    sync.on_heartbeat("w1", "e1", seq=2)  # update 2 may still be on its way
    assert sync.in_step("w1")
    sync.on_heartbeat("w1", "e1", seq=2)  # a beat later it has not come: lost
    assert not sync.in_step("w1") and sync.wanted(now=0.0) == ["w1"]
    sync.on_update(snapshot(2, [1, 3]))
    assert index.held("w1") == {1, 3} and sync.in_step("w1")


def test_a_worker_that_announces_nothing_is_not_asked():
    _, sync = synced()
    sync.on_heartbeat("decode-1", "", seq=0)
    assert sync.known() == set() and sync.wanted(now=0.0) == []


def test_a_dropped_worker_leaves_the_index_at_once_and_is_asked_afresh_when_heard_again():
    index, sync = synced()
    sync.on_update(events(1, stored=[1, 2]))
    sync.on_update(events(1, stored=[2, 3], worker="w2"))
    sync.drop("w1")
    assert index.holders(2) == {"w2"} and index.workers() == {"w2"}
    sync.on_heartbeat("w1", "e1", seq=1)  # back (a partition healed): its blocks come from a snapshot
    assert sync.wanted(now=0.0) == ["w1"]
