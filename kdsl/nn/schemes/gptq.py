"""GPTQ (kdsl.GPTQ) as a unit: W4A16Linear from float weights (round-to-nearest), the GPTQ and compressed-tensors
pack-quantized checkpoint formats, and the tensor-parallel shard rules.

Shard rules (qweight int32 [K/8, N] packed along K, qzeros [G, N/8] packed along N, scales [G, N], g_idx [K]):
column: N / T must be a multiple of 8 (qzeros packs 8 columns per word); g_idx is kept whole.
row: K is first sorted by group (a stable argsort of g_idx; act-order checkpoints only), qweight's nibbles
re-packed in that order, then split into T contiguous pieces of K / T rows, a multiple of 8 (qweight packs 8 rows
per int32). The rank reads the input columns perm[K_r] (GPTQShard.in_index): the module gathers them from a full x.
When the rank's rows are whole groups of group_size rows, its g_idx is the plain k // group_size (None) and its
scales/qzeros are those groups. Otherwise (a random g_idx, whose groups are of unequal size, or K / T not a
multiple of group_size) the rank gets the scale/zero rows of every group its rows touch, G[first : last + 1], and
g_idx the group of each of its sorted rows within them: a group straddling two ranks is given to both, each using
it for its own rows, which is exact (every row is dequantized with its own group's scale and zero). The row shard
is prepared with the scheme-neutral kdsl.ops.w4a16.prepare (gptq_prepare wants G = K / group_size).
group_size -1 (one group) is the exception: every rank gets the one scale/zero row, which is exact.
Chaining column -> row without a gather (an MLP's up and down): the row shard's input order perm[K_r]
(gptq_row_index) is not a contiguous range, so the column layer before it is cut by out_index instead: its
qweight columns and scales are selected in that order and its qzeros nibbles re-packed to match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdsl.nn.modules import W4A16Linear
from kdsl.nn.moe import W4A16Experts
from kdsl.nn.schemes.base import (FLOATS, ColumnShard, CheckpointError, GateUpShard, LayerFormat, PACK, RowShard,
                                  ShardError, Spec, act_dtype_of, cat_bias, check_rank, even, same_shape, tensor_of,
                                  whole)
from kdsl.nn.schemes.int4 import Int4Format, Int4Handler, stack_experts
from kdsl.ops.gptq_checkpoint import ZERO_OFFSET, default_g_idx, pack_rows, unpack_rows, unpack_zeros
from kdsl.ops.w4a16 import prepare
from kdsl.schema import GPTQ


# --- shard rules ------------------------------------------------------------------------------------------

@dataclass
class GPTQShard:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None      # column: the whole g_idx; row: None when the rank has whole groups (rows
    #                                 sorted, plain k // group_size), else each sorted row's group in qzeros/scales
    bias: torch.Tensor | None       # column: this rank's bias; row: None (added once after the reduce)
    in_index: torch.Tensor | slice | None  # row: the input columns this rank reads, in its order


def _row_cut(g_idx: torch.Tensor | None, k: int, group_size: int, k0: int, k1: int):
    """(perm or None, the groups of sorted rows k0..k1 as int32): perm is a stable argsort of g_idx putting K
    in group order (None when g_idx is None or already k // group_size). The groups may be of any size."""
    plain = default_g_idx(k, group_size, g_idx.device if g_idx is not None else None)
    if g_idx is None or torch.equal(g_idx.to(plain.dtype), plain):
        return None, plain[k0:k1]
    perm = torch.argsort(g_idx.long(), stable=True)
    return perm, g_idx[perm[k0:k1]].to(plain.dtype)


def shard_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, *, rank: int,
               world_size: int, dim: str, group_size: int = 128, bits: int = 4,
               out_index: torch.Tensor | None = None) -> GPTQShard:
    """Rank's shard of a GPTQ (v1 or v2) linear (see the module docstring: row parallel sorts K by group).

    out_index (column only): the output columns this rank computes, in order, instead of its contiguous
    N / T; pass the in_index of the next layer's act-order row shard (gptq_row_index) so that this layer's
    sharded output is that layer's input as it is (input_is_parallel), with no gather in between. qweight's
    columns are selected as they are; qzeros' nibbles are re-packed in the new column order."""
    check_rank(rank, world_size, dim)
    if bits != 4:
        raise ValueError(f"bits: expected 4, got {bits!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise TypeError(f"qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    g_idx = None if g_idx is None else whole(g_idx)
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if dim == "column" and out_index is not None:
        index = torch.as_tensor(out_index, dtype=torch.long)
        if index.dim() != 1 or index.numel() % PACK or (index.numel() and (index.min() < 0 or index.max() >= n)):
            raise ShardError(f"out_index {tuple(index.shape)}: rank {rank} of {world_size}: expected a multiple of "
                             f"{PACK} output columns in [0, {n}) of qweight {tuple(qweight.shape)}")
        zeros = unpack_rows(whole(qzeros).T.contiguous(), bits)[index]  # [columns, G]
        return GPTQShard(whole(qweight)[:, index].contiguous(), pack_rows(zeros.long(), bits).T.contiguous(),
                         whole(scales)[:, index].contiguous(), g_idx, None if bias is None else bias[index], None)
    if out_index is not None:
        raise ValueError("out_index: only for dim='column'")
    if dim == "column":
        n0, n1 = even("qweight", qweight.shape, f"N = {n}", n, rank, world_size, PACK,
                       "qzeros packs 8 columns per int32")
        return GPTQShard(qweight[:, n0:n1].contiguous(), qzeros[:, n0 // PACK:n1 // PACK].contiguous(),
                         scales[:, n0:n1].contiguous(), g_idx, None if bias is None else bias[n0:n1], None)
    if group_size == -1:  # one group: every rank gets its scale/zero row
        k0, k1 = even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows")
        return GPTQShard(qweight[k0 // PACK:k1 // PACK].contiguous(), whole(qzeros), whole(scales), None, None,
                         slice(k0, k1))
    k0, k1 = even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows per int32")
    perm, groups = _row_cut(g_idx, k, group_size, k0, k1)
    if perm is None:
        q, index = qweight[k0 // PACK:k1 // PACK].contiguous(), slice(k0, k1)
    else:
        rows = unpack_rows(whole(qweight), bits)[perm[k0:k1]]
        q, index = pack_rows(rows.long(), bits), perm[k0:k1].clone()
    if k0 % group_size == 0 and k1 % group_size == 0 and torch.equal(
            groups, torch.arange(k0, k1, device=groups.device, dtype=groups.dtype) // group_size):
        g0, g1 = k0 // group_size, k1 // group_size  # whole groups: plain k // group_size in the shard
        return GPTQShard(q, qzeros[g0:g1].contiguous(), scales[g0:g1].contiguous(), None, None, index)
    # Groups of unequal size (a random g_idx) or one straddling two ranks: the rank gets the scale/zero rows
    # of every group its rows touch (a straddling group's on both ranks) and its rows' groups re-indexed.
    g0, g1 = (int(groups[0]), int(groups[-1]) + 1) if groups.numel() else (0, 0)
    return GPTQShard(q, qzeros[g0:g1].contiguous(), scales[g0:g1].contiguous(), (groups - g0).to(torch.int32),
                     None, index)


def gptq_row_index(g_idx: torch.Tensor | None, k: int, *, rank: int, world_size: int,
                   group_size: int = 128) -> torch.Tensor:
    """The input columns rank's row shard of a GPTQ layer reads, in order (shard_gptq's in_index), as a tensor:
    what the column-parallel layer before it should produce on this rank (shard_gptq out_index)."""
    check_rank(rank, world_size, "row")
    k0, k1 = even("g_idx", (k,), f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows per int32")
    if group_size == -1:
        return torch.arange(k0, k1)
    perm, _ = _row_cut(None if g_idx is None else whole(g_idx), k, group_size, k0, k1)
    return torch.arange(k0, k1) if perm is None else perm[k0:k1].clone()


# --- checkpoint formats -----------------------------------------------------------------------------------

class GPTQFormat(Int4Format):
    marker = "qweight"
    tp = True

    def specs(self, k, n):
        groups = 1 if self.scheme.group_size == -1 else k // self.scheme.group_size
        return {"qweight": Spec((k // 8, n), ("I32",)), "qzeros": Spec((groups, n // 8), ("I32",)),
                "scales": Spec((groups, n), FLOATS), "g_idx": Spec((k,), ("I32",), False),
                "bias": Spec((n,), FLOATS, False)}

    def build(self, t, act_dtype):
        dtype = act_dtype_of(t["scales"], act_dtype)
        return W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"].to(dtype), t.get("g_idx"),
                                     t.get("bias"), self.scheme)

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """W4A16Experts from each expert's tensors: each projection's stacked over the experts (gate and up as one
        w13, each half with its own g_idx), prepared on their device in the model's dtype."""
        projections = stack_experts(experts)
        dtype = act_dtype_of(projections["gate_proj"]["scales"], act_dtype)
        return W4A16Experts.from_gptq(projections["gate_proj"], projections["up_proj"], projections["down_proj"],
                                      self.scheme, dtype=dtype)


class CompressedPacked(LayerFormat):
    """compressed-tensors "pack-quantized" int4: weight_packed int32 [N, K / 8] (value i of a row in bits
    4 (i % 8) of word i // 8, stored as q + 8), weight_scale [N, G], weight_zero_point int32 [N / 8, G] packed
    along N the same way when asymmetric, weight_shape [N, K], weight_g_idx [K] with actorder "group".
    w[n, k] = (q - z) * s with q and z signed; symmetric means z = 0."""

    marker = "weight_packed"

    def specs(self, k, n):
        groups = 1 if self.scheme.group_size == -1 else k // self.scheme.group_size
        specs = {"weight_packed": Spec((n, k // 8), ("I32",)), "weight_scale": Spec((n, groups), FLOATS),
                 "weight_shape": Spec((2,), ("I64", "I32"))}
        if not self.scheme.sym:
            specs["weight_zero_point"] = Spec((-(-n // 8), groups), ("I32",))
        if self.hf.actorder:
            specs["weight_g_idx"] = Spec((k,), ("I32", "I64"))
        specs["bias"] = Spec((n,), FLOATS, False)
        return specs

    def check_values(self, key, role, tensor, k, n):
        if role == "weight_shape" and tensor.tolist() != [n, k]:
            raise CheckpointError(f"{key}: holds {tensor.tolist()}, but the model's layer is [{n}, {k}]")
        if role == "weight_g_idx" and tensor.numel():
            groups = k // self.scheme.group_size
            low, high = int(tensor.min()), int(tensor.max())
            if low < 0 or high >= groups:
                raise CheckpointError(f"{key}: groups span [{low}, {high}], expected [0, {groups})")

    def build(self, t, act_dtype):
        n = t["weight_packed"].shape[0]
        q = unpack_rows(t["weight_packed"].T.contiguous(), 4)  # [K, N], the stored q + 8
        scales = t["weight_scale"].T.contiguous()  # [G, N]
        if self.scheme.sym:
            zeros = torch.full(scales.shape, 8, dtype=torch.int32, device=q.device)
        else:
            zeros = unpack_rows(t["weight_zero_point"], 4)[:n].T.contiguous()  # [G, N], the stored z + 8
        g_idx = t.get("weight_g_idx")
        prepared = prepare(q, zeros, scales.to(act_dtype_of(scales, act_dtype)),
                           None if g_idx is None else g_idx.to(torch.int32),
                           bits=4, group_size=self.scheme.group_size, source="compressed-tensors")
        bias = t.get("bias")
        return W4A16Linear(prepared, None if bias is None else bias.to(prepared.dtype), self.scheme)


# --- the handler ------------------------------------------------------------------------------------------

class GPTQHandler(Int4Handler):
    scheme_type = GPTQ
    formats = {"gptq": GPTQFormat, "compressed-tensors/pack-quantized": CompressedPacked}
    tensors = (("qweight", False), ("qzeros", False), ("scales", False), ("g_idx", True), ("bias", True))

    def rtn_symmetric(self, scheme):
        return scheme.sym

    def column_shard(self, scheme, t, *, rank, world_size, out_index=None):
        qweight = t["qweight"]
        s = shard_gptq(qweight, t["qzeros"], t["scales"], t.get("g_idx"), t.get("bias"), rank=rank,
                       world_size=world_size, dim="column", group_size=scheme.group_size, bits=scheme.bits,
                       out_index=out_index)
        local = W4A16Linear.from_gptq(s.qweight, s.qzeros, s.scales, s.g_idx, s.bias, scheme)
        return ColumnShard(local, qweight.shape[1])

    def row_shard(self, scheme, t, *, rank, world_size):
        qweight, scales, bias = t["qweight"], t["scales"], t.get("bias")
        s = shard_gptq(qweight, t["qzeros"], scales, t.get("g_idx"), None, rank=rank, world_size=world_size,
                       dim="row", group_size=scheme.group_size, bits=scheme.bits)
        # The scheme-neutral prepare (what gptq_prepare calls): a shard's groups need not be group_size rows
        # each nor number K_r / group_size (a random g_idx, a group straddling two ranks).
        prepared = prepare(unpack_rows(s.qweight.contiguous(), scheme.bits),
                           unpack_zeros(s.qzeros, scheme.bits, ZERO_OFFSET[scheme.checkpoint_format]), s.scales,
                           s.g_idx, bits=scheme.bits, group_size=scheme.group_size, source=scheme.checkpoint_format)
        return RowShard(W4A16Linear(prepared, None, scheme), qweight.shape[0] * 8, s.in_index,
                        None if bias is None else bias.to(scales.dtype))

    def gate_up_shard(self, scheme, gate, up, down, *, rank, world_size):
        """Act-order: down's K is sorted by group and cut (shard_gptq), and gate's and up's columns are cut in
        that order (gptq_row_index), so gate_up's shard is down's input as it is. gate and up are one GEMM
        where their g_idx agree (they do in GPTQ checkpoints: both quantize the same input), else two."""
        dq = down["qweight"]
        inter, hidden = dq.shape[0] * 8, dq.shape[1]
        index = gptq_row_index(down.get("g_idx"), inter, rank=rank, world_size=world_size,
                               group_size=scheme.group_size)
        size = inter // world_size
        if torch.equal(index, torch.arange(rank * size, (rank + 1) * size, device=index.device)):
            index = None  # down's rows are in order: gate and up cut as plain column shards
        shards = []
        for role, t in (("gate", gate), ("up", up)):
            q = tensor_of(t, role, "qweight")
            same_shape(role, "qweight", q, (hidden // 8, inter))
            shards.append(shard_gptq(q, tensor_of(t, role, "qzeros"), tensor_of(t, role, "scales"),
                                     tensor_of(t, role, "g_idx", True), tensor_of(t, role, "bias", True), rank=rank,
                                     world_size=world_size, dim="column", group_size=scheme.group_size,
                                     bits=scheme.bits, out_index=index))
        g, u = shards
        if (g.g_idx is None) == (u.g_idx is None) and (g.g_idx is None or torch.equal(g.g_idx, u.g_idx)):
            local = W4A16Linear.from_gptq(torch.cat([g.qweight, u.qweight], 1), torch.cat([g.qzeros, u.qzeros], 1),
                                          torch.cat([g.scales, u.scales], 1), g.g_idx,
                                          cat_bias([g.bias, u.bias], [size, size]), scheme)
            return GateUpShard(local, slice(0, size), slice(size, 2 * size))
        gate_local, up_local = (W4A16Linear.from_gptq(s.qweight, s.qzeros, s.scales, s.g_idx, s.bias, scheme)
                                for s in shards)
        return GateUpShard(gate_local, slice(0, size), up=up_local)
