"""w4a16_gemm/overlap_gluon: W4A16 GEMM for Hopper in Gluon, dequant of K block k+1 overlapping block k's wgmma.

TMA brings each block's k_planes words, x and (scale, zero) pairs into an mbarrier ring of num_stages
slots; one warpgroup per 64 columns. Refuses, at run time, the CPU, act-order (x gathered), groups that
change inside a K block and rows TMA cannot read: the definition's next tile (the Triton MMA with the same
block sizes) serves those calls.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, warpgroup_per_64
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import SplitOptions, needs_layout, plane_tile_problems


def problems(where: str, scheme, variant, tile, options: SplitOptions) -> list[str]:
    found = needs_layout(f"{where}.impl", variant, "k_planes", "paired") + plane_tile_problems(where, tile)
    found += warpgroup_per_64(f"{where}.impl", "columns", "block_n", tile.block_n, tile.num_warps)
    if not 16 <= tile.block_m <= 256:
        found.append(f"{where}.block_m: {tile.block_m} is not one wgmma's width (16 to 256)")
    return found


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "overlap_gluon", "w4a16/overlap_gluon.py.j2", 90, 90,
    "W4A16 GEMM for Hopper (Gluon): TMA ring, block k+1 dequantized while block k's wgmma runs",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, refusal="refusal")
