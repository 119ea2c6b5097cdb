"""The server's record of one decode worker's pair (`Slot`): being joined or ready, its shared segment, and
the tags the server hands out on it.

Tags below posted.POSTED_TAG_BASE are the server's (`reserve_tags`); those from there up are the decode
side's, for receives it posts before its Pull (posted.py), so no two transfers in flight share one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.kv.transfer.pair import Pair
from shared.kv.transfer.posted import POSTED_TAG_BASE
from shared.kv.transfer.shm import Segment


@dataclass
class Slot:
    """A decode worker's pair as the server knows it: being joined, or ready."""

    worker_id: str
    pair_id: str
    joining: asyncio.Future[Pair]
    segment: Segment | None = None  # same host: the pair's shared memory (unlinked once the pair formed)
    next_tag: int = 1

    def reserve_tags(self, count: int) -> int:
        """The first of `count` consecutive tags no transfer in flight on this pair uses."""
        if self.next_tag + count > POSTED_TAG_BASE:  # wrapping is safe: tags only need to differ in flight
            self.next_tag = 1
        first, self.next_tag = self.next_tag, self.next_tag + count
        return first

    def retire(self) -> None:
        """Close the pair once it has formed (now if it has): transfers in flight on it end first."""
        if self.segment is not None:
            self.segment.unlink()
        if self.joining.done():
            _close_joined(self.joining)
        else:
            self.joining.add_done_callback(_close_joined)


def _close_joined(joining: asyncio.Future[Pair]) -> None:
    if not joining.cancelled() and joining.exception() is None:
        joining.result().close()
