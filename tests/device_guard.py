"""A dispatch mode that makes device-placement mistakes fail on a CPU-only machine.

Run the engine with every weight, buffer and input on the `meta` device (tensors with shapes, no data)
under `DeviceGuard`. A CUDA run fails where tensors of two devices meet; meta alone is lenient (a CPU
table indexed by meta positions just works), so the guard checks every aten op itself:

- no op mixes devices (0-dim CPU tensors excepted: CUDA accepts them as scalars);
- no op reads a device value on the host (`.item()`, `.tolist()`, data-dependent shapes): a sync;
- device → host copies are recorded (`readbacks`), and answered with zeros (meta has no data to copy);
- inside a watched module's forward (`watch`): no host → device copy and no tensor created on the host, since
  everything the forward needs arrives with its inputs.

A violation raises `DeviceMisplacement` at the offending op, so the traceback names the line.
"""

from __future__ import annotations

import torch
from torch.fx.operator_schemas import normalize_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

aten = torch.ops.aten
HOST = torch.device("cpu")
# Ops whose result the host must wait for: a value read, or an output shape that depends on the data.
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}
COPY_PACKETS = {aten._to_copy, aten.to}  # and copy_


class DeviceMisplacement(AssertionError):
    """A tensor was on the wrong device, or the host waited for the device."""


class DeviceGuard(TorchDispatchMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.readbacks: list[tuple[tuple[int, ...], torch.dtype]] = []  # device → host copies: shape, dtype
        self.h2d = 0  # host → device copies
        self.strict = False

    def watch(self, module: torch.nn.Module) -> list[RemovableHandle]:
        """Make `module`'s forward strict: the host prepares nothing inside it (no host tensor is created,
        nothing crosses either way). Returns the hook handles."""

        def enter(*_):
            self.strict = True

        def leave(*_):
            self.strict = False

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = str(func)
        on_device = [t for t in inputs if t.device == self.device]
        if on_device and func in SYNC_OPS:
            raise DeviceMisplacement(f"{name} reads a {self.device} tensor on the host (a sync)")
        if func is aten.copy_.default or func.overloadpacket in COPY_PACKETS:
            return self._copy(func, name, args, kwargs)
        devices = {t.device for t in inputs if not (t.device == HOST and t.dim() == 0)}
        if len(devices) > 1:
            shapes = ", ".join(f"{tuple(t.shape)}@{t.device}" for t in inputs)
            raise DeviceMisplacement(f"{name} mixes devices: {shapes}")
        out = func(*args, **kwargs)
        if self.strict:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device == HOST:
                    raise DeviceMisplacement(f"{name} creates a host tensor {tuple(t.shape)} inside the forward")
        return out

    def _copy(self, func, name, args, kwargs):
        src, dst, dtype = _copy_ends(func, args, kwargs)
        shape = tuple(src.shape)
        if src.device == dst:  # a dtype or layout change on one device
            if self.strict and dst == HOST:
                raise DeviceMisplacement(f"{name} creates a host tensor {shape} inside the forward")
            return func(*args, **kwargs)
        if self.strict:
            raise DeviceMisplacement(f"{name} copies {shape} from {src.device} to {dst} inside the forward")
        if src.device == self.device and dst == HOST:
            self.readbacks.append((shape, src.dtype))
            if self.device.type == "meta":  # no data to copy: hand back zeros of the right shape
                if func is aten.copy_.default:
                    return args[0].zero_()
                return torch.zeros(shape, dtype=dtype)
        elif src.device == HOST and dst == self.device:
            self.h2d += 1
        else:
            raise DeviceMisplacement(f"{name} copies {shape} from {src.device} to {dst}")
        return func(*args, **kwargs)


def _copy_ends(func, args, kwargs) -> tuple[torch.Tensor, torch.device, torch.dtype]:
    """(source tensor, destination device, destination dtype) of a copy op (copy_, to, _to_copy)."""
    if func is aten.copy_.default:  # copy_(dst, src)
        return args[1], args[0].device, args[0].dtype
    normalized = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True)
    assert normalized is not None, func
    kw = normalized.kwargs
    src, other = args[0], kw.get("other")  # every overload takes the source first
    dst = kw.get("device") or (other.device if other is not None else src.device)
    dtype = kw.get("dtype") or (other.dtype if other is not None else src.dtype)
    return src, torch.device(dst), dtype
