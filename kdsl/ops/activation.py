"""The gated MLP's activation on the fused gate-up GEMM's output: h = silu(gate) * up, in one pass.

    silu_mul(gate_up [..., 2I])                    -> h [..., I] in gate_up's dtype
    silu_mul_quant(gate_up [..., 2I], group_size)  -> (q e4m3 [..., I], s float32 [..., I / group_size])

gate_up holds gate's I columns, then up's (what one GEMM over the stacked gate and up weights writes). h is computed
in fp32 (silu as torch computes it, gate / (1 + exp(-gate))) and rounded once: to gate_up's dtype, or quantized
per token in groups of group_size as act_quant quantizes (s = amax / 448; NaN elements left out of the amax and
coded NaN; a group holding +-inf gets s = inf; an all-zero group a finite scale). silu(-inf) is NaN, as in torch.
The kernels (kernel_defs/silu_mul.toml): silu_mul from sm_80, silu_mul_quant from sm_89 (e4m3 stores); on CPU
tensors Triton's interpreter runs them under TRITON_INTERPRET=1, else kdsl/ops/fallback.py's torch code.
"""
from __future__ import annotations

import torch

from kdsl.kernels.host import dependent_launches
from kdsl.ops import _checks as check
from kdsl.ops import _plan, fallback
from kdsl.ops._examples import empty
from kdsl.ops.block_fp8 import FLOAT_INPUTS, FP8, _group_quant_outputs
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

_PLANS = _plan.PLANS
_device = _plan.current_device


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """h [..., I] = silu(gate_up[..., :I]) * gate_up[..., I:] in gate_up's dtype (bf16, fp16 or fp32), computed
    in fp32 and rounded once. gate_up [..., 2I] needs unit stride along its last dim only where it is 2-D
    (otherwise it is copied as reshape copies). Empty inputs give empty outputs."""
    if torch.compiler.is_compiling():  # one opaque op for Dynamo, as kdsl.ops.act_quant
        return torch.ops.kdsl.silu_mul(gate_up)
    return _silu_mul_impl(gate_up)


def silu_mul_quant(gate_up: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(gate_up[..., :I]) * gate_up[..., I:] in fp32, quantized as kdsl.ops.act_quant(h, group_size)
    quantizes: (q float8_e4m3fn [..., I], s float32 [..., I / group_size]), I a multiple of group_size. What
    fp8_gemm takes as its A operand: an FP8 MLP's down projection reads it without an act_quant of its own."""
    if torch.compiler.is_compiling():
        return torch.ops.kdsl.silu_mul_quant(gate_up, group_size)
    return _silu_mul_quant_impl(gate_up, group_size)


def _half(gate_up: torch.Tensor) -> int:
    check.tensor("gate_up", gate_up, FLOAT_INPUTS, min_ndim=1)
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up: expected an even last dimension (gate's I columns, then up's), got {width}")
    return width // 2


def _silu_mul_outputs(gate_up: torch.Tensor) -> tuple[str, torch.Tensor]:
    """silu_mul's checks and its empty output (the fake kernel under torch.compile too)."""
    inter = _half(gate_up)
    return registry.any_scheme("silu_mul"), gate_up.new_empty((*gate_up.shape[:-1], inter))


def _silu_mul_quant_outputs(gate_up: torch.Tensor, group_size: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """silu_mul_quant's checks and its empty outputs (the fake kernel under torch.compile too)."""
    inter = _half(gate_up)
    check.positive_power_of_two("group_size", group_size)
    if inter % group_size:
        raise ValueError(f"gate_up: last dimension 2I = {2 * inter}: I = {inter} must be a multiple of "
                         f"group_size = {group_size}")
    return _group_quant_outputs("silu_mul_quant", gate_up, group_size, inter)


def _plan_key(op: str, gate_up, *extra):
    try:  # the launch plan's key (kdsl/ops/_plan.py); not a tensor: the checks word the error
        return (op, *extra, _device(), type(gate_up), gate_up.shape, gate_up.stride(), gate_up.dtype,
                gate_up.device, gate_up.data_ptr() & 15, gate_up.requires_grad)
    except Exception:
        return None


def _silu_mul_impl(gate_up: torch.Tensor) -> torch.Tensor:
    key = _plan_key("silu_mul", gate_up)
    plan = _PLANS.get(key) if key is not None else None
    if plan:
        h = plan(gate_up)  # one output: the tensor itself
        if h is not None:
            return h
    scheme, h = _silu_mul_outputs(gate_up)
    if h.numel() == 0:
        return h
    if not check.use_kernels(gate_up.device):
        return fallback.silu_mul(gate_up).contiguous()
    entry = registry.dispatch("silu_mul", scheme, gate_up.device)
    rows = check.rows(gate_up, gate_up.shape[-1])
    tile = entry.tile_for(rows.shape[0])
    with _plan.Recorder(entry.load() if plan is None else None) as rec:
        entry.launch(rows, h.view(-1, h.shape[-1]), tile,
                     dependent=tile.get("pdl") is True and dependent_launches(gate_up.device))
    _plan.store(key, rec, (gate_up,), (h,))
    return h


def _silu_mul_quant_impl(gate_up: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = _plan_key("silu_mul_quant", gate_up, type(group_size), group_size)
    plan = _PLANS.get(key) if key is not None else None
    if plan:
        outputs = plan(gate_up)
        if outputs is not None:
            return outputs
    scheme, q, s = _silu_mul_quant_outputs(gate_up, group_size)
    if q.numel() == 0:
        return q, s
    if not check.use_kernels(gate_up.device):
        q, s = fallback.silu_mul_quant(gate_up, group_size)
        return q.contiguous(), s.contiguous()
    entry = registry.dispatch("silu_mul_quant", scheme, gate_up.device)
    rows = check.rows(gate_up, gate_up.shape[-1])
    with _plan.Recorder(entry.load() if plan is None else None) as rec:
        entry.launch(rows, q.view(-1, q.shape[-1]), s.view(-1, s.shape[-1]), entry.tile_for(rows.shape[0]))
    _plan.store(key, rec, (gate_up,), (q, s))
    return q, s


# --- torch.ops.kdsl.* (kdsl.ops.spec): the gated MLP's activation

def _silu_mul_fake(gate_up):
    return _silu_mul_outputs(gate_up)[1]


def _silu_mul_quant_fake(gate_up, group_size):
    _, q, s = _silu_mul_quant_outputs(gate_up, group_size)
    return q, s


def _silu_mul_example(tile, dtype, device):
    yield empty(device, 64, 1024, dtype=dtype), empty(device, 64, 512, dtype=dtype)


def _silu_mul_quant_example(tile, dtype, device):
    yield (empty(device, 64, 1024, dtype=dtype), empty(device, 64, 512, dtype=FP8),
           empty(device, 64, 4, dtype=torch.float32))


SPECS = (
    OpSpec("silu_mul", "(Tensor gate_up) -> Tensor", _silu_mul_impl, _silu_mul_fake, example=_silu_mul_example),
    OpSpec("silu_mul_quant", "(Tensor gate_up, int group_size) -> (Tensor, Tensor)", _silu_mul_quant_impl,
           _silu_mul_quant_fake, example=_silu_mul_quant_example),
)
