"""fp8_gemm/tma_persistent (Hopper): TMA descriptors, optionally a persistent grid, wgmma through Triton.

A, B and C move through 2-D TMA descriptors; split K sums its partials in-kernel (common/splitk_store.py.j2);
swap_ab puts B's rows on the wgmma's 64-row side for few rows of A. Its neighbours on sm_90 are their own
units: fp8_gemm/deferred_gluon, the Gluon kernel that overlaps wgmma with the rescale.
"""
from typing import Literal

from pydantic import Field, PositiveInt

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.c_abi import SPLIT, ImplLaunch, TmaDescriptor
from kdsl.kernels.block_fp8.fp8_gemm_portable import TILE_ORDER_HELP, gemm_values, operand_ring_bytes
from kdsl.kernels.described import described
from kdsl.strict_model import StrictModel

SPLIT_FILL_HELP = ("how many of the tile's programs fit on an SM at once (default 2): split K plans for this many "
                   "per SM, and a persistent grid launches this many per SM")
SPLIT_MIN_STEPS_HELP = ("fewest K steps a program of a split takes: the split never cuts K into shorter runs, whose "
                        "partial sums' fixup costs more than their extra programs save")


class Options(StrictModel):
    persistent: bool = Field(False, description="split_fill programs per SM loop over the tiles, instead of one "
                                                "program per tile")
    tile_order: Literal["m_major", "n_major"] = Field("m_major", description=TILE_ORDER_HELP)
    swap_ab: bool = Field(False, description="compute C^T = B A^T so wide N fills the MMA's M side")
    warp_specialize: bool = Field(False, description="producer/consumer warps in the K loop")
    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


def shared_bytes(scheme, tile, options) -> int:
    # The TMA ring plus the bf16 epilogue tile staged for the store.
    return operand_ring_bytes(scheme, tile, options) + tile.block_m * tile.block_n * 2


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = []
    if options.warp_specialize and tile.split_k > 1:
        # Measured on an H200 with Triton 3.6: the warp-specialized loop runs the split-K fixup's
        # atomics so that its counters are left non-zero, and every later split-K launch is wrong.
        found.append(f"{where}.options.warp_specialize: cannot be combined with split_k = {tile.split_k} "
                     "(Triton's warp-specialized loop leaves the split-K counters dirty); use one or the other")
    return found


# Tiles, K split and persistent grid.
_FP8_TILES = "cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
_FP8_SPLIT = f"split_for(cdiv(K, {{BLOCK_K}}), {_FP8_TILES}, {{SPLIT_K}}, {{split_min_steps}}, {{split_fill}}, sms)"
_FP8_PROGRAMS = (f"programs({_FP8_TILES} * split, {{persistent}}, {{split_fill}} + 2 * ({{split_fill}} == 0), sms)")

C_LAUNCH = ImplLaunch(
    # TensorDescriptors over a [M, K], b [N, K] and c [M, N] (16-byte aligned bases and row strides: see
    # `refuses`; unit inner strides are the caller's); a persistent grid from the SM count; the K split of
    # split_for with its scratch (c itself where there is no split).
    params=(("a_desc", "desc"), ("b_desc", "desc"), ("c_desc", "desc"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("c_ptr", "c"), ("ws_ptr", "c"), ("count_ptr", "c"), ("M", "M"), ("N", "N"), ("K", "K"),
            ("stride_asm", "lda_s"), ("stride_bsn", "ldb_s"), ("stride_cm", "ldc"),
            ("num_programs", _FP8_PROGRAMS)),
    pointer_types={"as_ptr": "fp32", "bs_ptr": "fp32", "c_ptr": "dtype:out_dtype",
                   "ws_ptr": "scratch:fp32:out_dtype", "count_ptr": "scratch:i32:out_dtype"},
    descriptors={
        "a_desc": TmaDescriptor("a", "fp8e4nv", ("M", "K"), ("lda", "1"), ("{BLOCK_M}", "{BLOCK_K}")),
        "b_desc": TmaDescriptor("b", "fp8e4nv", ("N", "K"), ("ldb", "1"), ("{BLOCK_N}", "{BLOCK_K}")),
        "c_desc": TmaDescriptor("c", "dtype:out_dtype", ("M", "N"), ("ldc", "1"), ("{BLOCK_M}", "{BLOCK_N}")),
    },
    grid=(_FP8_PROGRAMS, "1", "1"),
    constexprs=lambda tile, scheme: {
        "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
        "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major",
        "NUM_STAGES": tile["num_stages"], "WARP_SPECIALIZE": tile["warp_specialize"],
        "SWAP_AB": tile["swap_ab"]},
    options=lambda tile: {"num_warps": tile["num_warps"]},  # num_stages goes in as a constexpr
    runtime_constexprs=(("SPLIT_K", _FP8_SPLIT, SPLIT),),
    scratch=("ws_ptr", "count_ptr", f"{_FP8_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", _FP8_TILES),
    scratch_alias="c",
    # TMA: 16-byte aligned bases and row strides. kdsl.ops copies other operands to aligned contiguous
    # ones; C cannot, so such calls run the kernel the registry picks without this one (the portable).
    refuses="nonzero(addr(a) % 16) + nonzero(addr(b) % 16) + nonzero(addr(c) % 16) + nonzero(lda % 16)"
            " + nonzero(ldb % 16) + nonzero(ldc * dtype_size(out_dtype) % 16)",
    refused_to="entry",
    values=gemm_values,
)


IMPL = KernelImpl(
    "block_fp8", "fp8_gemm", "tma_persistent", "block_fp8/fp8_gemm_tma_persistent.py.j2", 90, 90,
    "TMA tensor descriptors, optionally a persistent grid over SMs, wgmma through Triton, split K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=Options, shared_bytes=shared_bytes, problems=problems,
    min_block_m=16, launch=described(C_LAUNCH), tune_grid={"prefill": {"persistent": (False, True)}})
