"""fp8_grouped_gemm/portable and fp8_grouped_gemm_masked/portable: block-FP8 GEMMs over the experts of a MoE layer
with pointer loads (sm_89+), fp8_gemm/portable's tile and options.

grouped (contiguous layout): rows of A grouped by expert, an expert id per row (-1: padding); a tile whose rows
belong to one expert makes one pass over K, one holding several experts one pass per expert.
masked: A [E, max_m, K] with a per-expert row count read on the device; the grid covers max_m rows per expert."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.block_fp8.fp8_gemm_portable import (Options, operand_ring_bytes, portable_options,
                                                     portable_tile_constexprs)
from kdsl.kernels.described import described
from kdsl.kernels.expressions import dtype_code


def grouped_values(a, a_s, b, b_s, group_ids, c) -> dict:
    """fp8_grouped_gemm's C arguments: a [M, K] fp8, a_s [M, K // ACT_GROUP], b [E, N, K] fp8,
    b_s [E, cdiv(N, W_BLOCK_N), K // W_BLOCK_K], group_ids int32 [M] (contiguous), c [M, N]. Unit stride along K
    for a, b and both scales (and along N for c) is the caller's to guarantee; M, N >= 1."""
    M, K = a.shape
    return {"a": a, "lda": a.stride(0), "a_s": a_s, "lda_s": a_s.stride(0), "b": b, "stride_be": b.stride(0),
            "stride_bn": b.stride(1), "b_s": b_s, "stride_bse": b_s.stride(0), "stride_bsn": b_s.stride(1),
            "group_ids": group_ids, "c": c, "ldc": c.stride(0), "out_dtype": dtype_code(c.dtype),
            "M": M, "N": b.shape[1], "K": K, "E": b.shape[0]}


def masked_values(a, a_s, b, b_s, masked_m, c) -> dict:
    """fp8_grouped_gemm_masked's C arguments: a [E, MAX_M, K] fp8, a_s [E, MAX_M, K // ACT_GROUP], b [E, N, K] fp8,
    b_s [E, cdiv(N, W_BLOCK_N), K // W_BLOCK_K], masked_m int32 [E] (contiguous), c [E, MAX_M, N]. Unit stride
    along K for a, b and both scales (and along N for c) is the caller's to guarantee; E, MAX_M, N >= 1."""
    E, max_m, K = a.shape
    return {"a": a, "stride_ae": a.stride(0), "stride_am": a.stride(1), "a_s": a_s, "stride_ase": a_s.stride(0),
            "stride_asm": a_s.stride(1), "b": b, "stride_be": b.stride(0), "stride_bn": b.stride(1),
            "b_s": b_s, "stride_bse": b_s.stride(0), "stride_bsn": b_s.stride(1), "masked_m": masked_m,
            "c": c, "stride_ce": c.stride(0), "stride_cm": c.stride(1), "out_dtype": dtype_code(c.dtype),
            "E": E, "max_m": max_m, "N": b.shape[1], "K": K}


# One program per (BLOCK_M, BLOCK_N) tile of c.
C_LAUNCH = ImplLaunch(
    params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("group_ptr", "group_ids"), ("M", "M"), ("N", "N"), ("K", "K"), ("E", "E"),
            ("stride_am", "lda"), ("stride_be", "stride_be"), ("stride_bn", "stride_bn"), ("stride_cm", "ldc"),
            ("stride_asm", "lda_s"), ("stride_bse", "stride_bse"), ("stride_bsn", "stride_bsn")),
    pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                   "as_ptr": "fp32", "bs_ptr": "fp32", "group_ptr": "i32"},
    grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "1"),
    constexprs=portable_tile_constexprs,
    options=portable_options,
    values=grouped_values,
)

# Programs over max_m rows of each expert, an expert a grid row; the programs past masked_m[e] return at once.
MASKED_C_LAUNCH = ImplLaunch(
    params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("count_ptr", "masked_m"), ("MAX_M", "max_m"), ("N", "N"), ("K", "K"),
            ("stride_ae", "stride_ae"), ("stride_am", "stride_am"), ("stride_be", "stride_be"),
            ("stride_bn", "stride_bn"), ("stride_ce", "stride_ce"), ("stride_cm", "stride_cm"),
            ("stride_ase", "stride_ase"), ("stride_asm", "stride_asm"), ("stride_bse", "stride_bse"),
            ("stride_bsn", "stride_bsn")),
    pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                   "as_ptr": "fp32", "bs_ptr": "fp32", "count_ptr": "i32"},
    grid=("cdiv(max_m, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "E", "1"),
    constexprs=portable_tile_constexprs,
    options=portable_options,
    values=masked_values,
)


IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm", "portable", "block_fp8/fp8_grouped_gemm_portable.py.j2", 89, None,
    "contiguous layout (an expert id per row), pointer loads, one pass over K per expert in a tile",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16,
    launch=described(C_LAUNCH))

MASKED_IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm_masked", "portable", "block_fp8/fp8_grouped_gemm_masked_portable.py.j2", 89,
    None, "masked layout (rows per expert read on the device), pointer loads",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16,
    launch=described(MASKED_C_LAUNCH))
