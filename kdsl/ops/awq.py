"""AWQ (AutoAWQ "gemm" checkpoints): check and unpack the checkpoint tensors, then run the w4a16 kernels.

Layout: qweight int32 [K, N / 8] packed along N; nibble i (bits 4i) of word j holds column
8j + AWQ_ORDER[i]. qzeros int32 [G, N / 8] packed the same way; scales fp16/bf16 [G, N];
G = K / group_size. w[k, n] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]:
no +1 offset and no act-order. Once unpacked, AWQ is the same problem as GPTQ: `awq_prepare`
writes the prepared w4a16 layout and `kdsl.ops.w4a16_gemm` runs the same kernels on it.
"""
from __future__ import annotations

import torch

from kdsl.naming import awq_scheme_name, w4a16_scheme_name
from kdsl.ops import _checks as check
from kdsl.ops.gptq_checkpoint import ACTIVATIONS
from kdsl.ops.w4a16 import PREPARED_OP, W4A16Prepared, _w4a16_gemm_impl, prepare
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) held by nibble i
BITS = 4
PACK = 32 // BITS


def _scheme(group_size) -> str:
    """Check group_size and that the w4a16 kernels serving it were generated (the same on every path)."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size: expected a power of two >= 16, got {group_size!r}")
    registry.require_scheme(PREPARED_OP, w4a16_scheme_name(BITS, group_size), f"AWQ group_size = {group_size}")
    return awq_scheme_name(BITS, group_size)


def _shapes(qweight, qzeros, scales, group_size: int) -> tuple[int, int, int]:
    """Check the checkpoint tensors against each other; returns (K, N, G)."""
    check.tensor("qweight", qweight, (torch.int32,), ndim=2)
    check.tensor("qzeros", qzeros, (torch.int32,), ndim=2)
    check.tensor("scales", scales, ACTIVATIONS, ndim=2)
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    if k % group_size:
        raise ValueError(f"qweight: K = {k} rows is not a multiple of group_size = {group_size}")
    groups = k // group_size
    check.shape("scales", scales, (groups, n), f"G = {groups} groups by N = {n} (qweight packs {PACK} columns per int32)")
    check.shape("qzeros", qzeros, (groups, n // PACK), f"G = {groups} groups by N / {PACK}")
    check.same_device(qweight=qweight, qzeros=qzeros, scales=scales)
    return k, n, groups


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's column order -> int32 [R, C] of values in [0, 16)."""
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & (2**BITS - 1)  # [R, C / 8, nibble]
    order = torch.tensor(AWQ_ORDER, device=packed.device).argsort()  # nibble holding each column
    return nibbles[..., order].reshape(packed.shape[0], -1)


def awq_prepare(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
                group_size: int = 128) -> W4A16Prepared:
    """Prepare an AWQ checkpoint's tensors once for kdsl.ops.w4a16_gemm; activations must then come
    in scales' dtype. Runs the same kernels as prepared GPTQ weights."""
    _scheme(group_size)
    _shapes(qweight, qzeros, scales, group_size)
    return prepare(unpack_columns(qweight), unpack_columns(qzeros), scales, None,
                   bits=BITS, group_size=group_size, source="awq")


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
             group_size: int = 128) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w in x's dtype (fp16 or bf16), w from AWQ checkpoint tensors.

    Prepares the weights on every call: for a layer called more than once, `awq_prepare` once and
    call `w4a16_gemm(x, prepared)`.
    """
    if torch.compiler.is_compiling():  # one opaque op for Dynamo; see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.awq_gemm(x, qweight, qzeros, scales, group_size)
    return _awq_gemm_impl(x, qweight, qzeros, scales, group_size)


def _awq_gemm_outputs(x, qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """awq_gemm's checks and empty output (the fake kernel under torch.compile too)."""
    _scheme(group_size)
    check.tensor("x", x, ACTIVATIONS, min_ndim=1)
    k, n, _ = _shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x: expected K = {k} in the last dimension (qweight's rows), got shape {tuple(x.shape)}")
    check.same_device(x=x, qweight=qweight)
    return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)


def _awq_gemm_impl(x, qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    _awq_gemm_outputs(x, qweight, qzeros, scales, group_size)
    return _w4a16_gemm_impl(x, awq_prepare(qweight, qzeros, scales.to(x.dtype), group_size=group_size))


def awq_dequant(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
                group_size: int = 128) -> torch.Tensor:
    """w [N, K] in scales' dtype (nn.Linear's layout): x @ w.T matches awq_gemm up to rounding.
    A load-time conversion, computed with torch ops on the tensors' device."""
    if torch.compiler.is_compiling():  # see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.awq_dequant(qweight, qzeros, scales, group_size)
    return _awq_dequant_impl(qweight, qzeros, scales, group_size)


def _awq_dequant_outputs(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """awq_dequant's checks and empty output (the fake kernel under torch.compile too)."""
    _scheme(group_size)
    k, n, _ = _shapes(qweight, qzeros, scales, group_size)
    return torch.empty((n, k), dtype=scales.dtype, device=scales.device)


def _awq_dequant_impl(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    _awq_dequant_outputs(qweight, qzeros, scales, group_size)
    q = unpack_columns(qweight).float()  # [K, N]
    zeros = unpack_columns(qzeros).float().repeat_interleave(group_size, 0)
    w = (q - zeros) * scales.float().repeat_interleave(group_size, 0)
    return w.T.to(scales.dtype).contiguous()


# torch.ops.kdsl.* (kdsl.ops.spec). Both wait on the GPU (host_syncing): awq_gemm prepares its weights on every call,
# awq_dequant unpacks the nibble order with torch ops that copy from the host.
SPECS = (
    OpSpec("awq_gemm", "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor",
           _awq_gemm_impl, _awq_gemm_outputs, host_syncing=True),
    OpSpec("awq_dequant", "(Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor",
           _awq_dequant_impl, _awq_dequant_outputs, host_syncing=True),
)
