"""A request's KV leaving or entering an engine: export, the blocks a sender reads in place, release, import,
and the layer-streamed send's hook.

`KvHandoff` works on the engine's own state (its live requests, scheduler, KV cache, grammar matchers), which it
is handed and shares with the step loop; like the engine it runs on the engine's one thread, between steps.
The prefill side exports (or lends, or streams) a request that finished holding its KV and releases it once
the hand-off ends; the decode side imports it and the request decodes on from its first sampled token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shared.engine.block_manager import FREED, NoFreeBlocksError
from shared.engine.dp_blocks import DpBlockManager
from shared.engine.kv_cache import KvCache
from shared.engine.kv_export import KVExport, KVPart
from shared.engine.layer_streams import LayerStreams, OnStart
from shared.engine.prefix_pins import PrefixPins
from shared.engine.request import GroupTable, PromptLimits, Request, RequestStatus
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.structured import StructuredDecoding

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) → memory to copy into


class KvHandoff:
    def __init__(
        self,
        kv: KvCache,
        scheduler: Scheduler,
        requests: dict[str, Request],
        structured: StructuredDecoding,
        layer_streams: LayerStreams,
        limits: PromptLimits,
        max_num_seqs: int,
        world: int,
    ) -> None:
        """`requests`: the engine's live requests (the same dict, written by both); `world`: the ranks of the
        engine's worker group (1: one process)."""
        self.kv, self.scheduler, self.requests = kv, scheduler, requests
        self.structured, self.layer_streams, self.limits = structured, layer_streams, limits
        self.max_num_seqs, self.world = max_num_seqs, world
        # cached prompt blocks held for imports on their way (partial pulls): one group, no window, one process
        one_group = len(kv.pools) == 1 and not kv.layout.layer_windows and world == 1
        self.pins = PrefixPins(kv.blocks[0], scheduler.prefix, can_pin=one_group)

    # ---- out --------------------------------------------------------------------------------------------

    def export(self, request_id: str, alloc: Alloc | None = None) -> KVExport:
        """Copy out the KV of a request that is decoding or finished holding its KV. No state changes.
        `alloc(shape, dtype)` supplies the memory to copy into (e.g. a reused buffer). Several KV cache groups:
        each group's held blocks, concatenated flat (KVExport.parts)."""
        layout, pools = self.kv.layout, self.kv.pools
        num_tokens, held = self.group_blocks(request_id)
        if len(held) == 1:
            first, block_ids = held[0]
            out = None if alloc is None else alloc(layout.block_shape(len(block_ids)), layout.torch_dtype)
            return KVExport(layout, num_tokens, self.kv.pool.read(block_ids, out=out), first_block=first)
        parts = tuple(
            KVPart(len(g.layers), first, len(ids)) for g, (first, ids) in zip(self.kv.groups, held, strict=True)
        )
        size = sum(math.prod(pool.layout.block_shape(p.num_blocks)) for pool, p in zip(pools, parts, strict=True))
        dtype, device = layout.torch_dtype, self.kv.pool.tensor.device
        flat = alloc((size,), dtype) if alloc is not None else torch.empty(size, dtype=dtype, device=device)
        kv = KVExport(layout, num_tokens, flat, parts=parts)
        for i, (pool, (_, ids)) in enumerate(zip(pools, held, strict=True)):
            pool.read(ids, out=kv.part_blocks(i))
        return kv

    def blocks(self, request_id: str) -> tuple[int, list[int], int]:
        """(tokens computed, the pool blocks holding them in order, the request's block they start at) of a
        request that is decoding or finished holding its KV: what `export` copies, for a caller that reads
        the pool itself (a send straight from the blocks). Blocks freed behind the sliding window are not
        among them (they start at the first unfreed one). The blocks stay the request's; nothing changes.
        One KV cache group only (ValueError otherwise: export those)."""
        if len(self.kv.pools) > 1:
            raise ValueError("a model of several KV cache groups sends exports (export_kv), not one pool's blocks")
        num_tokens, ((first, block_ids),) = self.group_blocks(request_id)
        return num_tokens, block_ids, first

    def group_blocks(self, request_id: str) -> tuple[int, list[tuple[int, list[int]]]]:
        """(tokens computed, per KV cache group (its first held block, the pool blocks from there on)) of a
        request that is decoding or finished holding its KV. Nothing changes."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if isinstance(self.kv.blocks[0], DpBlockManager):  # the blocks lie in one rank's pool, not the leader's
            raise ValueError(
                f"request {request_id!r}: KV out of a data-parallel attention group (--dp-attention) is not "
                "supported yet (a DP group decodes: it imports KV, it does not hand it on)"
            )
        if req.status is RequestStatus.WAITING or req.num_computed_tokens < req.num_tokens - 1:
            raise ValueError(f"request {request_id!r} has not finished its prefill")
        n = self.kv.blocks[0].blocks_for(req.num_computed_tokens)
        held = []
        for table in self.scheduler.tables(req):
            first = table.freed  # blocks freed behind the sliding window are not carried
            if FREED in table.blocks[first:n]:
                raise AssertionError(f"request {request_id!r} has freed blocks past its first {first}")
            held.append((first, list(table.blocks[first:n])))
        return req.num_computed_tokens, held

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished request that held them. False if there is no such request."""
        req = self.requests.get(request_id)
        if req is None or not req.is_finished:
            return False
        del self.requests[request_id]
        self.scheduler.release(req)
        return True

    def can_stream(self) -> bool:
        """Whether a request's KV can be streamed layer by layer (layer_streams.py): a host-memory pool, one
        process (no worker group), no sliding windows."""
        return self.kv.pool.tensor.device.type == "cpu" and self.world == 1 and not self.kv.layout.layer_windows

    def stream(self, request_id: str, on_start: OnStart) -> None:
        """Watch a request added with hold_kv: when the step that completes its prompt starts, `on_start` is called
        (on the engine's thread) with its blocks and the per-layer progress a sender waits on. ValueError where
        the engine cannot stream (`can_stream`) or the request is unknown."""
        if not self.can_stream():
            raise ValueError("this engine cannot stream KV layer by layer (CUDA pool, worker group or windows)")
        req = self.requests.get(request_id)
        if req is None or not req.hold_kv or req.output_token_ids:
            raise ValueError(f"request {request_id!r} is not a fresh prefill holding its KV")
        self.layer_streams.watch(request_id, on_start)

    # ---- in ---------------------------------------------------------------------------------------------

    def import_(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: KVExport,
        cache_salt: str = "",
        pinned: str | None = None,
    ) -> None:
        """Continue a request from KV computed elsewhere. The KV must cover every token but the last
        sampled one. Raises NoFreeBlocksError (nothing taken) when the pool is full: retry later. Its full
        blocks are offered to the prefix cache under `cache_salt` after its first step. `pinned`: the key of a
        pin (prefix_pins.py) of the prompt's cached first blocks: a KV that starts right behind them (a partial
        pull) is imported behind them; one that starts earlier is imported whole. The pin is consumed either way
        (its references given back on any failure or when unused)."""
        prefix = self.pins.take(pinned) if pinned is not None else []
        try:
            self.limits.check(self.requests, request_id, prompt_token_ids)
            self._check_import(prompt_token_ids, output_token_ids, kv)
            prefix = self._behind(kv, prefix)
            tables = self._allocate(kv, prefix)
        except BaseException:
            self.kv.blocks[0].free(prefix)
            raise
        try:  # the matcher replays the output so far (the prefill worker sampled the first token under it)
            self.structured.add(request_id, params.structured, output_token_ids)
        except ValueError:
            self._free(tables)
            raise
        try:
            self._write(kv, tables, len(prefix))
        except BaseException:  # e.g. a borrowed KV whose lender took it back mid-copy (BorrowRevoked): nothing kept
            self.structured.remove(request_id)
            self._free(tables)
            raise
        req = Request(
            request_id, list(prompt_token_ids), params, cache_salt=cache_salt, output_token_ids=list(output_token_ids)
        )
        req.group_tables = tables
        req.num_computed_tokens = kv.num_tokens
        self.requests[request_id] = req
        self.scheduler.add_running(req)

    def _behind(self, kv: KVExport, prefix: list[int]) -> list[int]:
        """The pinned blocks the pulled KV goes behind: those before its first carried token (a source that cut
        less than was pinned, or sent it whole, leaves the rest to the pulled copy: given back). ValueError (the pin
        given back) for a KV that starts past the pin or inside one of this pool's blocks, and for a KV of a
        full-attention model without its first blocks and no pin."""
        if not prefix:
            if kv.first_block and not self.kv.layout.layer_windows:  # only a window lets the first blocks go
                raise ValueError(f"KV from block {kv.first_block} on, and no cached blocks in front of it")
            return []
        block_size = self.kv.layout.block_size
        start = kv.first_block * kv.layout.block_size  # the first carried token (pins: one group, no window)
        keep = start // block_size
        if kv.parts or keep > len(prefix) or start % block_size:
            raise ValueError(f"KV from token {start} on cannot go behind {len(prefix)} cached blocks of {block_size}")
        self.kv.blocks[0].free(prefix[keep:])
        return prefix[:keep]

    def _check_import(self, prompt_token_ids: list[int], output_token_ids: list[int], kv: KVExport) -> None:
        """ValueError for KV this engine cannot continue from; NoFreeBlocksError when no sequence slot is left."""
        layout = self.kv.layout
        if not output_token_ids:
            raise ValueError("import needs at least the first sampled token")
        if kv.layout.fingerprint != layout.fingerprint:
            raise ValueError(f"KV layout {kv.layout} does not match this engine's {layout}")
        if kv.layout.held_kv_heads != layout.held_kv_heads:
            raise ValueError(
                f"KV of KV heads {kv.layout.held_kv_heads} cannot fill this pool of heads {layout.held_kv_heads}: "
                "re-slice it to this rank's heads first"
            )
        if kv.num_tokens != len(prompt_token_ids) + len(output_token_ids) - 1:
            raise ValueError(
                f"KV covers {kv.num_tokens} tokens; expected prompt + output - 1 = "
                f"{len(prompt_token_ids) + len(output_token_ids) - 1}"
            )
        if len(self.scheduler.running) >= self.max_num_seqs:
            raise NoFreeBlocksError(f"{self.max_num_seqs} requests already running")
        if kv.parts and len(kv.parts) != len(self.kv.pools):
            raise ValueError(
                f"KV of {len(kv.parts)} KV cache groups cannot fill this engine's pool of {len(self.kv.pools)}: a "
                "hybrid model's grouped KV goes to single-rank engines"
            )

    def _allocate(self, kv: KVExport, prefix: list[int]) -> list[GroupTable]:
        """Every group's table for an imported request: FREED up to the group's first carried block (behind its
        window), fresh blocks from there on; with a cached `prefix` (one group, its references the request's
        now), those blocks in front of fresh ones for the pulled rest. All or nothing: NoFreeBlocksError with
        nothing taken (`prefix` left to the caller)."""
        managers, block_size = self.kv.blocks, self.kv.layout.block_size
        n = managers[0].blocks_for(kv.num_tokens)
        if prefix:  # kv.first_block_at(block_size) == len(prefix): the KV starts right behind it
            return [GroupTable(prefix + managers[0].allocate(n - len(prefix)), 0)]
        firsts = [kv.first_block_at(block_size, i if kv.parts else None) for i in range(len(self.kv.pools))]
        if not kv.parts and kv.first_block and len(self.kv.pools) > 1:
            raise ValueError("KV of one pool without its first blocks cannot fill a full-attention group")
        if not all(b.can_allocate(n - f) for b, f in zip(managers, firsts, strict=True)):
            free = [b.num_free for b in managers]
            raise NoFreeBlocksError(f"an import of {kv.num_tokens} tokens does not fit: free blocks per group {free}")
        return [GroupTable([FREED] * f + b.allocate(n - f), f) for b, f in zip(managers, firsts, strict=True)]

    def _write(self, kv: KVExport, tables: list[GroupTable], cached: int = 0) -> None:
        """Write an imported request's KV into the blocks `_allocate` gave it, in every KV cache group, past the
        `cached` blocks in front (a partial pull's: they hold their K/V already)."""
        block_size = self.kv.layout.block_size
        if len(self.kv.pools) == 1:
            start = cached or tables[0].freed
            self.kv.pool.write_export(tables[0].blocks[start:], kv)  # a worker group: on every rank
        elif not kv.parts:  # from one pool of every layer (a worker group's): each group takes its layers
            data = kv.reblock(block_size)
            for g, pool, table in zip(self.kv.groups, self.kv.pools, tables, strict=True):
                pool.write(table.blocks[table.freed :], data[list(g.layers)])
        else:
            for i, (pool, table) in enumerate(zip(self.kv.pools, tables, strict=True)):
                pool.write(table.blocks[table.freed :], kv.reblock(block_size, i))

    def _free(self, tables: list[GroupTable]) -> None:
        for blocks, table in zip(self.kv.blocks, tables, strict=True):
            blocks.free(table.blocks)
