"""A decoder layer's RMSNorm in one pass:

    rms_norm(x [..., H], weight [H], eps, round_normalized=False) -> y [..., H] in x's dtype
    rms_norm_quant(x, weight, eps, group_size=128, round_normalized=False)
        -> (q e4m3 [..., H], s float32 [..., H / group_size])
    add_rms_norm(x, residual, weight, eps, round_normalized=False) -> (y, h)
    add_rms_norm_quant(x, residual, weight, eps, group_size=128, round_normalized=False) -> (q, s, h)

y = x * rsqrt(mean(x^2 over the last dim) + eps) * weight, computed in fp32 and rounded once, as torch.nn.RMSNorm's
fused kernel computes it; with round_normalized, x * rsqrt(...) is rounded to x's dtype before the weight multiplies
it, as transformers' Llama-family norms compute `weight * hidden_states.to(input_dtype)` (weight in x's dtype).
A row holding NaN or inf comes out NaN or inf as in torch, never a number made up. rms_norm_quant quantizes the
same fp32 y (not rounded to x's dtype first) per token in groups of group_size as act_quant does: what fp8_gemm takes
as its A operand, so an FP8 layer after the norm needs no act_quant of its own (a NaN y codes NaN, an inf makes its
group's scale inf, as act_quant says).
The add_ ops first add the residual stream, h = x + residual rounded once to x's dtype (what torch's x + residual
gives), return h and normalize it: a decoder layer's residual add and the next norm in one launch (vLLM's
fused_add_rms_norm, without writing into its inputs).
The kernels (kernel_defs/rms_norm.toml): rms_norm and add_rms_norm from sm_80, the _quant ops from sm_89 (e4m3
stores); on CPU tensors Triton's interpreter runs them under TRITON_INTERPRET=1, else kdsl/ops/fallback.py's torch
code.
"""
from __future__ import annotations

import math

import torch

from kdsl.ops import _checks as check
from kdsl.ops import _plan, fallback
from kdsl.ops._examples import empty
from kdsl.ops.block_fp8 import FLOAT_INPUTS, FP8, _group_quant_outputs
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

# A program holds whole rows in registers (kdsl/kernels/block_fp8/rms_norm.py): 256 fp32 values a thread at 8 warps.
MAX_HIDDEN = 65536

_PLANS = _plan.PLANS
_device = _plan.current_device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, round_normalized: bool = False) -> torch.Tensor:
    """y [..., H] = x * rsqrt(mean(x^2) + eps) * weight in x's dtype (bf16, fp16 or fp32), in fp32 and rounded once
    (round_normalized: x * rsqrt(...) rounded to x's dtype first, then times weight and rounded again). weight [H] in
    any of those dtypes; eps a finite number >= 0. x needs unit stride along its last dim only where it is 2-D
    (otherwise it is copied as reshape copies). Empty inputs give empty outputs."""
    if torch.compiler.is_compiling():  # one opaque op for Dynamo, as kdsl.ops.act_quant
        return torch.ops.kdsl.rms_norm(x, weight, eps, round_normalized)
    return _rms_norm_impl(x, weight, eps, round_normalized)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, group_size: int = 128,
                   round_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm as rms_norm computes it in fp32, quantized as kdsl.ops.act_quant quantizes: (q float8_e4m3fn
    [..., H], s float32 [..., H / group_size]), H a multiple of group_size. x, weight, eps and round_normalized as
    rms_norm takes them."""
    if torch.compiler.is_compiling():
        return torch.ops.kdsl.rms_norm_quant(x, weight, eps, group_size, round_normalized)
    return _rms_norm_quant_impl(x, weight, eps, group_size, round_normalized)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 round_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual in x's dtype (residual: x's shape and dtype), y = rms_norm(h, weight, eps,
    round_normalized), in one launch. x, weight, eps and round_normalized as rms_norm takes them."""
    if torch.compiler.is_compiling():
        return torch.ops.kdsl.add_rms_norm(x, residual, weight, eps, round_normalized)
    return _add_rms_norm_impl(x, residual, weight, eps, round_normalized)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       group_size: int = 128,
                       round_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, h): h = x + residual as add_rms_norm adds them, (q, s) = rms_norm_quant(h, weight, eps, group_size,
    round_normalized), in one launch."""
    if torch.compiler.is_compiling():
        return torch.ops.kdsl.add_rms_norm_quant(x, residual, weight, eps, group_size, round_normalized)
    return _add_rms_norm_quant_impl(x, residual, weight, eps, group_size, round_normalized)


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    check.tensor("residual", residual, (x.dtype,))
    check.shape("residual", residual, tuple(x.shape), "x's shape")
    check.same_device(x=x, residual=residual)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool) -> None:
    check.tensor("x", x, FLOAT_INPUTS, min_ndim=1)
    check.tensor("weight", weight, FLOAT_INPUTS, ndim=1)
    check.shape("weight", weight, (x.shape[-1],), "x's last dimension")
    check.same_device(x=x, weight=weight)
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"x: last dimension {x.shape[-1]} is above {MAX_HIDDEN}, the most rms_norm's kernel holds "
                         "in registers")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if not isinstance(round_normalized, bool):
        raise TypeError(f"round_normalized: expected a bool, got {type(round_normalized).__name__}")


def _rms_norm_outputs(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool,
                      op: str = "rms_norm") -> tuple[str, torch.Tensor]:
    """rms_norm's checks and its empty output (the fake kernel under torch.compile too); op: whose scheme."""
    _check_norm(x, weight, eps, round_normalized)
    return registry.any_scheme(op), x.new_empty(x.shape)


def _rms_norm_quant_outputs(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                            round_normalized: bool,
                            op: str = "rms_norm_quant") -> tuple[str, torch.Tensor, torch.Tensor]:
    """rms_norm_quant's checks and its empty outputs (the fake kernel under torch.compile too); op: whose scheme."""
    _check_norm(x, weight, eps, round_normalized)
    check.positive_power_of_two("group_size", group_size)
    if x.shape[-1] % group_size:
        raise ValueError(f"x: last dimension {x.shape[-1]} must be a multiple of group_size = {group_size}")
    return _group_quant_outputs(op, x, group_size)


def _add_outputs(x, residual, weight, eps, round_normalized):
    """add_rms_norm's checks and its empty outputs (y, h): rms_norm's, and the residual's."""
    check.tensor("x", x, FLOAT_INPUTS, min_ndim=1)
    _check_residual(x, residual)
    return (*_rms_norm_outputs(x, weight, eps, round_normalized, "add_rms_norm"), x.new_empty(x.shape))


def _add_quant_outputs(x, residual, weight, eps, group_size, round_normalized):
    """add_rms_norm_quant's checks and its empty outputs (q, s, h): rms_norm_quant's, and the residual's."""
    check.tensor("x", x, FLOAT_INPUTS, min_ndim=1)
    _check_residual(x, residual)
    return (*_rms_norm_quant_outputs(x, weight, eps, group_size, round_normalized, "add_rms_norm_quant"),
            x.new_empty(x.shape))


def _plan_key(op, x, weight, eps, round_normalized, *extra, residual=None):
    try:  # the launch plan's key (kdsl/ops/_plan.py); not a tensor: the checks word the error
        return (op, *extra, type(eps), eps, type(round_normalized), round_normalized, _device(),
                type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad,
                type(weight), weight.shape, weight.stride(), weight.dtype, weight.device, weight.data_ptr() & 15,
                weight.requires_grad) + (() if residual is None else (
                    type(residual), residual.shape, residual.stride(), residual.dtype, residual.device,
                    residual.data_ptr() & 15, residual.requires_grad))
    except Exception:
        return None


def _replayed(key, *inputs):
    """(the launch plan stored under key or None, its outputs replayed on inputs or None where it declines)."""
    plan = _PLANS.get(key) if key is not None else None
    return plan, (plan(*inputs) if plan else None)


def _launch(op, scheme, key, plan, inputs, weight, outputs, eps, round_normalized, plan_inputs):
    """op's kernel on the rows of inputs (x, and the residual for the add_ ops) and weight, writing outputs, with the
    launch plan recorded under key: every norm kernel's launch takes them in this order."""
    hidden = inputs[0].shape[-1]
    rows = [check.rows(t, hidden) for t in inputs]
    entry = registry.dispatch(op, scheme, inputs[0].device)
    with _plan.Recorder(entry.load() if plan is None else None) as rec:
        entry.launch(*rows, weight.contiguous(), *[t.view(-1, t.shape[-1]) for t in outputs], float(eps),
                     round_normalized, entry.tile_for(rows[0].shape[0]))
    _plan.store(key, rec, plan_inputs, outputs)


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool) -> torch.Tensor:
    key = _plan_key("rms_norm", x, weight, eps, round_normalized)
    plan, y = _replayed(key, x, weight)  # one output: the tensor itself
    if y is not None:
        return y
    scheme, y = _rms_norm_outputs(x, weight, eps, round_normalized)
    if y.numel() == 0:
        return y
    if not check.use_kernels(x.device):
        return fallback.rms_norm(x, weight, eps, round_normalized).contiguous()
    _launch("rms_norm", scheme, key, plan, (x,), weight, (y,), eps, round_normalized, (x, weight))
    return y


def _rms_norm_quant_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                         round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = _plan_key("rms_norm_quant", x, weight, eps, round_normalized, type(group_size), group_size)
    plan, outputs = _replayed(key, x, weight)
    if outputs is not None:
        return outputs
    scheme, q, s = _rms_norm_quant_outputs(x, weight, eps, group_size, round_normalized)
    if q.numel() == 0:
        return q, s
    if not check.use_kernels(x.device):
        q, s = fallback.rms_norm_quant(x, weight, eps, group_size, round_normalized)
        return q.contiguous(), s.contiguous()
    _launch("rms_norm_quant", scheme, key, plan, (x,), weight, (q, s), eps, round_normalized, (x, weight))
    return q, s


def _add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = _plan_key("add_rms_norm", x, weight, eps, round_normalized, residual=residual)
    plan, outputs = _replayed(key, x, residual, weight)
    if outputs is not None:
        return outputs
    scheme, y, h = _add_outputs(x, residual, weight, eps, round_normalized)
    if y.numel() == 0:
        return y, h
    if not check.use_kernels(x.device):
        y, h = fallback.add_rms_norm(x, residual, weight, eps, round_normalized)
        return y.contiguous(), h.contiguous()
    _launch("add_rms_norm", scheme, key, plan, (x, residual), weight, (y, h), eps, round_normalized,
            (x, residual, weight))
    return y, h


def _add_rms_norm_quant_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             group_size: int,
                             round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = _plan_key("add_rms_norm_quant", x, weight, eps, round_normalized, type(group_size), group_size,
                    residual=residual)
    plan, outputs = _replayed(key, x, residual, weight)
    if outputs is not None:
        return outputs
    scheme, q, s, h = _add_quant_outputs(x, residual, weight, eps, group_size, round_normalized)
    if q.numel() == 0:
        return q, s, h
    if not check.use_kernels(x.device):
        q, s, h = fallback.add_rms_norm_quant(x, residual, weight, eps, group_size, round_normalized)
        return q.contiguous(), s.contiguous(), h.contiguous()
    _launch("add_rms_norm_quant", scheme, key, plan, (x, residual), weight, (q, s, h), eps, round_normalized,
            (x, residual, weight))
    return q, s, h


# --- torch.ops.kdsl.rms_norm, rms_norm_quant and their add_ forms (kdsl.ops.spec)

def _rms_norm_fake(x, weight, eps, round_normalized):
    return _rms_norm_outputs(x, weight, eps, round_normalized)[1]


def _rms_norm_example(tile, dtype, device):
    """Rows of 1000: the program's last columns lie past H; both roundings."""
    rows, width = 64, 1000
    for round_normalized in (False, True):
        yield (empty(device, rows, width, dtype=dtype), empty(device, width, dtype=dtype),
               empty(device, rows, width, dtype=dtype), 1e-6, round_normalized)


def _rms_norm_quant_fake(x, weight, eps, group_size, round_normalized):
    _, q, s = _rms_norm_quant_outputs(x, weight, eps, group_size, round_normalized)
    return q, s


def _rms_norm_quant_example(tile, dtype, device):
    """Rows of 896 (seven groups): the program's last group lies past H; both roundings."""
    rows, width = 64, 896
    for round_normalized in (False, True):
        yield (empty(device, rows, width, dtype=dtype), empty(device, width, dtype=dtype),
               empty(device, rows, width, dtype=FP8), empty(device, rows, width // 128, dtype=torch.float32), 1e-6,
               round_normalized)


def _add_rms_norm_fake(x, residual, weight, eps, round_normalized):
    _, y, h = _add_outputs(x, residual, weight, eps, round_normalized)
    return y, h


def _add_rms_norm_example(tile, dtype, device):
    """rms_norm's example with a residual and h."""
    for x, weight, y, eps, round_normalized in _rms_norm_example(tile, dtype, device):
        yield x, empty(device, *x.shape, dtype=dtype), weight, y, empty(device, *x.shape, dtype=dtype), eps, \
            round_normalized


def _add_rms_norm_quant_fake(x, residual, weight, eps, group_size, round_normalized):
    _, q, s, h = _add_quant_outputs(x, residual, weight, eps, group_size, round_normalized)
    return q, s, h


def _add_rms_norm_quant_example(tile, dtype, device):
    """rms_norm_quant's example with a residual and h."""
    for x, weight, q, s, eps, round_normalized in _rms_norm_quant_example(tile, dtype, device):
        yield x, empty(device, *x.shape, dtype=dtype), weight, q, s, empty(device, *x.shape, dtype=dtype), eps, \
            round_normalized


SPECS = (
    OpSpec("rms_norm", "(Tensor x, Tensor weight, float eps, bool round_normalized) -> Tensor", _rms_norm_impl,
           _rms_norm_fake, example=_rms_norm_example),
    OpSpec("rms_norm_quant",
           "(Tensor x, Tensor weight, float eps, int group_size, bool round_normalized) -> (Tensor, Tensor)",
           _rms_norm_quant_impl, _rms_norm_quant_fake, example=_rms_norm_quant_example),
    OpSpec("add_rms_norm",
           "(Tensor x, Tensor residual, Tensor weight, float eps, bool round_normalized) -> (Tensor, Tensor)",
           _add_rms_norm_impl, _add_rms_norm_fake, example=_add_rms_norm_example),
    OpSpec("add_rms_norm_quant",
           "(Tensor x, Tensor residual, Tensor weight, float eps, int group_size, bool round_normalized) "
           "-> (Tensor, Tensor, Tensor)",
           _add_rms_norm_quant_impl, _add_rms_norm_quant_fake, example=_add_rms_norm_quant_example),
)
