"""GPTQ weights prepared once for the fast W4A16 kernel, in the layout its definition declares.

`gptq_prepare` takes the checkpoint tensors (layout: kdsl.ops.gptq_checkpoint), asks the
registry which prepared kernel serves the device, and writes the weights the way that
kernel's `layout` (kdsl.schema.layout.GPTQLayout) says: K sorted by group, so act-order
costs a gather of x's columns instead of a gather of scales per element; zeros either
unpacked and biased for the kernel's dequant, or left packed. Validation that needs the
tensors' values (g_idx's range) happens here, once, not on every call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.naming import gptq_scheme_name
from kdsl.ops import _checks as check
from kdsl.ops import fallback
from kdsl.ops.gptq_checkpoint import (
    ACTIVATIONS,
    ZERO_OFFSET,
    checkpoint_shapes,
    default_g_idx,
    pack_rows,
    scheme_args,
    unpack_rows,
    unpack_zeros,
)
from kdsl.runtime import registry
from kdsl.schema.layout import PAIR_SPAN, PLANE_ROWS, PLANE_TILE_K, PLANE_TILE_N

PREPARED_OP = "gptq_gemm_prepared"


@dataclass(frozen=True, eq=False)
class GPTQPrepared:
    """Weights of one GPTQ linear layer, ready for `kdsl.ops.gptq_gemm(x, prepared)`.

    qweight, rows in prepared order (row k holds input column perm[k]): int32 [K / 8, N] in the
    "checkpoint" weights layout, or int32 [N tiles, K tiles, PLANE_TILE_N, 16] in "k_planes"
    (see `pack_planes`);
    zeros [G, N] in `dtype` (layout zeros="biased": zero + the kernel's magic bias) or int32
    [G, N / 8] (zeros="packed", as the checkpoint stores them); scales [G, N] in `dtype`
    (zeros="paired": biased zeros and scales are views, column stride 2, of one [G, N, 2] tensor);
    groups int32 [K], the group of each prepared row; perm int32 [K] or None when the
    checkpoint's order is already sorted.
    """

    scheme: str
    bits: int
    zero_offset: int  # added to stored zeros by the checkpoint format ("gptq": 1)
    layout: dict
    dtype: torch.dtype
    k: int
    n: int
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    perm: torch.Tensor | None
    contiguous_groups: bool  # prepared row k is in group k // group_size
    zero_bias: int  # added to the zeros in the "biased" layout

    @property
    def device(self) -> torch.device:
        return self.qweight.device


def gptq_prepare(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> GPTQPrepared:
    """Prepare a GPTQ checkpoint's tensors once; activations must then come in scales' dtype."""
    scheme_args(bits, group_size, checkpoint_format)
    k, n, groups = checkpoint_shapes(qweight, qzeros, scales, g_idx, None, bits, group_size)
    device = check.same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    scheme = gptq_scheme_name(bits, group_size, checkpoint_format)
    entry = registry.dispatch(PREPARED_OP, scheme, device)
    layout = dict(entry.layout)

    row_groups = default_g_idx(k, group_size, device) if g_idx is None else g_idx.to(torch.int32)
    perm = None
    q = unpack_rows(qweight.contiguous(), bits)  # [K, N]
    if g_idx is not None and k:
        order = torch.argsort(row_groups, stable=True)
        if not torch.equal(order, torch.arange(k, device=device)):
            perm = order.to(torch.int32)
            row_groups = row_groups[order]
            q = q[order]
    contiguous = torch.equal(row_groups, default_g_idx(k, group_size, device))

    zero_bias = 0
    scales = scales.contiguous()
    if layout["zeros"] != "packed":  # "biased", or "paired" with the scales
        # The kernel makes (bias + q) from q's bits and subtracts (bias + zero): both exact.
        zero_bias = entry.load().MAGIC[scales.dtype][1]
        zeros = (unpack_zeros(qzeros, bits, ZERO_OFFSET[checkpoint_format]) + zero_bias).to(scales.dtype).contiguous()
        if layout["zeros"] == "paired":
            pairs = torch.stack((scales, zeros), dim=-1)  # [G, N, 2]: one 32-bit (scale, zero) per column
            scales, zeros = pairs[..., 0], pairs[..., 1]
    else:
        zeros = qzeros.contiguous()
    if layout.get("weights") == "k_planes":
        packed = pack_planes(q.to(torch.int64))
    else:
        packed = pack_rows(q.to(torch.int64), bits) if perm is not None else qweight.contiguous()
    return GPTQPrepared(
        scheme=scheme, bits=bits, zero_offset=ZERO_OFFSET[checkpoint_format], layout=layout, dtype=scales.dtype, k=k, n=n,
        qweight=packed,
        zeros=zeros, scales=scales, groups=row_groups.contiguous(), perm=perm,
        contiguous_groups=contiguous, zero_bias=zero_bias,
    )


def pack_planes(q: torch.Tensor) -> torch.Tensor:
    """q int64 [K, N] in [0, 16) -> int32 [N tiles, K tiles, PLANE_TILE_N, PLANE_ROWS], the "k_planes" layout.

    Word (n, kk) of tile (nt, kt) holds, of column nt * PLANE_TILE_N + n, the rows
    kt * PLANE_TILE_K + PAIR_SPAN * p + 2 kk + h in nibble p + 4 h (p < 4, h < 2): the two nibbles a
    LOP3 turns into one half2 are adjacent rows. K and N are padded with zeros to whole tiles.
    """
    k, n = q.shape
    k_tiles, n_tiles = -(-k // PLANE_TILE_K), -(-n // PLANE_TILE_N)
    padded = torch.zeros(k_tiles * PLANE_TILE_K, n_tiles * PLANE_TILE_N, dtype=torch.int64, device=q.device)
    padded[:k, :n] = q
    rows = padded.view(k_tiles, 4, PLANE_ROWS, 2, n_tiles, PLANE_TILE_N)  # [kt, p, kk, h, nt, n]
    nibbles = rows.permute(4, 0, 5, 2, 3, 1).reshape(n_tiles, k_tiles, PLANE_TILE_N, PLANE_ROWS, 8)  # j = 4 h + p
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def unpack_planes(words: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """pack_planes' inverse: int32 [N tiles, K tiles, PLANE_TILE_N, PLANE_ROWS] -> int32 [k, n]."""
    n_tiles, k_tiles = words.shape[:2]
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 15  # [nt, kt, n, kk, j]
    rows = nibbles.view(n_tiles, k_tiles, PLANE_TILE_N, PLANE_ROWS, 2, 4).permute(1, 5, 3, 4, 0, 2)
    return rows.reshape(k_tiles * PLANE_TILE_K, n_tiles * PLANE_TILE_N)[:k, :n]


def checkpoint_rows(prepared: GPTQPrepared) -> torch.Tensor:
    """The prepared weights as int32 [K / 8, N] words in prepared row order, whatever the layout."""
    if prepared.layout.get("weights") == "k_planes":
        return pack_rows(unpack_planes(prepared.qweight, prepared.k, prepared.n).to(torch.int64), prepared.bits)
    return prepared.qweight


def gemm_prepared(x: torch.Tensor, prepared: GPTQPrepared) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w, w from prepared weights, in x's dtype."""
    check.tensor("x", x, ACTIVATIONS, min_ndim=1)
    if x.dtype != prepared.dtype:
        raise TypeError(f"x: expected dtype {check.dtype_name(prepared.dtype)} (the weights were prepared "
                        f"with scales in that dtype), got {check.dtype_name(x.dtype)}")
    if x.shape[-1] != prepared.k:
        raise ValueError(f"x: expected K = {prepared.k} in the last dimension (the prepared weights), got shape {tuple(x.shape)}")
    device = check.same_device(x=x, prepared=prepared.qweight)
    k, n = prepared.k, prepared.n
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=device)
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    x2 = check.rows(x, k)
    if not check.use_kernels(device):
        zeros = (prepared.zeros.float() - prepared.zero_bias if prepared.layout["zeros"] != "packed"
                 else unpack_zeros(prepared.zeros, prepared.bits, prepared.zero_offset))
        return fallback.gptq_gemm_sorted(x2, checkpoint_rows(prepared), zeros, prepared.scales, prepared.groups,
                                         prepared.perm, prepared.bits).view(y.shape)
    entry = registry.dispatch(PREPARED_OP, prepared.scheme, device)
    if entry.layout != prepared.layout:
        raise ValueError(f"prepared: weights are in layout {prepared.layout}, but {entry.name} reads "
                         f"{entry.layout}; prepare them again with kdsl.ops.gptq_prepare")
    refusal = entry.load().tile_refusal
    tile = entry.tile_for(x2.shape[0], n, refuses=lambda params: refusal(params, x2, prepared.contiguous_groups))
    entry.launch(x2, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                 prepared.contiguous_groups, y.view(-1, n), tile)
    return y
