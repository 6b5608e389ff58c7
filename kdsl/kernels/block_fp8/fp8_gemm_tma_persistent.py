"""fp8_gemm/tma_persistent (Hopper): TMA descriptors, persistent grid, wgmma through Triton.

block_m = 1 tiles run a CUDA-core GEMV (fp8_gemv.py.j2); deferred_rescale tiles run the Gluon kernel
that overlaps block k's wgmma with block k-1's rescale (fp8_gemm_deferred.py.j2).
"""
from typing import Literal

from pydantic import Field, PositiveInt

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, warpgroup_per_64
from kdsl.kernels.block_fp8.fp8_gemm_portable import TILE_ORDER_HELP, operand_ring_bytes
from kdsl.schema._base import StrictModel

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
    deferred_rescale: bool = Field(False, description="Gluon kernel: block k's wgmma runs while block k-1's product "
                                                      "is scaled into the accumulator; one warpgroup per 64 rows")
    edge_tiles: bool = Field(False, description="persistent deferred_rescale tiles: N's partial last column, in tiles "
                                                "only as wide as it, goes to the programs with a whole tile fewer, "
                                                "when that saves the grid a round")
    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


def shared_bytes(scheme, tile, options: Options) -> int:
    # The TMA ring plus the bf16 epilogue tile staged for the store; edge tiles stage up to half a tile more
    # (an edge wider than half a tile uses the whole tile's buffers).
    epilogue = tile.block_m * tile.block_n * 2
    return operand_ring_bytes(scheme, tile, options) + epilogue + (epilogue // 2 if options.edge_tiles else 0)


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = []
    if options.warp_specialize and tile.split_k > 1:
        # Measured on an H200 with Triton 3.6: the warp-specialized loop runs the split-K fixup's
        # atomics so that its counters are left non-zero, and every later split-K launch is wrong.
        found.append(f"{where}.options.warp_specialize: cannot be combined with split_k = {tile.split_k} "
                     "(Triton's warp-specialized loop leaves the split-K counters dirty); use one or the other")
    if options.deferred_rescale:
        found += _deferred_rescale_problems(f"{where}.options.deferred_rescale", scheme, tile, options)
    if options.edge_tiles:
        found += [f"{where}.options.edge_tiles: {reason}" for flag, reason in (
            (options.persistent, "only a persistent grid has programs with a round to spare; set persistent = true"),
            (options.deferred_rescale, "the edge tiles are part of the Gluon kernel; set deferred_rescale = true"),
        ) if not flag]
    return found


def _deferred_rescale_problems(where: str, scheme, tile, options: Options) -> list[str]:
    """One warpgroup per 64 rows, one scale group per K block, one weight block across the tile's columns,
    whole tiles per program in m_major order."""
    found = warpgroup_per_64(where, "rows", "block_m", tile.block_m, tile.num_warps)
    if tile.block_k != scheme.quant_group_k:
        found.append(f"{where}: needs block_k = {scheme.quant_group_k}, one scale group per K block "
                     f"(got {tile.block_k})")
    if scheme.weight_block[0] % tile.block_n or tile.block_n < 8:
        found.append(f"{where}: needs block_n to divide the weight block's {scheme.weight_block[0]} rows "
                     f"(got {tile.block_n})")
    for knob, value in (("split_k", tile.split_k > 1), ("swap_ab", options.swap_ab),
                        ("warp_specialize", options.warp_specialize), ("tile_order", options.tile_order != "m_major")):
        if value:
            found.append(f"{where}: the Gluon kernel computes whole tiles in m_major order; drop {knob}")
    return found


IMPL = KernelImpl(
    "block_fp8", "fp8_gemm", "tma_persistent", "block_fp8/fp8_gemm_tma_persistent.py.j2", 90, 90,
    "TMA tensor descriptors, persistent grid over SMs, wgmma through Triton; block_m = 1 is a CUDA-core GEMV; "
    "deferred_rescale tiles overlap wgmma and rescale in Gluon",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=Options, shared_bytes=shared_bytes, problems=problems,
    min_block_m=16, gemv_block_m=True)
