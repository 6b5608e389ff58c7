"""GPTQ INT4 tensor ops on checkpoint tensors as they ship.

Layout (AutoGPTQ / GPTQModel): qweight int32 [K / 8, N] with row k in bits 4 * (k % 8);
qzeros int32 [G, N / 8] packed along N the same way; scales [G, N]; g_idx int32 [K], the
group of each input row. w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n], where
zero is the stored value plus one for checkpoint_format "gptq" and the stored value for "gptq_v2".
"""
from __future__ import annotations

import torch

from kdsl.naming import gptq_scheme_name, is_gptq_group_size
from kdsl.ops import _checks as check
from kdsl.ops import fallback
from kdsl.runtime import registry

ACTIVATIONS = (torch.float16, torch.bfloat16)
SUPPORTED_BITS = (4,)
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def _scheme_args(bits, group_size, checkpoint_format) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected one of {list(SUPPORTED_BITS)}, got {bits!r}")
    if not is_gptq_group_size(group_size):
        raise ValueError(f"group_size: expected a power of two >= 16 or -1, got {group_size!r}")
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"checkpoint_format: expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")


def _checkpoint(qweight, qzeros, scales, g_idx, k: int | None, bits: int, group_size: int) -> tuple[int, int, int]:
    """Check the checkpoint tensors against each other (and K when known); returns (K, N, G)."""
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
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            # Out-of-range groups would read past scales and qzeros; refuse before launch.
            raise ValueError(f"g_idx: values must lie in [0, {groups}), got [{int(g_idx.min())}, {int(g_idx.max())}]")
    return k, n, groups


def _default_g_idx(k: int, group_size: int, device) -> torch.Tensor:
    rows = torch.arange(k, dtype=torch.int32, device=device)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def gptq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor | None = None, *, bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantized weight [K, N], in x's dtype (fp16 or bf16).

    g_idx None means row k is in group k // group_size; any permuted g_idx (act-order) works.
    Symmetric checkpoints still carry qzeros, and they are used.
    """
    _scheme_args(bits, group_size, checkpoint_format)
    check.tensor("x", x, ACTIVATIONS, min_ndim=1)
    k = x.shape[-1]
    _, n, _ = _checkpoint(qweight, qzeros, scales, g_idx, k, bits, group_size)
    device = check.same_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=device)
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    x2 = check.rows(x, k)
    if not check.use_kernels(device):
        groups = g_idx if g_idx is not None else _default_g_idx(k, group_size, device)
        return fallback.gptq_gemm(x2, qweight, qzeros, scales, groups, bits, ZERO_OFFSET[checkpoint_format]).view(y.shape)
    entry = registry.dispatch("gptq_gemm", gptq_scheme_name(bits, group_size, checkpoint_format), device)
    entry.launch(x2, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                 None if g_idx is None else g_idx.contiguous(), y.view(-1, n), entry.tile_for(x2.shape[0]))
    return y


def gptq_dequant(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """w [N, K] in scales' dtype (nn.Linear's layout): x @ w.T matches gptq_gemm up to rounding."""
    _scheme_args(bits, group_size, checkpoint_format)
    k, n, _ = _checkpoint(qweight, qzeros, scales, g_idx, None, bits, group_size)
    device = check.same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    w = torch.empty((n, k), dtype=scales.dtype, device=device)
    if w.numel() == 0:
        return w
    if not check.use_kernels(device):
        groups = g_idx if g_idx is not None else _default_g_idx(k, group_size, device)
        return fallback.gptq_dequant(qweight, qzeros, scales, groups, bits, ZERO_OFFSET[checkpoint_format], scales.dtype)
    entry = registry.dispatch("gptq_dequant", gptq_scheme_name(bits, group_size, checkpoint_format), device)
    entry.launch(qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                 None if g_idx is None else g_idx.contiguous(), w, entry.tile_for(n))
    return w


def gptq_quantize(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, sym: bool = True) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of w [N, K] into the "gptq" checkpoint layout.

    For tests, demos and users without a calibrated GPTQ run: it is not GPTQ's
    error-compensating algorithm, only its storage format. Per group and column the range
    is min/max (asymmetric) or absmax (symmetric, zero at the midpoint). Zeros are kept in
    1..15 so that the stored zero - 1 fits in four bits (real zero 0 would wrap to -1).
    Returns {"qweight", "qzeros", "scales" (w's dtype if fp16/bf16, else fp16), "g_idx"}.
    """
    _scheme_args(bits, group_size, "gptq")
    check.tensor("w", w, (torch.float16, torch.bfloat16, torch.float32), ndim=2)
    n, k = w.shape
    pack, max_q = 32 // bits, 2**bits - 1
    if k % pack or n % pack:
        raise ValueError(f"w: N = {n} and K = {k} must both be multiples of {pack}")
    if group_size != -1 and k % group_size:
        raise ValueError(f"w: K = {k} is not a multiple of group_size = {group_size}")
    size = k if group_size == -1 else group_size
    wt = w.float().T.reshape(k // size, size, n)  # [G, rows of the group, N]
    if sym:
        amax = wt.abs().amax(dim=1)
        scale = 2 * amax / max_q
        zero = torch.full_like(scale, (max_q + 1) // 2)
    else:
        low, high = wt.amin(dim=1).clamp(max=0), wt.amax(dim=1).clamp(min=0)
        scale = (high - low) / max_q
        zero = torch.round(-low / torch.where(scale == 0, 1.0, scale)).clamp(1, max_q)
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero group: any scale reproduces zeros
    scale_dtype = w.dtype if w.dtype in ACTIVATIONS else torch.float16
    scale = scale.to(scale_dtype)
    q = torch.clamp(torch.round(wt / scale.float()[:, None]) + zero[:, None], 0, max_q).to(torch.int64)
    return {
        "qweight": _pack_rows(q.reshape(k, n), bits),
        "qzeros": _pack_rows((zero.to(torch.int64) - 1).T.contiguous(), bits).T.contiguous(),
        "scales": scale,
        "g_idx": _default_g_idx(k, group_size, w.device),
    }


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R, C] of values in [0, 2**bits) -> int32 [R / pack, C], row r at bits * (r % pack)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=values.device, dtype=torch.int64) * bits
    words = (values.reshape(-1, pack, values.shape[1]) << shifts[None, :, None]).sum(dim=1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed 32-bit
