"""Cut quantized checkpoint tensors for one tensor-parallel rank, in their packed layouts (no dequantization).

"column" splits the output features N (each rank computes N / world outputs from the whole input);
"row" splits the input features K (each rank computes a partial x[..., K_r] @ W[:, K_r]^T; the partials
are summed across ranks). Shards are even: N (or K) must divide by the world size. A shard that cannot be
cut raises ShardError naming the tensor, the rank and the shape.

Rules per format:

- Block FP8 (weight float8 [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)]).
  column: rank r gets rows [r*N/T, (r+1)*N/T). When that range is off the 128-row grid (DeepSeek's
  N = 576 or 2112 at T = 2/4/32), a scale block straddling two ranks is given to both: the rank's
  weight_scale_inv is the blocks its rows touch, S[start // 128 : ceil(end / 128)], and its weight is
  realigned to them by `pad_front = start % 128` zero rows in front (and zero rows behind up to a multiple
  of 8, which fp8_gemm needs), so row i of the shard's weight still reads scale row i // 128. The shard
  computes pad_front + N/T (+ tail) outputs; the padded ones are zeros and the module drops them
  (FP8Shard.out_slice). No value is requantized: every kept row has its original codes and scale.
  row: K / T must be a multiple of 128 (activations are quantized per 128 columns; a group cut between
  ranks would quantize differently from the unsharded layer), else ShardError.
- GPTQ (qweight int32 [K/8, N] packed along K, qzeros [G, N/8] packed along N, scales [G, N], g_idx [K]).
  column: N / T must be a multiple of 8 (qzeros packs 8 columns per word); g_idx is kept whole.
  row: K is first sorted by group (a stable argsort of g_idx; act-order checkpoints only), qweight's
  nibbles re-packed in that order, then split into T contiguous pieces of K / T rows, a multiple of 8
  (qweight packs 8 rows per int32). The rank reads the input columns perm[K_r] (GPTQShard.in_index): the
  module gathers them from a full x. When the rank's rows are whole groups of group_size rows, its g_idx is
  the plain k // group_size (None) and its scales/qzeros are those groups. Otherwise (a random g_idx, whose
  groups are of unequal size, or K / T not a multiple of group_size) the rank gets the scale/zero rows of
  every group its rows touch, G[first : last + 1], and g_idx the group of each of its sorted rows within
  them: a group straddling two ranks is given to both, each using it for its own rows, which is exact
  (every row is dequantized with its own group's scale and zero). RowParallelLinear prepares such a shard
  with the scheme-neutral kdsl.ops.w4a16.prepare (gptq_prepare wants G = K / group_size).
  group_size -1 (one group) is the exception: every rank gets the one scale/zero row, which is exact.
  Chaining column -> row without a gather (an MLP's up and down): the row shard's input order perm[K_r]
  (gptq_row_index) is not a contiguous range, so the column layer before it is cut by out_index instead:
  its qweight columns and scales are selected in that order and its qzeros nibbles re-packed to match.
- AWQ (qweight int32 [K, N/8] packed along N, qzeros [G, N/8], scales [G, N]; no act-order).
  column: N / T a multiple of 8 (whole packs of 8 columns). row: K / T a multiple of group_size (whole groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.ops.gptq_checkpoint import default_g_idx, pack_rows, unpack_rows

DIMS = ("column", "row")
PACK = 8  # int4 values per int32


def _whole(t) -> torch.Tensor:
    """A tensor, or everything of a lazily read checkpoint tensor (anything indexable like one)."""
    return t if isinstance(t, torch.Tensor) else t[:]


class ShardError(ValueError):
    """A tensor cannot be cut for a rank: names the tensor, the rank and the shape."""


def _check_rank(rank: int, world_size: int, dim: str) -> None:
    if dim not in DIMS:
        raise ValueError(f"dim: expected 'column' or 'row', got {dim!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")


def _even(name: str, shape, axis_name: str, total: int, rank: int, world: int, multiple: int = 1,
          why: str = "") -> tuple[int, int]:
    """[start, end) of rank's even share of total, or ShardError naming the tensor, rank and shape."""
    size = total // world
    if total % world or size % multiple:
        need = f"{axis_name} / {world} = {total / world:g} must be a whole number" + (
            f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ShardError(f"{name} {tuple(shape)}: cannot cut rank {rank} of {world}: {need}"
                         + (f" ({why})" if why else ""))
    return rank * size, (rank + 1) * size


# --- block FP8 ------------------------------------------------------------------------------------------

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
    _check_rank(rank, world_size, dim)
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    blocks = (-(-n // bn), -(-k // bk))
    if tuple(weight_scale_inv.shape) != blocks:
        raise ShardError(f"{name}_scale_inv {tuple(weight_scale_inv.shape)}: expected {blocks} for {name} "
                         f"{tuple(weight.shape)} in {bn}x{bk} blocks")
    if dim == "row":
        k0, k1 = _even(name, weight.shape, f"K = {k}", k, rank, world_size, bk,
                       f"each rank's input must hold whole {bk}-column activation groups")
        return FP8Shard(weight[:, k0:k1].contiguous(), weight_scale_inv[:, k0 // bk:k1 // bk].contiguous(),
                        None, 0, n)
    n0, n1 = _even(name, weight.shape, f"N = {n}", n, rank, world_size)
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


# --- GPTQ -----------------------------------------------------------------------------------------------

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
    _check_rank(rank, world_size, dim)
    if bits != 4:
        raise ValueError(f"bits: expected 4, got {bits!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise TypeError(f"qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    g_idx = None if g_idx is None else _whole(g_idx)
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if dim == "column" and out_index is not None:
        index = torch.as_tensor(out_index, dtype=torch.long)
        if index.dim() != 1 or index.numel() % PACK or (index.numel() and (index.min() < 0 or index.max() >= n)):
            raise ShardError(f"out_index {tuple(index.shape)}: rank {rank} of {world_size}: expected a multiple of "
                             f"{PACK} output columns in [0, {n}) of qweight {tuple(qweight.shape)}")
        zeros = unpack_rows(_whole(qzeros).T.contiguous(), bits)[index]  # [columns, G]
        return GPTQShard(_whole(qweight)[:, index].contiguous(), pack_rows(zeros.long(), bits).T.contiguous(),
                         _whole(scales)[:, index].contiguous(), g_idx, None if bias is None else bias[index], None)
    if out_index is not None:
        raise ValueError("out_index: only for dim='column'")
    if dim == "column":
        n0, n1 = _even("qweight", qweight.shape, f"N = {n}", n, rank, world_size, PACK,
                       "qzeros packs 8 columns per int32")
        return GPTQShard(qweight[:, n0:n1].contiguous(), qzeros[:, n0 // PACK:n1 // PACK].contiguous(),
                         scales[:, n0:n1].contiguous(), g_idx, None if bias is None else bias[n0:n1], None)
    if group_size == -1:  # one group: every rank gets its scale/zero row
        k0, k1 = _even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows")
        return GPTQShard(qweight[k0 // PACK:k1 // PACK].contiguous(), _whole(qzeros), _whole(scales), None, None,
                         slice(k0, k1))
    k0, k1 = _even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows per int32")
    perm, groups = _row_cut(g_idx, k, group_size, k0, k1)
    if perm is None:
        q, index = qweight[k0 // PACK:k1 // PACK].contiguous(), slice(k0, k1)
    else:
        rows = unpack_rows(_whole(qweight), bits)[perm[k0:k1]]
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


# --- AWQ ------------------------------------------------------------------------------------------------

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
    _check_rank(rank, world_size, dim)
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise TypeError(f"qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    if dim == "column":
        n0, n1 = _even("qweight", qweight.shape, f"N = {n}", n, rank, world_size, PACK,
                       "AWQ packs 8 columns per int32")
        p0, p1 = n0 // PACK, n1 // PACK
        return AWQShard(qweight[:, p0:p1].contiguous(), qzeros[:, p0:p1].contiguous(),
                        scales[:, n0:n1].contiguous(), None if bias is None else bias[n0:n1], None)
    k0, k1 = _even("qweight", qweight.shape, f"K = {k}", k, rank, world_size, group_size,
                   f"a group of {group_size} rows would straddle two ranks")
    g0, g1 = k0 // group_size, k1 // group_size
    return AWQShard(qweight[k0:k1].contiguous(), qzeros[g0:g1].contiguous(), scales[g0:g1].contiguous(),
                    None, slice(k0, k1))


def gptq_row_index(g_idx: torch.Tensor | None, k: int, *, rank: int, world_size: int,
                   group_size: int = 128) -> torch.Tensor:
    """The input columns rank's row shard of a GPTQ layer reads, in order (shard_gptq's in_index), as a tensor:
    what the column-parallel layer before it should produce on this rank (shard_gptq out_index)."""
    _check_rank(rank, world_size, "row")
    k0, k1 = _even("g_idx", (k,), f"K = {k}", k, rank, world_size, PACK, "qweight packs 8 rows per int32")
    if group_size == -1:
        return torch.arange(k0, k1)
    perm, _ = _row_cut(None if g_idx is None else _whole(g_idx), k, group_size, k0, k1)
    return torch.arange(k0, k1) if perm is None else perm[k0:k1].clone()
