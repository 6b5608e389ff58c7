"""The kernel implementations kdsl can render: one unit each (kdsl.kernels.base.KernelImpl).

A definition's variant names an (op, impl) pair from CATALOGUE; validation checks the variant's
arch range, its tiles' common fields and each tile's `options` against the unit. Adding a kernel
adds a unit here and its template; nothing else lists knobs.
"""
from __future__ import annotations

from kdsl.kernels import block_fp8, gptq, w4a16  # noqa: F401  (families)
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, NoOptions
from kdsl.kernels.block_fp8 import (fp8_bmm_portable, fp8_bmm_tma_sm90, fp8_gemm_deferred_gluon, fp8_gemm_portable,
                                    fp8_gemm_tma_persistent, fp8_grouped_gemm_portable, fp8_linear_portable,
                                    moe_fp8_sorted, moe_fp8_sorted_gluon, quant, rms_norm, silu_mul)
from kdsl.kernels.gptq import checkpoint
from kdsl.kernels.w4a16 import dequant, gemv, gemv_mma_gluon, mma, moe_sorted, overlap_gluon, planes_mma

# Tile fields every implementation reads.
BASE_KNOBS = frozenset({"m_max", "num_warps"})

CATALOGUE: tuple[KernelImpl, ...] = (
    quant.ACT_QUANT_ROWWISE, quant.WEIGHT_QUANT_BLOCKWISE, quant.WEIGHT_DEQUANT_BLOCKWISE,
    silu_mul.SILU_MUL, silu_mul.SILU_MUL_QUANT, rms_norm.RMS_NORM, rms_norm.RMS_NORM_QUANT,
    rms_norm.ADD_RMS_NORM, rms_norm.ADD_RMS_NORM_QUANT,
    fp8_gemm_portable.IMPL, fp8_gemm_tma_persistent.IMPL, fp8_gemm_deferred_gluon.IMPL,
    fp8_bmm_portable.IMPL, fp8_bmm_tma_sm90.IMPL,
    fp8_linear_portable.IMPL,
    fp8_grouped_gemm_portable.IMPL, fp8_grouped_gemm_portable.MASKED_IMPL, moe_fp8_sorted.IMPL,
    moe_fp8_sorted_gluon.IMPL,
    checkpoint.GEMM_SPLITK, checkpoint.DEQUANT_BLOCKWISE,
    mma.IMPL, planes_mma.IMPL, gemv.IMPL, gemv_mma_gluon.IMPL, overlap_gluon.IMPL,
    dequant.IMPL, moe_sorted.IMPL,
)


def find_impl(op: str, impl: str) -> KernelImpl | None:
    for entry in CATALOGUE:
        if entry.op == op and entry.impl == impl:
            return entry
    return None


def ops_of_family(family: str) -> list[str]:
    return sorted({entry.op for entry in CATALOGUE if entry.family == family})


def dequant_op_for(op: str) -> str | None:
    """The op whose kernels dequantize op's weights for its dequantize + cuBLAS path (Variant.dequant_min_m)."""
    return next((entry.op for entry in CATALOGUE if entry.dequant_for == op), None)


__all__ = ["BASE_KNOBS", "CATALOGUE", "GEMM_KNOBS", "KernelImpl", "NoOptions", "dequant_op_for", "find_impl",
           "ops_of_family"]
