"""AWQ (kdsl.AWQ) as a unit: W4A16Linear from float weights (round-to-nearest), the AutoAWQ "gemm" checkpoint
format, and the tensor-parallel shard rules.

Shard rules (qweight int32 [K, N/8] packed along N, qzeros [G, N/8], scales [G, N]; no act-order):
column: N / T a multiple of 8 (whole packs of 8 columns). row: K / T a multiple of group_size (whole groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdsl.nn.modules import W4A16Linear
from kdsl.nn.moe import W4A16Experts
from kdsl.nn.schemes.base import (FLOATS, ColumnShard, GateUpShard, PACK, RowShard, Spec, act_dtype_of,
                                  cat_bias, check_rank, even, same_shape, tensor_of)
from kdsl.nn.schemes.int4 import Int4Format, Int4Handler, stack_experts
from kdsl.schema.scheme import AWQ


# --- shard rules ------------------------------------------------------------------------------------------

@dataclass
class AWQShard:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    in_index: slice | None


def shard_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              *, rank: int, world_size: int, dim: str, group_size: int = 128) -> AWQShard:
    """Rank's shard of an AutoAWQ "gemm" linear: columns in packs of 8, rows in whole groups."""
    check_rank(rank, world_size, dim)
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise TypeError(f"qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    if dim == "column":
        n0, n1 = even("qweight", qweight.shape, f"N = {n}", n, rank, world_size, PACK,
                       "AWQ packs 8 columns per int32")
        p0, p1 = n0 // PACK, n1 // PACK
        return AWQShard(qweight[:, p0:p1].contiguous(), qzeros[:, p0:p1].contiguous(),
                        scales[:, n0:n1].contiguous(), None if bias is None else bias[n0:n1], None)
    k0, k1 = even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, group_size,
                   f"a group of {group_size} rows would straddle two ranks")
    g0, g1 = k0 // group_size, k1 // group_size
    return AWQShard(qweight[k0:k1].contiguous(), qzeros[g0:g1].contiguous(), scales[g0:g1].contiguous(),
                    None, slice(k0, k1))


# --- checkpoint formats -----------------------------------------------------------------------------------

AWQ_SYMMETRIC_ZEROS = -0x77777778  # 0x88888888 as int32: a zero of 8 in every nibble, whatever the order


class AWQFormat(Int4Format):
    marker = "qweight"

    @property
    def tp(self):
        return self.scheme.zero_point

    def specs(self, k, n):
        groups = k // self.scheme.group_size
        # Symmetric AWQ (zero_point false) may store qzeros (all 8) or leave them out.
        return {"qweight": Spec((k, n // 8), ("I32",)),
                "qzeros": Spec((groups, n // 8), ("I32",), self.scheme.zero_point),
                "scales": Spec((groups, n), FLOATS), "bias": Spec((n,), FLOATS, False)}

    def build(self, t, act_dtype):
        dtype = act_dtype_of(t["scales"], act_dtype)
        qzeros = t.get("qzeros")
        if qzeros is None:
            qzeros = torch.full((t["scales"].shape[0], t["qweight"].shape[1]), AWQ_SYMMETRIC_ZEROS,
                                dtype=torch.int32, device=t["qweight"].device)
        return W4A16Linear.from_awq(t["qweight"], qzeros, t["scales"].to(dtype), t.get("bias"), self.scheme)

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """W4A16Experts from each expert's tensors (symmetric checkpoints may leave qzeros out: every zero 8)."""
        projections = stack_experts(experts)
        dtype = act_dtype_of(projections["gate_proj"]["scales"], act_dtype)
        return W4A16Experts.from_awq(projections["gate_proj"], projections["up_proj"], projections["down_proj"],
                                     self.scheme, dtype=dtype)


# --- the handler ------------------------------------------------------------------------------------------

class AWQHandler(Int4Handler):
    scheme_type = AWQ
    formats = {"awq": AWQFormat}
    tensors = (("qweight", False), ("qzeros", False), ("scales", False), ("bias", True))

    def column_shard(self, scheme, t, *, rank, world_size, out_index=None):
        if out_index is not None:
            raise ValueError("out_index: AWQ column shards are contiguous (out_index is GPTQ act-order's)")
        qweight = t["qweight"]
        s = shard_awq(qweight, t["qzeros"], t["scales"], t.get("bias"), rank=rank, world_size=world_size,
                      dim="column", group_size=scheme.group_size)
        local = W4A16Linear.from_awq(s.qweight, s.qzeros, s.scales, s.bias, scheme)
        return ColumnShard(local, qweight.shape[1] * 8)

    def row_shard(self, scheme, t, *, rank, world_size):
        qweight, scales, bias = t["qweight"], t["scales"], t.get("bias")
        s = shard_awq(qweight, t["qzeros"], scales, None, rank=rank, world_size=world_size, dim="row",
                      group_size=scheme.group_size)
        local = W4A16Linear.from_awq(s.qweight, s.qzeros, s.scales, None, scheme)
        return RowShard(local, qweight.shape[0], s.in_index, None if bias is None else bias.to(scales.dtype))

    def gate_up_shard(self, scheme, gate, up, down, *, rank, world_size):
        dq = down["qweight"]
        inter, hidden = dq.shape[0], dq.shape[1] * 8
        shards = []
        for role, t in (("gate", gate), ("up", up)):
            q = tensor_of(t, role, "qweight")
            same_shape(role, "qweight", q, (hidden, inter // 8))
            shards.append(shard_awq(q, tensor_of(t, role, "qzeros"), tensor_of(t, role, "scales"),
                                    tensor_of(t, role, "bias", True), rank=rank, world_size=world_size,
                                    dim="column", group_size=scheme.group_size))
        g, u = shards
        size = inter // world_size
        local = W4A16Linear.from_awq(torch.cat([g.qweight, u.qweight], 1), torch.cat([g.qzeros, u.qzeros], 1),
                                     torch.cat([g.scales, u.scales], 1), cat_bias([g.bias, u.bias], [size, size]),
                                     scheme)
        return GateUpShard(local, slice(0, size), slice(size, 2 * size))
