"""Argument checks shared by the ops: each error names the argument, what was expected and what came."""
from __future__ import annotations

import os

import torch

from kdsl.runtime.registry import INTERPRET_ENV

_DTYPE_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.int32: "int32",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def tensor(name: str, value, dtypes: tuple[torch.dtype, ...], ndim: int | None = None, min_ndim: int | None = None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.requires_grad and torch.is_grad_enabled():
        inference_only(name)
    if value.dtype not in dtypes:
        wanted = " or ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {wanted}, got {dtype_name(value.dtype)}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    return value


NO_BACKWARD = ("{name}: requires grad, but kdsl's quantized ops have no backward (inference only): run them under "
               "torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def inference_only(name: str) -> None:
    """Refuse an input that requires grad while grad mode is on. Every op checks every tensor through tensor(),
    so the kernels, the interpreter and the torch fallback refuse alike (the fallback would otherwise build a
    graph, the kernels' outputs would silently have none)."""
    raise RuntimeError(NO_BACKWARD.format(name=name))


def shape(name: str, value: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(value.shape) != tuple(expected):
        note = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{note}, got {tuple(value.shape)}")


def same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name}: expected device {first} (like {first_name}), got {device}")
    return first


def positive_power_of_two(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: expected a positive power of two, got {value!r}")
    return value


def out_dtype(name: str, value, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    if value not in allowed:
        wanted = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name}: expected one of {wanted}, got {value!r}")
    return value


def rows(value: torch.Tensor, last: int) -> torch.Tensor:
    """[..., last] as a 2-D view with unit stride along the last dim (copies only if it must); value itself where it
    is such rows already (no view to make: host time on every call)."""
    if value.dim() == 2 and value.shape[1] == last and value.stride(1) == 1:
        return value
    flat = value.reshape(-1, last)
    return flat if flat.stride(-1) == 1 or flat.numel() == 0 else flat.contiguous()


def use_kernels(device: torch.device) -> bool:
    """CUDA tensors always run generated kernels; CPU tensors only under Triton's interpreter (the rule
    kdsl.registry.run_path words for reprs and explain; written out here: it runs on every call)."""
    return device.type == "cuda" or os.environ.get(INTERPRET_ENV) == "1"


def alignment(*tensors: torch.Tensor) -> int:
    """The largest power of two up to 16 dividing every base address and every stride in bytes of the tensors'
    dimensions that are stepped (size > 1, the last excepted: unit stride), 0 where such a stride is 0 (a
    broadcast): what TMA descriptors and vector loads care about (kdsl.runtime Call.align)."""
    value = 16
    for t in tensors:
        value |= t.data_ptr()
        for dim in range(t.dim() - 1):
            if t.shape[dim] > 1:
                if t.stride(dim) == 0:
                    return 0
                value |= t.stride(dim) * t.element_size()
    return value & -value
