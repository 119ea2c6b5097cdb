"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a `CausalLM`.

The mapping from checkpoint names to our parameters is declarative: every parameter (and persistent buffer:
a router's correction bias) loads from the tensor of the same name, except where a module's
`checkpoint_shards()` says a checkpoint tensor fills a slice of a fused/stacked parameter (q/k/v → qkv_proj,
gate/up → gate_up_proj, experts.N.* → stacked experts).

Sharded (tensor-parallel) loading: a declaration may add the slice of the checkpoint tensor this rank reads
(rows, columns); the loader then reads only that slice from the file (`safe_open(...).get_slice(name)[...]`),
never the whole tensor. Quantized checkpoints (`quantization`) are dequantized in that same read, slice by slice.
A parent module's declaration of a child's parameter wins over the plain mapping
(Attention cuts its FULL q/k norm weights).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch
from safetensors import safe_open
from tqdm import tqdm

from shared.model.config import ModelConfig
from shared.model.expert_shards import shard_experts
from shared.model.quantization import (
    SCALE_TENSOR,
    QuantizedCheckpointError,
    QuantMethod,
    load_method_for,
    quant_method_for,
)
from shared.model.transformer import CausalLM
from shared.sharding.dispatch import EPDispatch
from shared.sharding.group import RankGroup
from shared.sharding.layout import LayoutError, ParallelLayout
from shared.sharding.placement import ExpertPlacement

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Checkpoint spellings rewritten to the canonical (Qwen-style) names before lookup.
RENAMES: dict[str, list[tuple[str, str]]] = {
    "mixtral": [
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    ],
    "gpt_oss": [(r"\.mlp\.router\.", ".mlp.gate.")],
}
# The inverse: canonical names back to the checkpoint's own spelling (for messages and demo checkpoints).
CHECKPOINT_SPELLING: dict[str, list[tuple[str, str]]] = {
    "mixtral": [
        (r"\.mlp\.", ".block_sparse_moe."),
        (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."),
        (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
        (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2."),
    ],
    "gpt_oss": [(r"\.mlp\.gate\.", ".mlp.router.")],
}
# Tensors some checkpoints carry that hold nothing we need.
IGNORED = re.compile(r"(rotary_emb\.inv_freq$)")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Above this many bytes of weights, show a progress bar unless told otherwise.
PROGRESS_BYTES = 1 << 30


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete or does not match its config."""


@runtime_checkable
class _Sharded(Protocol):
    """A module whose parameters are filled from pieces of several checkpoint tensors."""

    def checkpoint_shards(self) -> dict[str, tuple]: ...


# A module's declaration: checkpoint tensor (relative name) → (parameter (dotted name), the slice of it the
# tensor fills[, the slice of the checkpoint tensor this rank reads[, a function from the tensor read to what
# the slice holds (a layout change: gpt-oss's stacked experts)]]); () = all of it.
Shard = tuple[str, tuple] | tuple[str, tuple, tuple] | tuple[str, tuple, tuple, Callable]


@runtime_checkable
class _Partial(Protocol):
    """A module holding only part of the checkpoint's tensors under its name (expert parallelism): the rest
    belong to other ranks, and the loader skips them without reading them or warning."""

    def checkpoint_ignored(self) -> set[str]: ...


@dataclass(frozen=True)
class _Target:
    param: torch.Tensor
    index: tuple  # the slice of `param` this checkpoint tensor fills; () = all of it
    source: tuple = ()  # the slice of the checkpoint tensor this rank reads; () = all of it
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to the tensor read, before the copy


def resolve_dtype(requested: str | torch.dtype | None, checkpoint_dtype: str | None) -> torch.dtype:
    """The requested dtype, else the checkpoint's own, else float32."""
    if isinstance(requested, torch.dtype):
        return requested
    name = requested or checkpoint_dtype or "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    group: RankGroup | None = None,
    layout: ParallelLayout | None = None,
    expert_placement: ExpertPlacement | None = None,
    ep_dispatch: EPDispatch | str = EPDispatch.ALLREDUCE,
    quantization: str | None = None,
) -> CausalLM:
    """The model of `model_dir`, or with `group` and `layout` this rank's shard of it, reading only its slices
    from the files: tp > 1 splits heads and widths; ep > 1 gives this rank only its experts
    (`expert_placement`, or a contiguous 1/ep), combined across the group by `ep_dispatch`. LayoutError when
    the model cannot take the layout (heads, KV heads or an intermediate size that does not split).
    `quantization`: a method made at load from the float weights (quantization.LOAD_METHODS: int8), applied once
    they are loaded; refused (UnsupportedQuantizationError) before any weight is read where it cannot apply."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    quant = checkpoint_quantization(model_dir)  # refuses an unsupported quantization before building anything
    compute_dtype = resolve_dtype(dtype, cfg.torch_dtype)
    at_load = None
    if quantization is not None:
        at_load = load_method_for(str(quantization), quant, compute_dtype, torch.device(device))
    with torch.device("meta"):
        model = CausalLM(cfg, group, layout)
    if layout is not None and layout.data_parallel and not model.sparse_layers():
        raise LayoutError(
            f"--dp-attention runs the MoE layers expert-parallel across the ranks: {model_dir} has no routed experts "
            "(serve a dense model with --tp instead)"
        )
    if layout is not None and layout.ep > 1:
        assert group is not None  # CausalLM checked the group's size against the layout
        shard_experts(model, group, expert_placement, ep_dispatch, data_parallel=layout.data_parallel)
    model.to(compute_dtype).to_empty(device=device)
    load_weights(model, model_dir, progress, quant)
    if at_load is not None:
        log.info("quantized at load: %s", at_load.apply(model))
    model.init_runtime()
    return model.eval()


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in {index.name} are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(
    model: CausalLM, model_dir: Path, progress: bool | None = None, quant: QuantMethod | None = None
) -> None:
    """Fill `model` from the checkpoint, each tensor through the checkpoint's quantization method (`quant`, else
    read from config.json): dequantized to the parameter's dtype. Every checkpoint tensor is accounted for:
    loaded, consumed by its weight's method (scales), another rank's, or known to be unneeded; anything else is
    a CheckpointError, since a weight we did not load (a bias, a scale) means the model would be wrong."""
    quant = quant or checkpoint_quantization(model_dir)
    targets = checkpoint_targets(model)
    others = checkpoint_ignored(model)
    renames = [(re.compile(a), b) for a, b in RENAMES.get(model.config.model_type, [])]
    files = checkpoint_files(model_dir)
    quant = checkpoint_quantization(model_dir)
    if progress is None:
        progress = sum(f.stat().st_size for f in files) > PROGRESS_BYTES
    loaded: set[str] = set()
    mtp_skipped = 0
    with torch.no_grad(), CheckpointTensors(files) as tensors:
        for raw_name in tqdm(tensors.names, desc="loading weights", disable=not progress, unit="tensor"):
            if quant.companion_of(raw_name) is not None:  # a scale: read with the weight it scales
                continue
            name = _renamed(quant.weight_name(raw_name), renames)  # MXFP4: `<w>_blocks` holds `<w>`
            target = targets.get(name)
            if target is None:
                if name not in others:  # another rank's (its experts): never read
                    mtp_skipped += _check_unneeded(model, raw_name, name)
                continue
            try:
                tensor = quant.read(tensors, raw_name, target.source)
            except QuantizedCheckpointError as e:
                raise CheckpointError(f"{model_dir}: {e}") from e
            if target.convert is not None:
                tensor = target.convert(tensor)
            dest = target.param[target.index]
            if tuple(dest.shape) != tuple(tensor.shape):
                got = tensors.shape(raw_name)
                raise CheckpointError(
                    f"tensor {raw_name} has shape {got}, the config implies "
                    f"{tuple(dest.shape) if not target.source else 'a slice ' + str(tuple(dest.shape))}"
                )
            dest.copy_(tensor)
            loaded.add(name)
        unused = [
            n
            for n in tensors.names
            if (weight := quant.companion_of(n)) is not None
            and n not in tensors.read_names
            and _renamed(weight, renames) not in others  # another rank's expert: skipped unread with its weight
        ]
        if unused:
            raise CheckpointError(f"{model_dir}: scale tensor(s) no float8 weight used: {', '.join(unused[:5])}")
    if mtp_skipped:
        log.info(
            "skipped the %d tensors of the %d multi-token-prediction layer(s): nothing runs them (no speculative "
            "decoding)",
            mtp_skipped,
            model.config.mtp_layers,
        )
    missing = sorted(checkpoint_name(model.config.model_type, n) for n in set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensor(s): {shown}")


def checkpoint_quantization(model_dir: Path) -> QuantMethod:
    """How this checkpoint's tensors are read (`quantization_config` of its config.json); refused by name when
    its quantization is not supported."""
    return quant_method_for(json.loads((Path(model_dir) / "config.json").read_text()))


def _check_unneeded(model: CausalLM, raw_name: str, name: str) -> bool:
    """Accept a checkpoint tensor no parameter takes only when it is known not to matter (→ whether it is one of
    the declared multi-token-prediction layers'); CheckpointError otherwise."""
    if _is_mtp(name, model.config):  # never read
        return True
    if IGNORED.search(name) or (name == "lm_head.weight" and model.lm_head is None):
        return False
    if SCALE_TENSOR.search(name):
        raise CheckpointError(
            f"checkpoint tensor {raw_name} is a quantization scale, but config.json's quantization_config "
            "(none, or one that does not use it) does not say how: its weights would load wrong"
        )
    raise CheckpointError(f"checkpoint tensor {raw_name} matches no parameter of the model")


def _renamed(name: str, renames: list) -> str:
    for pattern, repl in renames:
        name = pattern.sub(repl, name)
    return name


class CheckpointTensors:
    """Every tensor of the checkpoint's files by name (one open handle per file), read whole or sliced; records
    which it read (the loader's proof that each scale was used)."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        self.names: list[str] = []
        self.read_names: set[str] = set()
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle
                self.names.append(name)

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._where[name].get_slice(name).get_dtype()]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        self.read_names.add(name)
        handle = self._where[name]
        return handle.get_slice(name)[index] if index else handle.get_tensor(name)


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """A tensor of the multi-token-prediction layers the config declares after its last decoder layer
    (model.layers.{num_layers .. num_layers + mtp_layers - 1}.*); any other layer index is not one."""
    match = LAYER_INDEX.match(name)
    return match is not None and cfg.num_layers <= int(match.group(1)) < cfg.num_layers + cfg.mtp_layers


def checkpoint_name(model_type: str, canonical: str) -> str:
    """How a checkpoint of `model_type` spells the tensor we call `canonical`."""
    for pattern, repl in CHECKPOINT_SPELLING.get(model_type, []):
        canonical = re.sub(pattern, repl, canonical)
    return canonical


def checkpoint_targets(model: CausalLM) -> dict[str, _Target]:
    """Checkpoint tensor name (canonical spelling) → the parameter slice it loads into."""
    targets: dict[str, _Target] = {}
    for prefix, module in model.named_modules():  # parents before children: a parent's declaration wins
        shards = _shards(module)
        covered = {declared[0] for declared in shards.values()}
        for suffix, (param, index, *rest) in shards.items():
            source = cast(tuple, rest[0]) if rest else ()
            convert = cast(Callable[[torch.Tensor], torch.Tensor], rest[1]) if len(rest) > 1 else None
            targets[_join(prefix, suffix)] = _Target(module.get_parameter(param), index, source, convert)
        for name, tensor in _checkpoint_tensors(module):
            if name not in covered:
                targets.setdefault(_join(prefix, name), _Target(tensor, ()))
    return targets


def _checkpoint_tensors(module: torch.nn.Module):
    """A module's own parameters and persistent buffers (a router's correction bias): what a checkpoint holds."""
    yield from module.named_parameters(recurse=False)
    for name, buffer in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            yield name, buffer


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters on this rank (its shard; oneDNN-packed twins not counted)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_ignored(model: CausalLM) -> set[str]:
    """Checkpoint tensor names (canonical) that other ranks of the worker group load, not this one."""
    return {
        _join(prefix, name)
        for prefix, module in model.named_modules()
        if isinstance(module, _Partial)
        for name in module.checkpoint_ignored()
    }


def _shards(module: torch.nn.Module) -> dict[str, Shard]:
    return module.checkpoint_shards() if isinstance(module, _Sharded) else {}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
