"""Attention over a paged KV cache, in plain torch (the CPU reference path).

One layer's cache is a tensor (2, N, B, KVH, hd): K|V, blocks, tokens per block, KV heads, head dim.
Viewed flat it is (2, N*B, KVH, hd) with slot = block_id * B + offset. A batch is flat over tokens: the
first `num_decodes` sequences contribute one query token each (tokens 0..num_decodes-1), the rest are
prefill chunks of any length that may continue an earlier chunk already in the cache.

Decode sequences are attended in buckets of similar context length, each padded only to its own longest
(`group_decodes`), so one long sequence does not make every short one attend over its length. With the
Triton kernels (KernelChoice.TRITON) every decode sequence goes to one kernel launch instead (`KernelDecodes`):
the kernel walks only each sequence's own blocks, so padding the table costs it nothing. On CPU the C kernel
(shared/model/kernels/cpu_attention.c; build(cpu_decode_kernel=True), chosen by the engine for float32 models
without sinks) takes the same KernelDecodes and likewise reads each sequence's blocks in place, instead of the
buckets' gather + SDPA. Prefill chunks take the torch path either way.

Sliding windows (ModelConfig.layer_windows): a layer with window W attends, for a query at position p, to keys
p-W+1..p. The step's metadata carries one view per distinct window (`for_window`), built on the host once per
step like the full one: each sequence's block table starts at the first block its window reaches (blocks
behind it are never read: the block manager may have freed them), and the masks keep the window's keys only.
With KV cache groups (shared/engine/kv_groups.py: full and sliding layers mixed) a window's layers have their
own pool and block tables: its view is built from those (`window_tables`), slot mapping included, so the
step's K/V of those layers is written to their own slots.
Attention sinks (gpt-oss): a learned logit per query head joins every softmax's denominator (`sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F

from shared.model.device import to_device
from shared.model.kernels import cpu_attention
from shared.model.kernels.choice import KernelChoice


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    count: int  # query tokens
    blocks: torch.Tensor  # (nb,) int64: the blocks holding the context (a windowed view: from its first block)
    context_len: int  # cached tokens + this chunk (a windowed view: counted from its first block)
    mask: torch.Tensor | None  # (count, context_len) bool for a later chunk or a window; None = plain causal


# A decode sequence joins a bucket when padding it to the bucket's longest context costs at most this many
# slots: about what one more SDPA call costs on CPU (~20 µs, the time to gather and attend ~64 slots at
# 2 KV heads of 64). Attention alone, 8 layers of the small demo model, one thread, CPU ms on the 2-core
# dev machine (scratch measurement with enable_gqa SDPA in every column, ±30% between runs):
#                                      padded  buckets  pow2 classes  per sequence  flat varlen
#   32 x 136 (uniform)                     14       14            13            23           22
#   31 x 136 + 1 x 4096                   984       35            35            38           44
#   32 random in 16..2048                 487      146           300           134          267
# Padding to the batch's longest is what this replaces; power-of-two length classes still pad up to 2x;
# one call per sequence loses a third on uniform batches (per-call overhead); a flat varlen formulation
# (contexts concatenated, scores by one batched matmul, segment softmax by scatter/index_add) runs ~10
# unfused ops over every slot instead of one fused SDPA. Buckets with this slack tie the best on each row.
BUCKET_SLACK_SLOTS = 64


@dataclass(frozen=True)
class DecodeBucket:
    """Decode sequences attended in one batched call, padded only to the bucket's longest context."""

    rows: slice | torch.Tensor  # which decode tokens: a slice when they are consecutive, else (b,) int64
    blocks: torch.Tensor  # (b, NBmax) block ids, padded with block 0 past each sequence's own blocks
    mask: torch.Tensor  # (b, 1, 1, NBmax * B) True = attend
    _biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """`mask` as an additive bias (0 = attend, -inf = not) in the queries' dtype: made by the step's first
        layer, reused by the others. SDPA's CPU kernel runs a float mask ~1.4x faster than a bool one (which
        it converts on every call), with bitwise the same output."""
        if dtype not in self._biases:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            self._biases[dtype] = zero.masked_fill(~self.mask, float("-inf"))
        return self._biases[dtype]


class _DecodeLayout(Enum):
    """How a step's decodes are laid out: torch buckets, or one KernelDecodes for a kernel."""

    BUCKETS = "buckets"
    TRITON = "triton"
    CPU_KERNEL = "cpu_kernel"


@dataclass(frozen=True)
class KernelDecodes:
    """Every decode sequence (decode tokens 0..Bd-1), for paged_decode_attention (Triton) or, on CPU, the C
    kernel (cpu_attention.paged_decode)."""

    blocks: torch.Tensor  # (Bd, NBmax) int64 block ids, padded with block 0 past each sequence's own blocks
    context_lens: torch.Tensor  # (Bd,) int64, on the device
    max_context_len: int  # the longest context, on the host: picks the kernel's split count without a sync
    window: int | None = None  # a windowed view: the kernel masks keys more than window - 1 behind the query
    cpu_kernel: bool = False  # for the CPU attention kernel, not Triton's


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once per step on the host, each tensor
    copied to the device once (`to_device`), shared by all layers."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot each input token's K/V is written to
    num_decodes: int
    decodes: list[DecodeBucket]  # torch path: together they cover decode tokens 0..num_decodes-1 once each
    prefills: list[PrefillChunk]
    kernel_decodes: KernelDecodes | None = None  # a kernel's layout (decodes is then empty); None without decodes
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)  # window → its view (see module doc)
    has_full: bool = True  # False: built without the full view (build(full=False))

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The view a layer with this sliding window attends through (None: the full context, self)."""
        if window is None and not self.has_full:
            raise ValueError("this step's metadata was built without the full-attention view")
        return self if window is None else self.windowed[window]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        kernels: KernelChoice = KernelChoice.TORCH,
        windows: frozenset[int] | set[int] = frozenset(),
        full: bool = True,
        window_tables: dict[int, list[list[int]]] | None = None,
        cpu_decode_kernel: bool = False,
    ) -> AttentionMetadata:
        """One entry per sequence, decodes first. context_lens include this step's tokens. `kernels` (resolved:
        TORCH or TRITON) decides how the decodes are laid out: torch buckets, or one KernelDecodes. `windows`:
        the model's sliding windows, one view each (`for_window`). full=False: no layer attends to the whole
        context (every layer slides), so the full view is left empty (its tables may hold blocks freed behind
        the window, block_manager.FREED). `window_tables`: window → per sequence its own group's block table
        (KV cache groups); a window without an entry uses `block_tables`. cpu_decode_kernel: with the torch
        kernels on CPU, the decodes as one KernelDecodes for the CPU attention kernel instead of buckets (the
        model's `cpu_attention`, set by use_cpu_attention_kernel)."""
        if kernels is KernelChoice.TRITON and cpu_decode_kernel:
            raise ValueError("cpu_decode_kernel is for the torch kernels on CPU, not with kernels=triton")
        layout = _DecodeLayout.TRITON if kernels is KernelChoice.TRITON else _DecodeLayout.BUCKETS
        if cpu_decode_kernel:
            layout = _DecodeLayout.CPU_KERNEL
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = _cut_tables(block_tables, context_lens, block_size)
        slot_mapping = _slot_mapping(tables, context_lens, query_lens, block_size, device)

        def view(window: int | None, tables: list[list[int]] = tables) -> tuple:
            return _views(tables, context_lens, query_lens, num_decodes, block_size, device, layout, window)

        windowed: dict[int, AttentionMetadata] = {}
        for w in sorted(windows):
            own = (window_tables or {}).get(w)
            if own is None:
                windowed[w] = cls(slot_mapping, num_decodes, *view(w))
            else:  # the window's own KV cache group: its tables, its slots
                cut = _cut_tables(own, context_lens, block_size)
                slots = _slot_mapping(cut, context_lens, query_lens, block_size, device)
                windowed[w] = cls(slots, num_decodes, *view(w, cut))
        if not full:
            return cls(slot_mapping, num_decodes, [], [], None, windowed=windowed, has_full=False)
        return cls(slot_mapping, num_decodes, *view(None), windowed=windowed)


def _cut_tables(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> list[list[int]]:
    """Each table cut to the blocks its context fills (ValueError when a table is too short)."""
    tables = []
    for bt, n in zip(block_tables, context_lens, strict=True):
        nb = -(-n // block_size)
        if nb > len(bt):
            raise ValueError(f"block table holds {len(bt) * block_size} slots, context needs {n}")
        tables.append(bt[:nb])
    return tables


def _slot_mapping(
    tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int, device: torch.device | str
) -> torch.Tensor:
    """(T,) the cache slot of each of the step's tokens, sequence after sequence: built as one Python list and
    made a tensor once (one small tensor per sequence and a cat cost ~10 µs a sequence, most of a decode step's
    metadata)."""
    if all(q == 1 for q in query_lens):  # a decode-only step: one slot per sequence, its last position's
        slots = [
            bt[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for bt, n in zip(tables, context_lens, strict=True)
        ]
    else:
        slots = []
        for bt, n, q in zip(tables, context_lens, query_lens, strict=True):
            slots += _slots(bt, n - q, n, block_size)
    return to_device(torch.tensor(slots, dtype=torch.int64), device)


def _views(
    tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device | str,
    layout: _DecodeLayout,
    window: int | None,
) -> tuple[list[DecodeBucket], list[PrefillChunk], KernelDecodes | None]:
    """The decode buckets (or kernel decodes) and prefill chunks of one view: the full context (window None),
    or each sequence's window: its table from the first block the window of its first query reaches, its
    context counted from there (`first` tokens dropped), its masks keeping keys p-W+1..p of a query at p.
    layout: torch buckets, or one KernelDecodes for the Triton or the CPU kernel."""
    first = [0] * len(tables)
    if window is not None:
        first = [
            max(0, n - q - window + 1) // block_size * block_size for n, q in zip(context_lens, query_lens, strict=True)
        ]
        tables = [t[f // block_size :] for t, f in zip(tables, first, strict=True)]
    lens = [n - f for n, f in zip(context_lens, first, strict=True)]
    decodes: list[DecodeBucket] = []
    kernel_decodes = None
    if layout is not _DecodeLayout.BUCKETS:
        if num_decodes:
            cpu = layout is _DecodeLayout.CPU_KERNEL
            kernel_decodes = _kernel_decodes(tables[:num_decodes], lens[:num_decodes], device, window, cpu)
    else:
        decodes = [
            _decode_bucket(rows, tables, lens, block_size, device, window)
            for rows in group_decodes([len(t) for t in tables[:num_decodes]], BUCKET_SLACK_SLOTS // block_size)
        ]
    prefills = []
    start = num_decodes
    for b in range(num_decodes, len(query_lens)):
        q, n = query_lens[b], lens[b]
        mask = None
        if q != n or (window is not None and n > window):
            # query i sits at position n - q + i (counted from the view's first token) and sees keys up to it,
            # and with a window no key window or more behind it
            keys, queries = torch.arange(n)[None, :], torch.arange(n - q, n)[:, None]
            mask = keys <= queries
            if window is not None:
                mask &= keys > queries - window
            mask = to_device(mask, device)
        blocks = to_device(torch.tensor(tables[b], dtype=torch.int64), device)
        prefills.append(PrefillChunk(start, q, blocks, n, mask))
        start += q
    return decodes, prefills, kernel_decodes


def group_decodes(num_blocks: list[int], slack_blocks: int) -> list[list[int]]:
    """Decode sequences (by their number of context blocks) grouped into buckets: longest first, a sequence
    joins the current bucket while it is at most `slack_blocks` shorter than the bucket's longest. Each
    bucket lists its sequences in ascending order, so a uniform batch is one bucket [0, 1, ..., Bd-1]."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and num_blocks[buckets[-1][0]] - num_blocks[i] <= slack_blocks:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return [sorted(b) for b in buckets]


def _decode_bucket(
    rows: list[int],
    tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str,
    window: int | None = None,
) -> DecodeBucket:
    nb_max = max(len(tables[i]) for i in rows)
    padded = [tables[i] + [0] * (nb_max - len(tables[i])) for i in rows]
    lens = torch.tensor([context_lens[i] for i in rows])
    slots = torch.arange(nb_max * block_size)[None, :]
    mask = slots < lens[:, None]
    if window is not None:  # the query sits at lens - 1: keys more than window - 1 behind it are out
        mask &= slots >= lens[:, None] - window
    mask = mask.view(len(rows), 1, 1, -1)
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeBucket(
        slice(rows[0], rows[0] + len(rows))
        if consecutive
        else to_device(torch.tensor(rows, dtype=torch.int64), device),
        to_device(torch.tensor(padded, dtype=torch.int64), device),
        to_device(mask, device),
    )


def _kernel_decodes(
    tables: list[list[int]],
    context_lens: list[int],
    device: torch.device | str,
    window: int | None = None,
    cpu_kernel: bool = False,
) -> KernelDecodes:
    nb_max = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (nb_max - len(t)) for t in tables], dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    return KernelDecodes(to_device(padded, device), to_device(lens, device), max(context_lens), window, cpu_kernel)


def _slots(block_table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Cache slots of token positions [start, stop)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, H, hd); k, v: (T, KVH, hd) for this step's tokens; kv_cache: (2, N, B, KVH, hd); sinks: (H,) float
    logits or None. Writes k, v into the cache, then attends over each sequence's context (the view's: see
    `for_window`). Returns (T, H, hd)."""
    kvh, hd = k.shape[1], k.shape[2]
    kd = meta.kernel_decodes
    if kd is not None and kd.cpu_kernel and meta.num_decodes == q.shape[0]:
        # a decode-only step on the CPU kernel: it writes the step's K/V into the cache itself, then attends
        return _cpu_kernel_decodes(q, kv_cache, meta, scale, sinks, torch.empty_like(q), write=(k, v))
    flat = kv_cache.view(2, -1, kvh, hd)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    if meta.kernel_decodes is not None and meta.kernel_decodes.cpu_kernel:
        _cpu_kernel_decodes(q, kv_cache, meta, scale, sinks, out)
    elif meta.kernel_decodes is not None:
        # imported here: triton loads only when the kernels were chosen (it may be absent on a CPU host)
        from shared.model.kernels.paged_decode_attention import paged_decode_attention

        kd, nd = meta.kernel_decodes, meta.num_decodes
        out[:nd] = paged_decode_attention(
            q[:nd],
            kv_cache,
            kd.blocks,
            kd.context_lens,
            scale,
            max_context_len=kd.max_context_len,
            window=kd.window,
            sinks=sinks,
        )
    # sinks grouped as the queries are: query head j*g + i shares KV head j → (KVH, g)
    grouped_sinks = None if sinks is None else sinks.view(kvh, -1)
    for d in meta.decodes:
        b, nb = d.blocks.shape
        # Whole blocks in one gather → (2, b, KVH, NB*B, hd). index_select over rows of whole blocks copies each
        # block as one run; advanced indexing (kv_cache[:, blocks]) was ~3x slower on CPU (per-element copies).
        ctx = gather_blocks(kv_cache, d.blocks.flatten()).view(2, b, -1, kvh, hd).transpose(2, 3)
        # GQA as queries: the H/KVH query heads sharing KV head j (heads j*g .. j*g+g-1) become g query rows
        # of head j, (b, KVH, g, hd), so each KV head's context is read once by a (g x L) product instead
        # of g matrix-vector ones: 2.5x less SDPA time on CPU than enable_gqa at 1 x 4096 and 32 x 144.
        qg = q[d.rows].view(b, kvh, -1, hd)
        if grouped_sinks is None:
            o = F.scaled_dot_product_attention(qg, ctx[0], ctx[1], attn_mask=d.bias(q.dtype), scale=scale)
        else:  # one query row per head: (b, KVH, g, 1, hd)
            o = attention_with_sinks(qg.unsqueeze(3), ctx[0], ctx[1], d.mask.unsqueeze(1), scale, grouped_sinks)
        out[d.rows] = o.flatten(1, 2).view(-1, q.shape[1], hd)
    for c in meta.prefills:
        # 4-D (1, heads, tokens, hd): with a batch dimension torch picks its fused CPU kernel
        # instead of the math fallback that materializes the whole causal mask.
        ctx = gather_blocks(kv_cache, c.blocks).view(2, -1, kvh, hd)[:, : c.context_len]
        ctx = ctx.transpose(1, 2)  # (2, KVH, L, hd)
        qs = q[c.start : c.start + c.count].transpose(0, 1).unsqueeze(0)
        if grouped_sinks is None:
            o = F.scaled_dot_product_attention(
                qs, ctx[0:1], ctx[1:2], attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=True
            )
        else:
            mask = c.mask
            if mask is None:
                mask = torch.ones(c.count, c.context_len, dtype=torch.bool, device=q.device).tril()
            qg = qs.view(1, kvh, -1, c.count, hd)  # (1, KVH, g, T, hd)
            o = attention_with_sinks(qg, ctx[0:1], ctx[1:2], mask, scale, grouped_sinks).flatten(1, 2)
        out[c.start : c.start + c.count] = o[0].transpose(0, 1)
    return out


def _cpu_kernel_decodes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The decode tokens through the CPU attention kernel, written into out[:num_decodes] (→ out). write: (k, v)
    of a decode-only step, which the kernel writes into the cache at the metadata's slots before attending. The
    engine picks this layout only where the kernel runs (use_cpu_attention_kernel); sinks and other dtypes keep
    the torch buckets, so reaching here with them is a wiring error."""
    lib = cpu_attention.load()
    kd, nd = meta.kernel_decodes, meta.num_decodes
    assert kd is not None
    if lib is None or sinks is not None:
        raise ValueError("CPU kernel decode layout without a usable CPU attention kernel (or with sinks)")
    if write is not None:  # a decode-only step: the whole tensors (no slicing ops), the K/V write inside
        kv = (*write, meta.slot_mapping)
        cpu_attention.paged_decode(lib, q, kv_cache, kd.blocks, kd.context_lens, scale, kd.window, out=out, write=kv)
    else:
        cpu_attention.paged_decode(lib, q[:nd], kv_cache, kd.blocks, kd.context_lens, scale, kd.window, out=out[:nd])
    return out


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Softmax attention whose denominator also holds exp(sink) per query head (a key no value comes from), in
    the order of transformers' gpt-oss eager attention: scores, the sink logit appended, max subtracted,
    softmax, the sink's column dropped. q (b, KVH, g, T, hd); k, v (b, KVH, L, hd); mask broadcastable to
    (b, KVH, g, T, L), True = attend; sinks (KVH, g). → (b, KVH, g, T, hd)."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (b, KVH, g, T, L)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.to(scores.dtype)[None, :, :, None, None].expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v.unsqueeze(2))


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """kv_cache (2, N, B, KVH, hd), blocks (n,) int64 → (2, n, B*KVH*hd): those blocks' K and V, copied in order."""
    return kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)
