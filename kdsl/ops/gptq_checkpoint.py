"""GPTQ checkpoint tensors as they ship: what they must look like, and how they pack.

Layout (AutoGPTQ / GPTQModel): qweight int32 [K / 8, N] with row k in bits 4 * (k % 8);
qzeros int32 [G, N / 8] packed along N the same way; scales [G, N]; g_idx int32 [K], the
group of each input row. w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n], where
zero is the stored value plus one for checkpoint_format "gptq" and the stored value for "gptq_v2".
"""
from __future__ import annotations

import torch

from kdsl.naming import is_gptq_group_size
from kdsl.ops import _checks as check

ACTIVATIONS = (torch.float16, torch.bfloat16)
SUPPORTED_BITS = (4,)
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def scheme_args(bits, group_size, checkpoint_format) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected one of {list(SUPPORTED_BITS)}, got {bits!r}")
    if not is_gptq_group_size(group_size):
        raise ValueError(f"group_size: expected a power of two >= 16 or -1, got {group_size!r}")
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"checkpoint_format: expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")


def checkpoint_shapes(qweight, qzeros, scales, g_idx, k: int | None, bits: int, group_size: int,
                      values: bool = True) -> tuple[int, int, int]:
    """Check the checkpoint tensors against each other (and K when known); returns (K, N, G).
    values=False (the fake kernels under torch.compile, which have no data) leaves out g_idx's range."""
    pack = 32 // bits
    check.tensor("qweight", qweight, (torch.int32,), ndim=2)
    check.tensor("qzeros", qzeros, (torch.int32,), ndim=2)
    check.tensor("scales", scales, ACTIVATIONS, ndim=2)
    if k is None:
        k = qweight.shape[0] * pack
    elif k % pack or qweight.shape[0] != k // pack:
        raise ValueError(f"qweight: expected {k // pack} rows (K / {pack} for K = {k}), got shape {tuple(qweight.shape)}")
    n = qweight.shape[1]
    if group_size != -1 and k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")
    groups = 1 if group_size == -1 else k // group_size
    if n % pack:
        raise ValueError(f"qweight: N = {n} must be a multiple of {pack} (qzeros packs {pack} columns per int32)")
    check.shape("scales", scales, (groups, n), f"G = {groups} groups by N = {n} from qweight")
    check.shape("qzeros", qzeros, (groups, n // pack), f"G = {groups} groups by N / {pack}")
    if g_idx is not None:
        check.tensor("g_idx", g_idx, (torch.int32,), ndim=1)
        check.shape("g_idx", g_idx, (k,), "the group of each of the K input rows")
        if values and k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            # Out-of-range groups would read past scales and qzeros; refuse before launch.
            raise ValueError(f"g_idx: values must lie in [0, {groups}), got [{int(g_idx.min())}, {int(g_idx.max())}]")
    return k, n, groups


def default_g_idx(k: int, group_size: int, device) -> torch.Tensor:
    rows = torch.arange(k, dtype=torch.int32, device=device)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R, C] of values in [0, 2**bits) -> int32 [R / pack, C], row r at bits * (r % pack)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=values.device, dtype=torch.int64) * bits
    words = (values.reshape(-1, pack, values.shape[1]) << shifts[None, :, None]).sum(dim=1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed 32-bit


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 // bits values per word along R -> int32 [R * pack, C]."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(1) >> shifts[None, :, None]) & (2**bits - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """int32 [G, N / pack] packed along N -> the real zeros [G, N] (stored value + the format's offset)."""
    return unpack_rows(qzeros.T.contiguous(), bits).T + zero_offset
