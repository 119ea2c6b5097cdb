"""Multi-head latent attention (DeepSeek-V2/V3): its config, parsed once from the raw `config.json`.

MLA compresses a token's keys and values into one latent vector c_kv (kv_lora_rank wide) shared by every head,
plus one decoupled RoPE key k_pe (qk_rope_head_dim wide), also shared. The per-head keys and values are
up-projections of c_kv (`kv_b_proj`): K_nope = W_UK c_kv, V = W_UV c_kv. So the cache stores, per token,
[c_kv | k_pe]: `latent_width` values, one entry for all heads (shared/model/mla_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.model.config_aliases import read_field


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: queries come straight from q_proj (DeepSeek-V2-Lite), no compression
    kv_lora_rank: int  # the latent c_kv's width
    qk_nope_head_dim: int  # per head: the query/key part without position
    qk_rope_head_dim: int  # per head query part with RoPE; the shared k_pe's width
    v_head_dim: int
    # DeepSeek lays each head's rope dimensions out as interleaved pairs (x0, x1), (x2, x3)...: V2 always,
    # V3 unless its config sets rope_interleave=false (then the usual rotate-half halves)
    rope_interleave: bool = True
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values per token in the latent cache: [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MLAConfig:
        """Read as transformers' DeepSeek config classes read it (shared/model/config_aliases.py: their
        spellings and defaults; a `q_lora_rank` written as null means no query compression)."""
        arch = raw.get("model_type", "deepseek_v3")

        def get(name: str) -> Any:
            return read_field(raw, arch, name)

        q_lora_rank = get("q_lora_rank")
        return cls(
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            # V2's modeling applies RoPE to interleaved pairs unconditionally (it has no such field)
            rope_interleave=bool(get("rope_interleave")) if arch == "deepseek_v3" else True,
            attention_bias=bool(get("attention_bias")),
        )
