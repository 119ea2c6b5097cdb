"""The decoder-only causal LM shared by every supported architecture.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn..., lm_head) so the loader
maps them one to one; fused and stacked parameters declare their checkpoint pieces in `checkpoint_shards`.

Tensor-parallel (a `group` and a `layout` with tp > 1): attention and MLPs hold this rank's shard (see their
modules). The embedding is replicated: a lookup of T rows has no compute to split, and splitting the vocabulary
would add a (T, D) all-reduce per step. An untied LM head is vocabulary-parallel (the big matmul of a step's
sampling rows is split) and its logits all-gathered, so every rank has the full (N, V) logits and samples alike;
a tied LM head uses the replicated embedding and computes the full logits on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.model.attention import Attention
from shared.model.config import ModelConfig
from shared.model.kernels.choice import KernelChoice
from shared.model.layers import GatedMLP, RMSNorm, Rotary
from shared.model.linear import PackedWeights, linear
from shared.model.mla_attention import MLAAttention, MLAForm
from shared.model.moe import MoE
from shared.model.paged_attention import AttentionMetadata
from shared.model.tensor_parallel import TensorShard
from shared.sharding.group import RankGroup
from shared.sharding.layout import ParallelLayout


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, index: int, shard: TensorShard = TensorShard.SINGLE, split_experts: bool = True
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_weight_in_float32)
        self.self_attn: nn.Module = MLAAttention(cfg, shard) if cfg.arch.mla else Attention(cfg, shard, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_weight_in_float32)
        sparse = cfg.layer_is_sparse(index)
        self.mlp: nn.Module
        if sparse:
            self.mlp = MoE(cfg, shard, split_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, shard)

    def forward(self, x, rope, kv_cache, meta, pending=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D): the residual stream; pending: the previous layer's MLP output, not yet added to it (None at
        the first layer). → (the residual stream after attention, this layer's MLP output): each residual add
        runs inside the norm that follows it (RMSNorm's residual_delta), one pass instead of two."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm(x, pending)
        x, normed = self.post_attention_layernorm(x, self.self_attn(normed, rope, kv_cache, meta))
        return x, self.mlp(normed)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard = TensorShard.SINGLE, split_experts: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, split_experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_weight_in_float32)


class VocabHead(nn.Module):
    """The untied LM head's weight: all V rows at tp = 1; at tp > 1 this rank's ceil(V / tp) rows of the
    vocabulary, the last rank's padded with zero rows so every rank's logits have one width for the all-gather
    (the padding's columns are cut off after it)."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard = TensorShard.SINGLE) -> None:
        super().__init__()
        self.shard = shard
        per = -(-cfg.vocab_size // shard.tp)
        start = min(shard.rank * per, cfg.vocab_size)
        self.rows = range(start, min(start + per, cfg.vocab_size))  # the vocabulary rows this rank reads
        self.weight = nn.Parameter(torch.empty(per, cfg.hidden_size))

    def checkpoint_shards(self) -> dict[str, tuple]:
        if not self.shard.split:
            return {}
        return {"weight": ("weight", (slice(0, len(self.rows)),), self.shard.source(self.rows))}

    def zero_padding(self) -> None:
        with torch.no_grad():
            self.weight[len(self.rows) :].zero_()


class CausalLM(nn.Module, PackedWeights):
    """forward(input_ids (T,), positions (T,), kv_caches, meta) → hidden (T, D); logits(hidden) → (N, V).

    Build it with `shared.model.loader.load_model`: parameters start uninitialized (meta device), and
    `init_runtime` fills the tensors that are not weights (RoPE tables, expert-load counters). Those are
    non-persistent buffers: they live on the model's device, like the weights, and move with it.
    """

    def __init__(self, cfg: ModelConfig, group: RankGroup | None = None, layout: ParallelLayout | None = None) -> None:
        """group, layout: this rank's worker group and its degrees (both None: the whole model, one rank)."""
        super().__init__()
        layout = layout or ParallelLayout()
        self.config = cfg
        self.layout = layout
        self.shard = TensorShard.of(group, layout)
        # data-parallel attention (layout.dp > 1): this rank runs its own requests' tokens, the MoE layers exchange
        # them with the group's other ranks (shared/engine/dp_step.py); None otherwise
        self.dp_group = group if layout.data_parallel else None
        # under expert parallelism a rank holds whole experts (shard_experts gives it its slots)
        self.model = Backbone(cfg, self.shard, split_experts=layout.ep == 1)
        self.lm_head = None if cfg.tie_word_embeddings else VocabHead(cfg, self.shard)
        # logits are computed per vocabulary shard and all-gathered (untied head at tp > 1)
        self.vocab_parallel = self.lm_head is not None and self.shard.split
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.runtime_ready = False
        self.kernels = KernelChoice.TORCH  # see use_kernels
        # decode attention through the CPU kernel (shared/model/attention.py, use_cpu_attention_kernel): the
        # runner then lays each step's decodes out for it (AttentionMetadata.build(cpu_decode_kernel=True))
        self.cpu_attention = False
        # called with each layer's index once its forward returned (its KV written): a layer-streamed KV send
        # waits on it (shared/engine/layer_streams.py); None: no step of a streamed request is running
        self.on_layer: Callable[[int], object] | None = None
        self.LINEAR_WEIGHTS = ("model.embed_tokens.weight",) if self.lm_head is None else ("lm_head.weight",)

    def init_runtime(self) -> None:
        """Fill the runtime buffers on whatever device the model is on (after `to_empty` they hold garbage)."""
        self.rotary.fill()
        if self.lm_head is not None:
            self.lm_head.zero_padding()
        for moe in self.sparse_layers().values():
            moe.expert_load.zero_()
        self.runtime_ready = True

    def use_kernels(self, kernels: KernelChoice) -> None:
        """Select the implementation of decode attention and the MoE experts: TORCH or TRITON (resolved, see
        shared/model/kernels/choice.py). Sets `self.kernels` (the runner builds each step's attention
        metadata for it) and the choice on every Experts module."""
        kernels = KernelChoice(kernels)
        if kernels is KernelChoice.AUTO:
            raise ValueError("resolve the kernel choice for the model's device first (resolve_kernels)")
        self.kernels = kernels
        for moe in self.sparse_layers().values():
            moe.experts.kernels = kernels

    def set_mla_form(self, form: MLAForm | str) -> None:
        """Force the latent attention's form (MLA models only): AUTO, ABSORBED or EXPANDED (see mla_attention)."""
        if not self.config.arch.mla:
            raise ValueError(f"{self.config.model_type} has no latent attention")
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.form = MLAForm(form)

    def sparse_layers(self) -> dict[int, MoE]:
        """Layer index → its MoE block, for the sparse layers."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, MoE)}

    def idle_step(self, device: torch.device) -> None:
        """A data-parallel rank's step without tokens of its own: every sparse layer's expert exchange, in layer
        order, as its forward would make them (the other ranks' tokens may need its experts)."""
        dtype = next(self.parameters()).dtype
        for moe in self.sparse_layers().values():
            moe.idle(dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],  # per layer (planes, N, B, KVH, width): (2, ..) K|V, MLA (1, .., 1, W)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if not self.runtime_ready:
            raise RuntimeError("call init_runtime() (load_model does) before running the model")
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, torch.float32 if self.config.arch.rope_in_float32 else x.dtype)
        pending = None  # the last layer's MLP output, added to x by the next norm (DecoderLayer.forward)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x, pending = layer(x, rope, kv_cache, meta, pending)
            if self.on_layer is not None:
                self.on_layer(i)
        return self.model.norm(x) if pending is None else self.model.norm(x, pending)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, D) → full logits (N, V) float32, on every rank."""
        logits = linear(hidden, self.w(self.LINEAR_WEIGHTS[0])).float()
        if self.vocab_parallel:  # (N, V/tp padded) per rank → (N, V)
            logits = self.shard.group.all_gather(logits, dim=-1)[:, : self.config.vocab_size]
        return logits

    def take_expert_load(self) -> dict[int, torch.Tensor]:
        """Tokens routed per expert in each sparse layer since the last call, as host tensors (E,); resets
        the counters. The counters accumulate on the device; this is their one read: one stacked copy to
        the host (a sync on CUDA: call it per heartbeat, not per step)."""
        moes = self.sparse_layers()
        if not moes:
            return {}
        stacked = torch.stack([m.expert_load for m in moes.values()]).cpu()  # (sparse layers, E)
        for m in moes.values():
            m.expert_load.zero_()
        return dict(zip(moes, stacked.unbind(0), strict=True))
