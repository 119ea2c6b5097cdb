"""Pinned prefixes: a decode engine's cached blocks of a prompt whose KV is on its way (a partial pull).

A decode worker about to pull a request's KV first asks its own prefix cache how many of the prompt's full
blocks it holds (under the request's cache salt) and pins them: one reference each, so no allocation can evict
them while the rest of the KV moves. The import then puts the pinned blocks in front of the pulled ones
(KvHandoff.import_: `pinned=` the pin's key) and the request owns their references; a pull that fails or is
cancelled gives them back (`unpin`). Every pin is a block list under a key, owned here, so the engine's integrity
check counts them as holders.

Only engines of one KV cache group with no sliding window and one process pin (a hybrid model's window groups
need the window's blocks too, a worker group writes on every rank): elsewhere `pin` finds nothing and the KV is
pulled whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.block_manager import BlockManager
from shared.engine.prefix_caching import PrefixCaching
from shared.prefix_hash import block_hashes, root_hash


class PrefixPins:
    def __init__(self, blocks: BlockManager, prefix: PrefixCaching | None, can_pin: bool) -> None:
        """`blocks`: the one KV cache group's block manager; `prefix`: None when prefix caching is off;
        `can_pin`: False where pins are not taken (the module doc)."""
        self.blocks, self.prefix = blocks, prefix
        self.can_pin = can_pin and prefix is not None and blocks.cache is not None
        self._pins: dict[str, list[int]] = {}  # key → the pinned blocks, the prompt's first ones in order

    def pin(self, key: str, prompt_token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Pin the cached blocks of the longest cached prefix of the prompt (never its last token's block, which
        a pull always carries); → the tokens they hold (0: none, nothing pinned). ValueError: `key` is pinned."""
        if key in self._pins:
            raise ValueError(f"a prefix is pinned under {key!r} already")
        if not self.can_pin:
            return 0
        assert self.prefix is not None and self.blocks.cache is not None
        block_size = self.blocks.block_size
        most = (len(prompt_token_ids) - 1) // block_size
        root = root_hash(self.prefix.namespace, cache_salt)
        held: list[int] = []
        for h in block_hashes(prompt_token_ids[: most * block_size], block_size, root):
            b = self.blocks.cache.block_of(h)
            if b is None:
                break
            held.append(b)
        if not held:
            return 0
        self.blocks.take_cached(held)
        self._pins[key] = held
        return len(held) * block_size

    def take(self, key: str) -> list[int]:
        """The blocks pinned under `key`, their references now the caller's ([] if none)."""
        return self._pins.pop(key, [])

    def unpin(self, key: str) -> bool:
        """Give back the references of the pin under `key` (the blocks are evictable again); False if none."""
        held = self._pins.pop(key, None)
        if held is None:
            return False
        self.blocks.free(held)
        return True

    def pinned(self) -> list[int]:
        """Every pinned block, once per pin holding it (the integrity check's holders)."""
        return [b for held in self._pins.values() for b in held]
