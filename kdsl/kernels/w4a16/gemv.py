"""w4a16_gemm/gemv: W4A16 GEMV on CUDA cores (block_m = 1), any prepared layout.

One row of x per program row; the weights stay in the registers they were loaded into, the scale is applied
once per K block, and the next block's words are fetched while this one is computed. fp16 on the GPU with
checkpoint-order words: each word's 8 products in packed half2 math on x scaled by a power of two.
"""
from pydantic import Field, PositiveInt

from kdsl.kernels.base import KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_MIN_STEPS_HELP
from kdsl.kernels.w4a16.common import weights_layout
from kdsl.packing import PLANE_TILE_K, PLANE_TILE_N
from kdsl.schema._base import StrictModel


class Options(StrictModel):
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = []
    if tile.block_m != 1:
        found.append(f"{where}.block_m: {tile.block_m}; a GEMV tile takes block_m = 1")
    if weights_layout(variant) == "k_planes":
        if tile.block_k != PLANE_TILE_K:
            found.append(f"{where}.block_k: {tile.block_k}; the k_planes GEMV steps one plane tile "
                         f"(block_k = {PLANE_TILE_K}) at a time")
        if PLANE_TILE_N % tile.block_n:
            found.append(f"{where}.block_n: {tile.block_n} does not divide the k_planes layout's "
                         f"{PLANE_TILE_N} columns per tile")
    return found


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "gemv", "w4a16/gemv.py.j2", 80, None,
    "W4A16 GEMV on CUDA cores, one row per program row, weights kept in registers, split-K in-kernel",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "split_k", "n_min"}), options=Options,
    problems=problems, reads_prepared_weights=True, gemv_block_m=True)
