"""fp8_grouped_gemm/portable and fp8_grouped_gemm_masked/portable: block-FP8 GEMMs over the experts of a MoE layer
with pointer loads (sm_89+), fp8_gemm/portable's tile and options.

grouped (contiguous layout): rows of A grouped by expert, an expert id per row (-1: padding); a tile whose rows
belong to one expert makes one pass over K, one holding several experts one pass per expert.
masked: A [E, max_m, K] with a per-expert row count read on the device; the grid covers max_m rows per expert."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.block_fp8.fp8_gemm_portable import (Options, operand_ring_bytes, portable_constexprs,
                                                     portable_options, portable_tile_constexprs)
from kdsl.kernels.host import cdiv


def launch(generated, a, a_s, b, b_s, group_ids, c, tile):
    """a [M, K] fp8, a_s [M, K // ACT_GROUP], b [E, N, K] fp8, b_s [E, cdiv(N, W_BLOCK_N), K // W_BLOCK_K],
    group_ids int32 [M] (contiguous), c [M, N].

    Unit stride along K for a, b and both scales (and along N for c) is the caller's to guarantee; M, N >= 1.
    """
    M, K = a.shape
    E, N = b.shape[0], b.shape[1]
    grid = (cdiv(M, tile["BLOCK_M"]) * cdiv(N, tile["BLOCK_N"]), 1, 1)
    return Launch(generated.kernel, grid, (
        a, b, c, a_s, b_s, group_ids, M, N, K, E,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), a_s.stride(0), b_s.stride(0), b_s.stride(1),
    ), portable_constexprs(tile))


def launch_masked(generated, a, a_s, b, b_s, masked_m, c, tile):
    """a [E, MAX_M, K] fp8, a_s [E, MAX_M, K // ACT_GROUP], b [E, N, K] fp8,
    b_s [E, cdiv(N, W_BLOCK_N), K // W_BLOCK_K], masked_m int32 [E] (contiguous), c [E, MAX_M, N].

    Unit stride along K for a, b and both scales (and along N for c) is the caller's to guarantee; E, MAX_M, N >= 1.
    """
    E, max_m, K = a.shape
    N = b.shape[1]
    grid = (cdiv(max_m, tile["BLOCK_M"]) * cdiv(N, tile["BLOCK_N"]), E, 1)
    return Launch(generated.kernel, grid, (
        a, b, c, a_s, b_s, masked_m, max_m, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1),
    ), portable_constexprs(tile))


# launch() of fp8_grouped_gemm_portable.py: one program per (BLOCK_M, BLOCK_N) tile of c.
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
    kernel="{module}",
)

# launch_masked() of fp8_grouped_gemm_portable.py: programs over max_m rows of each expert, an expert a grid
# row; the programs past masked_m[e] return at once.
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
    kernel="{module}",
)


IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm", "portable", "block_fp8/fp8_grouped_gemm_portable.py.j2", 89, None,
    "contiguous layout (an expert id per row), pointer loads, one pass over K per expert in a tile",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16, launch=launch,
    c_launches={"": C_LAUNCH})

MASKED_IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm_masked", "portable", "block_fp8/fp8_grouped_gemm_masked_portable.py.j2", 89,
    None, "masked layout (rows per expert read on the device), pointer loads",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16, launch=launch_masked,
    c_launches={"": MASKED_C_LAUNCH})
