"""A request's KV sent layer by layer while its last prefill chunk still runs, and the first token after it.

The sender's side (`StreamedPoolKv`): a `PoolKv` over blocks whose KV is still being written. Its pieces are
those of the block-run cut (direct runs, or one gathered run per layer: never the flat cut, which needs the
whole KV first), in the same layer-major order, but layer l's are produced only once the forward pass has
written layer l (`LayerProgress.wait_layer`, shared/engine/layer_streams.py): the send thread posts layer l
while the engine computes layer l + 1. After the last layer one more piece follows: the **trailer**, the
request's first token as one int64, sent once it is sampled. The Pull reply says `layer_streamed`, and the
receiver appends a matching one-element buffer to its pieces (`receive_parts`): the pull completes, and
decode may begin, only when every layer and the first token arrived.

A stream that fails (the request aborted, its step raised, the holder stopped it, a layer not ready within
the send's timeout) raises out of `pieces` on the send thread: the server's send fails as any other (pair
dropped, the receiver's recv fails at once, the blocks freed by the holder) and decode recomputes or fails
per its kv_fallback. The shared-memory path does not stream: a streamed KV always goes over the pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.engine.kv_export import KVExport
from shared.engine.kv_pool import KVPool, block_runs
from shared.engine.layer_streams import LayerProgress, StreamStart
from shared.kv.transfer.pool_kv import MIN_SEGMENT_BYTES, Alloc, PoolKv
from shared.kv.transfer.wire import pieces, segments
from shared.rpc import kv_transfer_pb2 as pb

TRAILER_DTYPE = torch.int64  # the first token, one element, after the last layer


@dataclass
class StreamedPoolKv(PoolKv):
    """A PoolKv whose layers are sent as the forward pass completes them, then the first-token trailer."""

    progress: LayerProgress | None = None
    wait_s: float = 30.0  # the longest a piece waits for its layer (the server sets its timeout_s)

    @classmethod
    def of_stream(
        cls, pool: KVPool, start: StreamStart, alloc: Alloc, min_segment_bytes: int = MIN_SEGMENT_BYTES
    ) -> StreamedPoolKv:
        """The blocks of a stream that started: direct runs when long enough, else gathered layer by layer."""
        if pool.tensor.device.type != "cpu":
            raise ValueError("a layer-streamed send needs a pool in host memory")
        n = len(start.block_ids)
        segment_bytes = pool.segment(0, 0, 0, 1).nbytes
        direct = segment_bytes * n / len(block_runs(start.block_ids)) >= min_segment_bytes
        shape = (pool.tensor.shape[0], pool.num_planes, n, *pool.tensor.shape[3:])
        staging = None if direct else alloc(shape, pool.tensor.dtype)
        mode = "direct" if direct else "layered"
        return cls(
            pool.layout, start.num_tokens, pool, start.block_ids, mode, staging, first_block=0, progress=start.progress
        )

    def num_pieces(self, chunk_bytes: int) -> int:
        return super().num_pieces(chunk_bytes) + 1  # the trailer

    def pieces(self, chunk_bytes: int) -> Iterator[torch.Tensor]:
        assert self.progress is not None
        if self.mode == "layered":
            assert self.staging is not None
            for layer in range(self.shape[0]):
                self.progress.wait_layer(layer, self.wait_s)
                gathered = self.pool.read_layer(layer, self.block_ids, out=self.staging[layer])
                for plane in range(self.shape[1]):
                    yield from pieces(gathered[plane], chunk_bytes)
        else:
            runs, waited = block_runs(self.block_ids), -1
            for layer, plane, i, _ in segments(self.shape[0], self.shape[1], self.runs):
                if layer != waited:
                    self.progress.wait_layer(layer, self.wait_s)
                    waited = layer
                first, count = runs[i]
                yield from pieces(self.pool.segment(layer, plane, first, count), chunk_bytes)
        yield torch.tensor([self.progress.wait_token(self.wait_s)], dtype=TRAILER_DTYPE)

    def copy_into(self, out: torch.Tensor, streaming: bool = False) -> None:
        raise NotImplementedError("a layer-streamed KV goes over the pair, not through shared memory")


@dataclass
class StreamedKv(KVExport):
    """A pulled KV that was streamed: the blocks, and the first token the prefill sampled (its trailer)."""

    first_token: int = -1


def receive_parts(parts: list[torch.Tensor], reply: pb.PullReply) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The receiver's pieces plus the trailer's buffer when the reply announces a layer-streamed send."""
    if not reply.layer_streamed:
        return parts, None
    trailer = torch.empty(1, dtype=TRAILER_DTYPE)
    return [*parts, trailer], trailer
