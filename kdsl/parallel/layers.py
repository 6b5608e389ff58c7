"""Tensor-parallel linears over torch.distributed, wrapping kdsl's FP8Linear and W4A16Linear.

ColumnParallelLinear: each rank holds N / T output features (with their bias) and computes them from the
whole input; the output is all-gathered along the last dim (gather_output=True) or left sharded.
RowParallelLinear: each rank holds K / T input features; it computes its partial x_r @ W_r^T, the
partials are summed with all_reduce (in reduce_dtype, float32 by default, so only the summation order
differs from one rank), and the bias is added once, after the reduce.

Build them from checkpoint tensors with the from_fp8 / from_gptq / from_awq constructors: they cut the
rank's shard (kdsl.parallel.sharding) and wrap it. The process group defaults to the default group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.ops.gptq_checkpoint import ZERO_OFFSET, unpack_rows, unpack_zeros
from kdsl.ops.w4a16 import prepare
from kdsl.parallel.sharding import shard_awq, shard_fp8, shard_gptq
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def _comm_dtype(dtype: torch.dtype, group) -> torch.dtype:
    """gloo does not reduce or gather bfloat16 on every build: carry it as float32 there."""
    if dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        return torch.float32
    return dtype


class ColumnParallelLinear(nn.Module):
    """Output-feature shard of a quantized linear: y_r = x W_r^T + b_r, gathered over the group on request."""

    def __init__(self, local: nn.Module, *, out_features: int, group=None, gather_output: bool = True,
                 out_slice: slice | None = None):
        super().__init__()
        self.local, self.group, self.gather_output = local, group, gather_output
        self.rank, self.world_size = _rank_world(group)
        self.out_features = out_features  # the whole layer's N
        self.out_slice = out_slice  # the real outputs among local's (FP8 off-grid shards carry padding)
        self.in_features = local.in_features

    @classmethod
    def from_fp8(cls, weight, weight_scale_inv, bias=None, *, group=None, gather_output=True,
                 scheme: BlockFP8 | None = None) -> "ColumnParallelLinear":
        scheme = scheme or BlockFP8()
        rank, world = _rank_world(group)
        s = shard_fp8(weight, weight_scale_inv, bias, rank=rank, world_size=world, dim="column",
                      block=scheme.weight_block)
        padded = s.out_slice != slice(0, s.weight.shape[0])
        return cls(FP8Linear(s.weight, s.weight_scale_inv, s.bias, scheme), out_features=weight.shape[0],
                   group=group, gather_output=gather_output, out_slice=s.out_slice if padded else None)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, group=None, gather_output=True,
                  scheme: GPTQ | None = None, out_index=None) -> "ColumnParallelLinear":
        """out_index: this rank's output columns (kdsl.parallel.gptq_row_index of the act-order layer that
        follows), so its sharded output feeds that RowParallelLinear(input_is_parallel=True); no gather."""
        scheme = scheme or GPTQ()
        rank, world = _rank_world(group)
        if out_index is not None and gather_output:
            raise ValueError("out_index: the outputs are permuted across ranks; pass gather_output=False")
        s = shard_gptq(qweight, qzeros, scales, g_idx, bias, rank=rank, world_size=world, dim="column",
                       group_size=scheme.group_size, bits=scheme.bits, out_index=out_index)
        local = W4A16Linear.from_gptq(s.qweight, s.qzeros, s.scales, s.g_idx, s.bias, scheme)
        return cls(local, out_features=qweight.shape[1], group=group, gather_output=gather_output)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group=None, gather_output=True,
                 scheme: AWQ | None = None) -> "ColumnParallelLinear":
        scheme = scheme or AWQ()
        rank, world = _rank_world(group)
        s = shard_awq(qweight, qzeros, scales, bias, rank=rank, world_size=world, dim="column",
                      group_size=scheme.group_size)
        local = W4A16Linear.from_awq(s.qweight, s.qzeros, s.scales, s.bias, scheme)
        return cls(local, out_features=qweight.shape[1] * 8, group=group, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.out_slice is not None:
            y = y[..., self.out_slice]
        if not self.gather_output or self.world_size == 1:
            return y.contiguous()
        dtype = _comm_dtype(y.dtype, self.group)
        mine = y.to(dtype).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat(parts, dim=-1).to(y.dtype)

    def extra_repr(self) -> str:
        return (f"out_features={self.out_features}, rank={self.rank}/{self.world_size}, "
                f"gather_output={self.gather_output}" + (f", out_slice={self.out_slice}" if self.out_slice else ""))


class RowParallelLinear(nn.Module):
    """Input-feature shard of a quantized linear: y = sum_r x_r W_r^T (all_reduce) + bias, the bias once.

    input_is_parallel=False: forward takes the whole x [..., K] and reads this rank's columns (for GPTQ
    act-order, the columns perm[K_r] of K sorted by group: in_index). True: forward takes x_r already cut
    for this rank, in in_index's order."""

    def __init__(self, local: nn.Module, *, in_features: int, in_index=None, bias: torch.Tensor | None = None,
                 group=None, input_is_parallel: bool = False, reduce_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        self.local, self.group, self.input_is_parallel = local, group, input_is_parallel
        self.rank, self.world_size = _rank_world(group)
        self.in_features, self.out_features = in_features, local.out_features
        self.reduce_dtype = reduce_dtype
        self.in_slice = in_index if isinstance(in_index, slice) else None
        self.register_buffer("in_index", in_index if isinstance(in_index, torch.Tensor) else None)
        self.register_buffer("bias", bias)

    @classmethod
    def from_fp8(cls, weight, weight_scale_inv, bias=None, *, group=None, input_is_parallel=False,
                 scheme: BlockFP8 | None = None, reduce_dtype=torch.float32) -> "RowParallelLinear":
        scheme = scheme or BlockFP8()
        rank, world = _rank_world(group)
        s = shard_fp8(weight, weight_scale_inv, None, rank=rank, world_size=world, dim="row",
                      block=scheme.weight_block)
        k = weight.shape[1] // world
        return cls(FP8Linear(s.weight, s.weight_scale_inv, None, scheme), in_features=weight.shape[1],
                   in_index=slice(rank * k, (rank + 1) * k), bias=bias, group=group,
                   input_is_parallel=input_is_parallel, reduce_dtype=reduce_dtype)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, group=None, input_is_parallel=False,
                  scheme: GPTQ | None = None, reduce_dtype=torch.float32) -> "RowParallelLinear":
        scheme = scheme or GPTQ()
        rank, world = _rank_world(group)
        s = shard_gptq(qweight, qzeros, scales, g_idx, None, rank=rank, world_size=world, dim="row",
                       group_size=scheme.group_size, bits=scheme.bits)
        # The scheme-neutral prepare (what gptq_prepare calls): a shard's groups need not be group_size rows
        # each nor number K_r / group_size (a random g_idx, a group straddling two ranks).
        prepared = prepare(unpack_rows(s.qweight.contiguous(), scheme.bits),
                           unpack_zeros(s.qzeros, scheme.bits, ZERO_OFFSET[scheme.checkpoint_format]), s.scales,
                           s.g_idx, bits=scheme.bits, group_size=scheme.group_size, source=scheme.checkpoint_format)
        local = W4A16Linear(prepared, None, scheme)
        return cls(local, in_features=qweight.shape[0] * 8, in_index=s.in_index,
                   bias=None if bias is None else bias.to(scales.dtype), group=group,
                   input_is_parallel=input_is_parallel, reduce_dtype=reduce_dtype)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group=None, input_is_parallel=False,
                 scheme: AWQ | None = None, reduce_dtype=torch.float32) -> "RowParallelLinear":
        scheme = scheme or AWQ()
        rank, world = _rank_world(group)
        s = shard_awq(qweight, qzeros, scales, None, rank=rank, world_size=world, dim="row",
                      group_size=scheme.group_size)
        local = W4A16Linear.from_awq(s.qweight, s.qzeros, s.scales, None, scheme)
        return cls(local, in_features=qweight.shape[0], in_index=s.in_index,
                   bias=None if bias is None else bias.to(scales.dtype), group=group,
                   input_is_parallel=input_is_parallel, reduce_dtype=reduce_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if self.in_index is not None:
                x = x.index_select(-1, self.in_index.to(x.device))
            elif self.in_slice is not None:
                x = x[..., self.in_slice]
        x = x.contiguous()
        if isinstance(self.local, FP8Linear) and self.reduce_dtype == torch.float32:
            y = self.local(x.float())  # the same activation quantization, float32 partials from fp8_gemm
        else:
            y = self.local(x)
        dtype = _comm_dtype(self.reduce_dtype or y.dtype, self.group)
        total = y.to(dtype)
        if self.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        y = total.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, rank={self.rank}/{self.world_size}, "
                f"input_is_parallel={self.input_is_parallel}, reduce_dtype={self.reduce_dtype}")
