"""fp8_gemm/deferred_gluon (Hopper, Gluon): block k's wgmma runs while block k-1's product is rescaled.

Each K block's product must be scaled before it joins the fp32 accumulator. A Triton kernel waits for every
wgmma before it scales, and the tensor cores idle meanwhile; Gluon exposes the wgmma wait, so this kernel
keeps one wgmma in flight across the rescale. TMA feeds an mbarrier ring of num_stages slots; one warpgroup
per 64 rows; whole tiles in m_major order (GROUP_M bands). Gluon has no interpreter: at run time its
`refusal` passes CPU calls to the definition's next tile, fp8_gemm/tma_persistent's Triton kernel with the
same blocks.
"""
from pydantic import Field, PositiveInt

from kdsl.kernels.base import KernelImpl, warpgroup_per_64
from kdsl.kernels.block_fp8.fp8_gemm_portable import one_scale_per_k_block, operand_ring_bytes
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP
from kdsl.schema._base import StrictModel


class Options(StrictModel):
    persistent: bool = Field(False, description="split_fill programs per SM loop over the tiles, instead of one "
                                                "program per tile")
    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    edge_tiles: bool = Field(False, description="persistent grid: N's partial last column, in tiles only as wide "
                                                "as it, goes to the programs with a whole tile fewer, when that "
                                                "saves the grid a round")


def shared_bytes(scheme, tile, options: Options) -> int:
    # The TMA ring plus the bf16 epilogue tile staged for the store; edge tiles stage up to half a tile more
    # (an edge wider than half a tile uses the whole tile's buffers).
    epilogue = tile.block_m * tile.block_n * 2
    return operand_ring_bytes(scheme, tile, options) + epilogue + (epilogue // 2 if options.edge_tiles else 0)


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    """One warpgroup per 64 rows, one scale group per K block, one weight block across the tile's columns."""
    found = warpgroup_per_64(where, "rows", "block_m", tile.block_m, tile.num_warps)
    found += one_scale_per_k_block(where, scheme, tile)
    if tile.block_n < 8:
        found.append(f"{where}.block_n: needs 8 or more, the narrowest wgmma (got {tile.block_n})")
    if options.edge_tiles and not options.persistent:
        found.append(f"{where}.options.edge_tiles: only a persistent grid has programs with a round to spare; "
                     "set persistent = true")
    return found


IMPL = KernelImpl(
    "block_fp8", "fp8_gemm", "deferred_gluon", "block_fp8/fp8_gemm_deferred_gluon.py.j2", 90, 90,
    "Gluon, TMA ring: block k's wgmma overlaps block k-1's rescale; one warpgroup per 64 rows; GPU only",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "group_m", "num_stages", "n_min"}), options=Options,
    shared_bytes=shared_bytes, problems=problems, min_block_m=64, refusal="refusal")
