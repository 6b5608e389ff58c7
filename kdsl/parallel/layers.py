"""Tensor-parallel linears over torch.distributed, wrapping kdsl's FP8Linear and W4A16Linear.

ColumnParallelLinear: each rank holds N / T output features (with their bias) and computes them from the
whole input; the output is all-gathered along the last dim (gather_output=True: one all_gather_into_tensor
into a contiguous buffer) or left sharded.
RowParallelLinear: each rank holds K / T input features; it computes its partial x_r @ W_r^T, the
partials are summed with one all-reduce in reduce_dtype (None, the default: the activation dtype, as serving
stacks reduce; torch.float32: the partials leave the GEMM in float32, so only the summation order differs
from one rank, at twice the bytes), and the bias is added once, after the reduce. all_reduce="symm_mem" takes
torch's symmetric-memory one-shot all-reduce for messages up to symm_mem_max_bytes (kdsl.parallel.comm).

Build them from checkpoint tensors with from_checkpoint (the scheme unit's shard rules, kdsl.nn.schemes, cut
the rank's shard and it is wrapped) or its from_fp8 / from_gptq / from_awq shorthands. The process group
defaults to the default group.
Every forward is capturable in a CUDA graph (after one eager call: kernels compile, symm_mem sets up).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kdsl.nn.schemes import handler_for
from kdsl.parallel import comm
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


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
    def from_checkpoint(cls, tensors, *, scheme, group=None, gather_output=True,
                        out_index=None) -> "ColumnParallelLinear":
        """From a linear's checkpoint tensors ({name: tensor}, the names of the scheme's checkpoint format; a
        lazily read tensor will do), cut for this rank by the scheme's shard rules (kdsl.nn.schemes)."""
        handler = handler_for(scheme)
        rank, world = _rank_world(group)
        if out_index is not None and gather_output:
            raise ValueError("out_index: the outputs are permuted across ranks; pass gather_output=False")
        s = handler.column_shard(scheme, tensors, rank=rank, world_size=world, out_index=out_index)
        return cls(s.local, out_features=s.out_features, group=group, gather_output=gather_output,
                   out_slice=s.out_slice)

    @classmethod
    def from_fp8(cls, weight, weight_scale_inv, bias=None, *, group=None, gather_output=True,
                 scheme: BlockFP8 | None = None) -> "ColumnParallelLinear":
        return cls.from_checkpoint({"weight": weight, "weight_scale_inv": weight_scale_inv, "bias": bias},
                                   scheme=scheme or BlockFP8(), group=group, gather_output=gather_output)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, group=None, gather_output=True,
                  scheme: GPTQ | None = None, out_index=None) -> "ColumnParallelLinear":
        """out_index: this rank's output columns (kdsl.parallel.gptq_row_index of the act-order layer that
        follows), so its sharded output feeds that RowParallelLinear(input_is_parallel=True); no gather."""
        return cls.from_checkpoint({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx,
                                    "bias": bias}, scheme=scheme or GPTQ(), group=group,
                                   gather_output=gather_output, out_index=out_index)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group=None, gather_output=True,
                 scheme: AWQ | None = None) -> "ColumnParallelLinear":
        return cls.from_checkpoint({"qweight": qweight, "qzeros": qzeros, "scales": scales, "bias": bias},
                                   scheme=scheme or AWQ(), group=group, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.out_slice is not None:
            y = y[..., self.out_slice]
        if not self.gather_output or self.world_size == 1:
            return y.contiguous()
        return comm.all_gather_last_dim(y, self.group, self.world_size)

    def extra_repr(self) -> str:
        return (f"out_features={self.out_features}, rank={self.rank}/{self.world_size}, "
                f"gather_output={self.gather_output}" + (f", out_slice={self.out_slice}" if self.out_slice else ""))


class RowParallelLinear(nn.Module):
    """Input-feature shard of a quantized linear: y = sum_r x_r W_r^T (all_reduce) + bias, the bias once.

    input_is_parallel=False: forward takes the whole x [..., K] and reads this rank's columns (for GPTQ
    act-order, the columns perm[K_r] of K sorted by group: in_index). True: forward takes x_r already cut
    for this rank, in in_index's order.

    reduce_dtype: None (default) sums the partials in the activation dtype; torch.float32 in float32 (FP8:
    straight from the GEMM's accumulator). all_reduce: "nccl" (default) or "symm_mem" (torch's one-shot
    kernel for messages up to symm_mem_max_bytes, else NCCL; kdsl.parallel.comm)."""

    def __init__(self, local: nn.Module, *, in_features: int, in_index=None, bias: torch.Tensor | None = None,
                 group=None, input_is_parallel: bool = False, reduce_dtype: torch.dtype | None = None,
                 all_reduce: str = "nccl", symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES):
        super().__init__()
        self.local, self.group, self.input_is_parallel = local, group, input_is_parallel
        self.rank, self.world_size = _rank_world(group)
        self.in_features, self.out_features = in_features, local.out_features
        if reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"reduce_dtype: expected None (the activation dtype) or a float dtype, "
                             f"got {reduce_dtype!r}")
        self.reduce_dtype = reduce_dtype
        self.all_reduce = comm.check_all_reduce(all_reduce)
        self.symm_mem_max_bytes = symm_mem_max_bytes
        self.in_slice = in_index if isinstance(in_index, slice) else None
        self.register_buffer("in_index", in_index if isinstance(in_index, torch.Tensor) else None)
        self.register_buffer("bias", bias)

    @classmethod
    def from_checkpoint(cls, tensors, *, scheme, group=None, input_is_parallel=False, reduce_dtype=None,
                        all_reduce="nccl", symm_mem_max_bytes=comm.SYMM_MEM_MAX_BYTES) -> "RowParallelLinear":
        """From a linear's checkpoint tensors ({name: tensor}, the names of the scheme's checkpoint format; a
        lazily read tensor will do), cut for this rank by the scheme's shard rules (kdsl.nn.schemes)."""
        handler = handler_for(scheme)
        rank, world = _rank_world(group)
        s = handler.row_shard(scheme, tensors, rank=rank, world_size=world)
        return cls(s.local, in_features=s.in_features, in_index=s.in_index, bias=s.bias, group=group,
                   input_is_parallel=input_is_parallel, reduce_dtype=reduce_dtype,
                   all_reduce=all_reduce, symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_fp8(cls, weight, weight_scale_inv, bias=None, *, group=None, input_is_parallel=False,
                 scheme: BlockFP8 | None = None, reduce_dtype=None,
                 all_reduce="nccl", symm_mem_max_bytes=comm.SYMM_MEM_MAX_BYTES) -> "RowParallelLinear":
        return cls.from_checkpoint({"weight": weight, "weight_scale_inv": weight_scale_inv, "bias": bias},
                                   scheme=scheme or BlockFP8(), group=group, input_is_parallel=input_is_parallel,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, group=None, input_is_parallel=False,
                  scheme: GPTQ | None = None, reduce_dtype=None,
                  all_reduce="nccl", symm_mem_max_bytes=comm.SYMM_MEM_MAX_BYTES) -> "RowParallelLinear":
        return cls.from_checkpoint({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx,
                                    "bias": bias}, scheme=scheme or GPTQ(), group=group,
                                   input_is_parallel=input_is_parallel, reduce_dtype=reduce_dtype,
                                   all_reduce=all_reduce, symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group=None, input_is_parallel=False,
                 scheme: AWQ | None = None, reduce_dtype=None,
                 all_reduce="nccl", symm_mem_max_bytes=comm.SYMM_MEM_MAX_BYTES) -> "RowParallelLinear":
        return cls.from_checkpoint({"qweight": qweight, "qzeros": qzeros, "scales": scales, "bias": bias},
                                   scheme=scheme or AWQ(), group=group, input_is_parallel=input_is_parallel,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if self.in_index is not None:
                x = x.index_select(-1, self.in_index.to(x.device))
            elif self.in_slice is not None:
                x = x[..., self.in_slice]
        x = x.contiguous()
        y = self.local.partial(x, self.reduce_dtype or x.dtype)  # FP8: float32 partials straight from the GEMM
        return self._reduce(y, x.dtype)

    def forward_quantized(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward() of an FP8 shard fed its input shard already quantized (input_is_parallel): q e4m3 [..., K_r]
        and s float32 [..., K_r / act_group] as act_quant (or silu_mul_quant) writes them; dtype is the activation
        dtype forward() would have been given (the output's, and the reduction's unless reduce_dtype says
        otherwise). One fp8_gemm, then the all-reduce and the bias as forward() does."""
        local = self.local
        if not hasattr(local, "forward_quantized") or not self.input_is_parallel:
            raise TypeError("forward_quantized: needs an FP8 shard with input_is_parallel=True, this one holds "
                            f"{type(local).__name__} (input_is_parallel={self.input_is_parallel})")
        return self._reduce(local.forward_quantized(q, s, self._partial_dtype(dtype)), dtype)

    def forward_silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """forward(silu(h[..., :I_r]) * h[..., I_r:]) with the input computed by the local module's fused kernel
        (its SILU_MUL_OP: FP8 writes it quantized, so the GEMM needs no act_quant); input_is_parallel."""
        return self._reduce(self.local.forward_silu_mul(h, self._partial_dtype(h.dtype)), h.dtype)

    def _partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the GEMM writes where it can: float32 for a float32 reduction, else the activation dtype."""
        return torch.float32 if (self.reduce_dtype or dtype) == torch.float32 else dtype

    def _reduce(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The partial y summed over the group in reduce_dtype (default: dtype), returned in dtype, plus the bias."""
        if self.world_size > 1:
            y = comm.all_reduce_(y.to(comm.comm_dtype(self.reduce_dtype or dtype, self.group)), self.group,
                                 self.all_reduce, self.symm_mem_max_bytes)
        y = y.to(dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, rank={self.rank}/{self.world_size}, "
                f"input_is_parallel={self.input_is_parallel}, reduce_dtype={self.reduce_dtype or 'activation'}, "
                f"all_reduce={self.all_reduce}")
