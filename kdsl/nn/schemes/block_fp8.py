"""Block FP8 (kdsl.BlockFP8) as a unit: FP8Linear from float weights, the DeepSeek-V3 and compressed-tensors
FP8_BLOCK checkpoint formats, and the tensor-parallel shard rules.

Shard rules (weight float8 [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)]):
column: rank r gets rows [r*N/T, (r+1)*N/T). When that range is off the 128-row grid (DeepSeek's N = 576 or 2112
at T = 2/4/32), a scale block straddling two ranks is given to both: the rank's weight_scale_inv is the blocks its
rows touch, S[start // 128 : ceil(end / 128)], and its weight is realigned to them by `pad_front = start % 128`
zero rows in front (and zero rows behind up to a multiple of 8, which fp8_gemm needs), so row i of the shard's
weight still reads scale row i // 128. The shard computes pad_front + N/T (+ tail) outputs; the padded ones are
zeros and the module drops them (FP8Shard.out_slice). No value is requantized: every kept row has its original
codes and scale.
row: K / T must be a multiple of 128 (activations are quantized per 128 columns; a group cut between ranks would
quantize differently from the unsharded layer), else ShardError.
A gated MLP's gate and up are cut as columns and stacked into one weight, I / T a multiple of 128 (down's row cut).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdsl import ops
from kdsl.nn.modules import FP8Linear
from kdsl.nn.moe import FP8Experts
from kdsl.nn.schemes.base import (FLOATS, ColumnShard, GateUpShard, LayerFormat, RowShard, SchemeHandler, Spec,
                                  ShardError, check_rank, even, same_shape, tensor_of)
from kdsl.schema.scheme import BlockFP8


# --- shard rules ------------------------------------------------------------------------------------------

@dataclass
class FP8Shard:
    weight: torch.Tensor            # float8 [pad_front + rows + tail, K] (column) or [N, K / T] (row)
    weight_scale_inv: torch.Tensor  # float32, one scale per 128 x 128 block of weight
    bias: torch.Tensor | None       # column: this rank's bias, zero-padded like weight; row: None
    pad_front: int = 0              # leading zero rows realigning an off-grid shard to its scale rows
    out_features: int = 0           # this rank's real outputs (column: N / T, row: N)

    @property
    def out_slice(self) -> slice:
        return slice(self.pad_front, self.pad_front + self.out_features)


def shard_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None, *,
              rank: int, world_size: int, dim: str, block: tuple[int, int] = (128, 128),
              name: str = "weight") -> FP8Shard:
    """Rank's shard of a block-FP8 linear (see the module docstring for the off-grid rule)."""
    check_rank(rank, world_size, dim)
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    blocks = (-(-n // bn), -(-k // bk))
    if tuple(weight_scale_inv.shape) != blocks:
        raise ShardError(f"{name}_scale_inv {tuple(weight_scale_inv.shape)}: expected {blocks} for {name} "
                         f"{tuple(weight.shape)} in {bn}x{bk} blocks")
    if dim == "row":
        k0, k1 = even(name, weight.shape, f"K = {k}", k, rank, world_size, bk,
                       f"each rank's input must hold whole {bk}-column activation groups")
        return FP8Shard(weight[:, k0:k1].contiguous(), weight_scale_inv[:, k0 // bk:k1 // bk].contiguous(),
                        None, 0, n)
    n0, n1 = even(name, weight.shape, f"N = {n}", n, rank, world_size)
    b0, b1 = n0 // bn, -(-n1 // bn)
    pad_front = n0 - b0 * bn
    rows = -(-(pad_front + n1 - n0) // 8) * 8  # fp8_gemm wants N % 8 == 0; stays within the blocks b0..b1
    if pad_front == 0 and rows == n1 - n0:
        w = weight[n0:n1].contiguous()
    else:
        w = torch.zeros(rows, k, dtype=weight.dtype, device=weight.device)
        w[pad_front:pad_front + n1 - n0] = weight[n0:n1]
    b = None
    if bias is not None:
        b = torch.zeros(rows, dtype=bias.dtype, device=bias.device)
        b[pad_front:pad_front + n1 - n0] = bias[n0:n1]
    return FP8Shard(w, weight_scale_inv[b0:b1].contiguous(), b, pad_front, n1 - n0)



def _stack_fp8(parts: list[FP8Shard], block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              list[slice]]:
    """The column shards of gate and up as one FP8 weight: each part but the last padded with zero rows to
    whole scale blocks, so the next part's rows line up with its own scale rows; the slices of the real
    outputs (no padding at all when I / T is a multiple of the block)."""
    weights, scales, biases, slices, row = [], [], [], [], 0
    for i, p in enumerate(parts):
        w = p.weight
        full = p.weight_scale_inv.shape[0] * block_n
        if i < len(parts) - 1 and w.shape[0] != full:
            w = torch.cat([w, w.new_zeros(full - w.shape[0], w.shape[1])])
        slices.append(slice(row + p.pad_front, row + p.pad_front + p.out_features))
        weights.append(w)
        scales.append(p.weight_scale_inv)
        biases.append(p.bias)
        row += w.shape[0]
    bias = None
    if any(b is not None for b in biases):
        dtype = next(b.dtype for b in biases if b is not None)
        bias = torch.zeros(row, dtype=dtype, device=weights[0].device)
        at = 0
        for w, b in zip(weights, biases):
            if b is not None:
                bias[at:at + b.shape[0]] = b
            at += w.shape[0]
    return torch.cat(weights), torch.cat(scales), bias, slices


# --- checkpoint formats -----------------------------------------------------------------------------------

class DeepSeekFP8(LayerFormat):
    """quant_method "fp8": weight e4m3 [N, K], weight_scale_inv per block (a multiplier, or its reciprocal
    where the config says weight_scale_semantics "inverse")."""

    def marks(self, dtype: str) -> bool:
        return dtype == "F8_E4M3"  # float weights of the same name are unquantized layers

    scale_role = "weight_scale_inv"

    def specs(self, k, n):
        bn, bk = self.scheme.weight_block
        return {"weight": Spec((n, k), ("F8_E4M3",)),
                self.scale_role: Spec((-(-n // bn), -(-k // bk)), FLOATS),
                "bias": Spec((n,), FLOATS, False)}

    @property
    def tp(self):
        return not self.hf.scale_inverse

    def multiplier(self, scale: torch.Tensor) -> torch.Tensor:
        """The stored scale as the dequantization multiplier, float32."""
        if self.hf.scale_inverse:
            return scale.float().reciprocal()  # 448 / amax -> amax / 448; NaN stays NaN, inf gives 0 (a zero block)
        return scale.float()

    def build(self, t, act_dtype):
        return FP8Linear(t["weight"], self.multiplier(t[self.scale_role]), t.get("bias"), self.scheme)

    def read_dtypes(self, act_dtype):
        return {self.scale_role: torch.float32}  # FP8 multipliers in float32

    experts = True  # reads DeepSeek-V3's per-expert tensors into transformers' fused experts modules

    def expert_specs(self, inter: int, hidden: int) -> dict[str, Spec]:
        """One expert's tensors under <experts>.<e>.: gate and up [I, H], down [H, I], each with its block scales."""
        bn, bk = self.scheme.weight_block
        specs = {}
        for proj, (n, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            specs[f"{proj}.weight"] = Spec((n, k), ("F8_E4M3",))
            specs[f"{proj}.{self.scale_role}"] = Spec((-(-n // bn), -(-k // bk)), FLOATS)
        return specs

    def experts_problem(self, inter: int, hidden: int) -> str | None:
        """Why a fused experts module of this intermediate and hidden size cannot be built (None: it can)."""
        if inter % self.scheme.weight_block[0]:
            return (f"expert intermediate size {inter} is not a multiple of the weight block's "
                    f"{self.scheme.weight_block[0]} rows, so gate and up blocks cannot be stacked as w13")
        return None

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """FP8Experts from each expert's tensors: gate then up rows stacked as w13, their block scales likewise."""
        s = self.scale_role
        w13 = torch.stack([torch.cat([t["gate_proj.weight"], t["up_proj.weight"]]) for t in experts])
        w13_s = torch.stack([self.multiplier(torch.cat([t[f"gate_proj.{s}"], t[f"up_proj.{s}"]])) for t in experts])
        w2 = torch.stack([t["down_proj.weight"] for t in experts])
        w2_s = torch.stack([self.multiplier(t[f"down_proj.{s}"]) for t in experts])
        return FP8Experts(w13, w13_s, w2, w2_s)


class CompressedFP8Block(DeepSeekFP8):
    """compressed-tensors "float-quantized" with FP8_BLOCK's arguments: weight e4m3, weight_scale per block
    (a multiplier, often bf16); activations quantized per call, so no input_scale."""

    scale_role = "weight_scale"
    tp = False
    experts = False


# --- the handler ------------------------------------------------------------------------------------------

class BlockFP8Handler(SchemeHandler):
    scheme_type = BlockFP8
    module_class = FP8Linear
    formats = {"fp8": DeepSeekFP8, "compressed-tensors/float-quantized": CompressedFP8Block}
    tensors = (("weight", False), ("weight_scale_inv", False), ("bias", True))

    def unservable(self, scheme, k, n):
        if k % scheme.act_group:
            return f"in_features = {k} is not a multiple of act_group = {scheme.act_group} (act_quant's groups along K)"
        if n % 8:
            return f"out_features = {n} is not a multiple of 8 (fp8_gemm's output rows)"
        return None

    def from_float(self, scheme, linear):
        return FP8Linear.from_float(linear, scheme)

    def float_checkpoint(self, scheme, linear):
        q, s = ops.weight_quant(linear.weight.detach(), block_size=scheme.weight_block)
        bias = None if linear.bias is None else linear.bias.detach()
        return {"weight": q, "weight_scale_inv": s, "bias": bias}

    def column_shard(self, scheme, t, *, rank, world_size, out_index=None):
        if out_index is not None:
            raise ValueError("out_index: block FP8 column shards are contiguous (out_index is GPTQ act-order's)")
        weight = t["weight"]
        s = shard_fp8(weight, t["weight_scale_inv"], t.get("bias"), rank=rank, world_size=world_size,
                      dim="column", block=scheme.weight_block)
        padded = s.out_slice != slice(0, s.weight.shape[0])
        return ColumnShard(FP8Linear(s.weight, s.weight_scale_inv, s.bias, scheme), weight.shape[0],
                           s.out_slice if padded else None)

    def row_shard(self, scheme, t, *, rank, world_size):
        weight = t["weight"]
        s = shard_fp8(weight, t["weight_scale_inv"], None, rank=rank, world_size=world_size, dim="row",
                      block=scheme.weight_block)
        k = weight.shape[1] // world_size
        return RowShard(FP8Linear(s.weight, s.weight_scale_inv, None, scheme), weight.shape[1],
                        slice(rank * k, (rank + 1) * k), t.get("bias"))

    def gate_up_shard(self, scheme, gate, up, down, *, rank, world_size):
        hidden, inter = down["weight"].shape
        parts = []
        for role, t in (("gate", gate), ("up", up)):
            w = tensor_of(t, role, "weight")
            same_shape(role, "weight", w, (inter, hidden))
            parts.append(shard_fp8(w, tensor_of(t, role, "weight_scale_inv"), tensor_of(t, role, "bias", True),
                                   rank=rank, world_size=world_size, dim="column", block=scheme.weight_block,
                                   name=f"{role}.weight"))
        weight, scale, bias, (gate_slice, up_slice) = _stack_fp8(parts, scheme.weight_block[0])
        return GateUpShard(FP8Linear(weight, scale, bias, scheme), gate_slice, up_slice)
