"""fp8_gemm/deferred_gluon (Hopper, Gluon): block k's wgmma runs while block k-1's product is rescaled.

Each K block's product must be scaled before it joins the fp32 accumulator. A Triton kernel waits for every
wgmma before it scales, and the tensor cores idle meanwhile; Gluon exposes the wgmma wait, so this kernel
keeps one wgmma in flight across the rescale. TMA feeds an mbarrier ring of num_stages slots; one warpgroup
per 64 rows; whole tiles in m_major order (GROUP_M bands). Gluon has no interpreter: at run time its
`refusal` passes CPU calls to the definition's next tile, fp8_gemm/tma_persistent's Triton kernel with the
same blocks.
"""
from pydantic import Field, PositiveInt

from kdsl.kernels.base import KernelImpl, Launch, warpgroup_per_64
from kdsl.kernels.block_fp8.fp8_gemm_portable import one_scale_per_k_block, operand_ring_bytes
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP
from kdsl.kernels import host
from kdsl.kernels.host import SPLIT_FILL, cdiv, gluon_descriptor, programs_for
from kdsl.strict_model import StrictModel


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


def refusal(generated, tile, call):
    """Why this kernel should not serve `call` (a kdsl.runtime Call), None where it should; the definition's
    next tile serving M and N (fp8_gemm/tma_persistent's Triton kernel with the same blocks) then runs instead."""
    if call.device_type != "cuda":
        return "a Gluon kernel, which runs on the GPU only (Gluon has no interpreter)"
    return None


def edge_tiles(M: int, N: int, tile: dict, sms: int) -> tuple[int, int, int]:
    """(EDGE_N, edge_first, programs) of a deferred launch. EDGE_N > 0 (an edge_tiles tile) where N's partial
    last column fits, as BLOCK_M x EDGE_N tiles, into the round of whole tiles that programs edge_first on
    skip: the grid then takes the whole tiles' rounds, not one more for the edge."""
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    rows = cdiv(M, bm)
    edge = N % bn
    slots = sms * (tile["split_fill"] or SPLIT_FILL)
    if tile["edge_tiles"] and edge and N > edge:
        edge_n = max(16, host.next_power_of_two(edge))  # 16: a TMA row of bf16 is at least 32 bytes
        # Edge tiles per spare round, by width. On the H100 a half-width one takes about 0.9 of a whole tile's
        # time (from the kernel's total: 3 whole + 2 edge tiles ran 134 us where 5 rounds ran 139-141), so those
        # programs end late, but before an added round would.
        per_program = bn // edge_n
        whole = rows * (N // bn)
        programs = min(slots, whole + cdiv(rows, per_program))
        first = whole % programs
        if first and rows <= per_program * (programs - first):
            return edge_n, first, programs
    return 0, 0, programs_for(sms, rows * cdiv(N, bn), tile)


def launch(generated, a, a_s, b, b_s, c, tile):
    """a [M, K] fp8, a_s [M, K // ACT_GROUP], b [N, K] fp8, b_s [cdiv(N, W_BLOCK_N), K // W_BLOCK_K], c [M, N], on
    the GPU; TMA needs 16-byte aligned bases and row strides, and the caller guarantees unit inner strides."""
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    edge_n, edge_first, programs = edge_tiles(M, N, tile, host.sm_count(a.device))
    b_desc, c_desc = gluon_descriptor(b, (bn, bk)), gluon_descriptor(c, (bm, bn))
    # Without an edge the kernel never reads the edge descriptors; the whole tile's stand in for them.
    edge_b_desc, edge_c_desc = ((gluon_descriptor(b, (edge_n, bk)), gluon_descriptor(c, (bm, edge_n))) if edge_n
                                else (b_desc, c_desc))
    return Launch(generated.kernel, (programs, 1, 1), (
        gluon_descriptor(a, (bm, bk)), b_desc, c_desc, edge_b_desc, edge_c_desc, a_s, b_s,
        M, N, K, a_s.stride(0), b_s.stride(0), programs, edge_first,
    ), dict(GROUP_M=tile["GROUP_M"], NUM_STAGES=tile["num_stages"], EDGE_N=edge_n, num_warps=tile["num_warps"]))


IMPL = KernelImpl(
    "block_fp8", "fp8_gemm", "deferred_gluon", "block_fp8/fp8_gemm_deferred_gluon.py.j2", 90, 90,
    "Gluon, TMA ring: block k's wgmma overlaps block k-1's rescale; one warpgroup per 64 rows; GPU only",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "group_m", "num_stages", "n_min"}), options=Options,
    shared_bytes=shared_bytes, problems=problems, min_block_m=64, launch=launch,
    refusal=refusal, tune_grid={"prefill": {"persistent": (False, True), "edge_tiles": (False, True)}})
