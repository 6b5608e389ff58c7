"""w4a16_gemm/gemv: W4A16 GEMV on CUDA cores (block_m = 1), any prepared layout.

One row of x per program row; the weights stay in the registers they were loaded into, the scale is applied
once per K block, and the next block's words are fetched while this one is computed. fp16 on the GPU with
checkpoint-order words: each word's 8 products in packed half2 math on x scaled by a power of two.
"""
from pydantic import Field, PositiveInt

from kdsl.kernels.base import KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_MIN_STEPS_HELP
from kdsl.kernels.described import described
from kdsl.kernels.w4a16.common import C_HEAD, C_PLANE_UNIFORM, C_TAIL, C_UNIFORM, gemv_c_launch, weights_layout
from kdsl.packing import PLANE_TILE_K, PLANE_TILE_N
from kdsl.strict_model import StrictModel


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


# The tile's split is kept (no SM count): GEMV programs are light (H200 tune).
C_LAUNCH = gemv_c_launch(
    C_HEAD + (("stride_qwk", "ldqw"),) + C_TAIL,
    (("UNIFORM_GROUP", C_UNIFORM, (False, True)),
     ("WORD_GROUPS", "contiguous_groups * ({group_rows} % 8 == 0)", (False, True)),
     ("HALF2_DOT", f"(x_dtype == KDSL_F16) * nonzero({C_UNIFORM} + contiguous_groups * "
                   f"({{group_rows}} % 8 == 0))", (False, True))), {})
K_PLANES_C_LAUNCH = gemv_c_launch(
    # qweight.stride(0) of the 4-D tensor: ceil(K / 128) tiles of 128 x 16 words. A k_planes word spans its whole
    # plane tile, so only a uniform group gives it one scale; the packed half2 dot reads checkpoint-order words.
    C_HEAD + (("stride_qwk", "cdiv(K, 128) * 2048"),) + C_TAIL,
    (("UNIFORM_GROUP", C_PLANE_UNIFORM, (False, True)),), {"WORD_GROUPS": False, "HALF2_DOT": False})


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "gemv", "w4a16/gemv.py.j2", 80, None,
    "W4A16 GEMV on CUDA cores, one row per program row, weights kept in registers, split-K in-kernel",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "split_k", "n_min"}), options=Options,
    problems=problems, reads_prepared_weights=True, gemv_block_m=True,
    launch=described(C_LAUNCH, k_planes=K_PLANES_C_LAUNCH))
