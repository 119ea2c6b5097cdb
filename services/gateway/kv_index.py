"""Which worker holds which prefix-cache block: the index KV-aware routing reads (kv_router.py).

Pure state, torch-free: block hash → the workers holding it, and per worker its hashes and the block size they
are hashed at (shared/prefix_hash.py). kv_sync.py feeds it from the workers' block updates in their order; a
worker leaves it at once when it dies or drains (`drop`). Every gateway builds the same index from the same
updates: nothing in it is this gateway's own.
"""

from __future__ import annotations

from collections.abc import Iterable


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash → workers holding it (never an empty set)
        self._held: dict[str, set[int]] = {}  # worker → its hashes (the same facts, the other way round)
        self._block_size: dict[str, int] = {}  # worker → tokens per hashed block

    def store(self, worker_id: str, block_size: int, hashes: Iterable[int]) -> None:
        self._block_size[worker_id] = block_size
        held = self._held.setdefault(worker_id, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(worker_id)
        if held is None:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                self._unhold(h, worker_id)

    def replace(self, worker_id: str, block_size: int, hashes: Iterable[int]) -> None:
        """The worker holds exactly `hashes` now (a snapshot)."""
        self.drop(worker_id)
        self.store(worker_id, block_size, hashes)

    def drop(self, worker_id: str) -> None:
        """Forget the worker and every block it held."""
        for h in self._held.pop(worker_id, ()):
            self._unhold(h, worker_id)
        self._block_size.pop(worker_id, None)

    def _unhold(self, h: int, worker_id: str) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]

    def workers(self) -> set[str]:
        return set(self._held)

    def block_size(self, worker_id: str) -> int | None:
        return self._block_size.get(worker_id)

    def held(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._held.get(worker_id, ()))

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, ()))

    def __len__(self) -> int:
        """Distinct blocks held by some worker."""
        return len(self._holders)

    def prefix_blocks(self, hashes: Iterable[int], workers: Iterable[str]) -> dict[str, int]:
        """For each of `workers`: how many of the prompt's leading blocks (`hashes`, in order, at that worker's
        block size) it holds in a row. A block past a missing one is no use: its K/V depends on every token
        before it, so the engine can only reuse a leading run. `hashes` is read only as far as some worker
        holds every block so far (a lazy iterable saves hashing the rest)."""
        counts = dict.fromkeys(workers, 0)
        still = set(counts)  # workers that hold every block so far
        for h in hashes:
            if not still:
                break
            holders = self._holders.get(h)
            still = still & holders if holders else set()
            for w in still:
                counts[w] += 1
        return counts
