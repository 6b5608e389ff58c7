"""w4a16_gemm/splitk: W4A16 on prepared weights (kdsl.ops.w4a16 writes the variant's layout).

One load per 8 weights, magic-number dequant, split-K reduced in-kernel. block_m = 1 tiles are a
GEMV: the Gluon mma.sync one (mma_gemv, k_planes layout) where it applies, else a Triton one;
overlap_dequant tiles (Hopper, k_planes) overlap dequant and wgmma in Gluon. The generated module's
`tile_refusal` passes a tile over at run time when its algorithm cannot serve the call well.
"""
from pydantic import Field, PositiveInt

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, warpgroup_per_64
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP, SPLIT_MIN_STEPS_HELP
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.packing import PLANE_TILE_K, PLANE_TILE_N
from kdsl.schema._base import StrictModel

# The mma.sync GEMV takes x as one m16n8k16's 8-wide operand: it serves M up to this.
MMA_GEMV_MAX_M = 8


class Options(StrictModel):
    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)
    overlap_dequant: bool = Field(False, description="Gluon kernel (Hopper, k_planes weights): block k+1 is "
                                                     "dequantized while block k's wgmma runs; one warpgroup per 64 columns")
    mma_gemv: bool = Field(False, description="Gluon GEMV (k_planes weights, M up to 8): mma.sync on 16 columns per "
                                              "program, whose warps split K in chunks of block_k rows and sum in "
                                              "shared memory")


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = []
    k_planes = getattr(variant.layout, "weights", None) == "k_planes"
    paired = k_planes and getattr(variant.layout, "zeros", None) == "paired"
    if k_planes:
        if tile.block_m == 1:
            if tile.block_k % PLANE_TILE_K:
                found.append(f"{where}.block_k: {tile.block_k} is not a multiple of {PLANE_TILE_K}; the "
                             "k_planes GEMV (block_m = 1) steps over whole plane tiles")
        elif tile.block_k != PLANE_TILE_K:
            found.append(f"{where}.block_k: {tile.block_k}; the k_planes layout's tiles take block_k = {PLANE_TILE_K}")
        if PLANE_TILE_N % tile.block_n:
            found.append(f"{where}.block_n: {tile.block_n} does not divide the k_planes layout's "
                         f"{PLANE_TILE_N} columns per tile")
    if options.overlap_dequant:
        at = f"{where}.options.overlap_dequant"
        if variant.min_cc != 90 or variant.max_cc != 90:
            found.append(f"{at}: the Gluon kernel uses wgmma; the variant must cover sm_90 only "
                         f"(min_arch = max_arch = \"sm_90\", got {variant.min_arch} .. {variant.max_arch or 'any'})")
        if not paired:
            found.append(f"{at}: needs the variant's layout = {{ weights = \"k_planes\", zeros = \"paired\" }}")
        found += warpgroup_per_64(at, "columns", "block_n", tile.block_n, tile.num_warps)
        if not 16 <= tile.block_m <= 256:
            found.append(f"{at}: block_m = {tile.block_m} is not one wgmma's width (16 to 256); "
                         "the GEMV (block_m = 1) has no wgmma to overlap")
    if options.mma_gemv:
        found += _mma_gemv_problems(f"{where}.options.mma_gemv", variant, tile, options, paired)
    return found


def _mma_gemv_problems(at: str, variant, tile, options: Options, paired: bool) -> list[str]:
    """k_planes words with paired scales and zeros, 16 columns per program (one MMA's rows), x as the MMA's
    8-wide operand, whole plane tiles per chunk."""
    found = []
    if not paired:
        found.append(f"{at}: needs the variant's layout = {{ weights = \"k_planes\", zeros = \"paired\" }}")
    if tile.block_m != 1:
        found.append(f"{at}: is a GEMV tile; needs block_m = 1 (got {tile.block_m})")
    if tile.m_max is None or tile.m_max > MMA_GEMV_MAX_M:
        found.append(f"{at}: x is the MMA's 8-wide operand, so the tile serves M up to {MMA_GEMV_MAX_M}; "
                     f"set m_max <= {MMA_GEMV_MAX_M} (got {tile.m_max if tile.m_max is not None else 'none'})")
    if tile.block_n != 16:
        found.append(f"{at}: a program takes one MMA's 16 columns; needs block_n = 16 (got {tile.block_n})")
    for knob, value in (("split_k", tile.split_k > 1), ("split_min_steps", options.split_min_steps is not None),
                        ("split_fill", options.split_fill is not None)):
        if value:
            found.append(f"{at}: the program's warps split K among themselves; drop {knob}")
    return found


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "splitk", "w4a16/splitk.py.j2", 80, None,
    "W4A16 on prepared weights: one load per 8 weights, magic-number dequant, split-K reduced in-kernel; "
    "block_m = 1 is a CUDA-core GEMV, or an mma.sync one in Gluon (mma_gemv, k_planes); overlap_dequant tiles "
    "(Hopper, k_planes) overlap dequant and wgmma in Gluon",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=Options, shared_bytes=w4a16_operand_bytes, problems=problems,
    reads_prepared_weights=True, min_block_m=16, gemv_block_m=True, refusal="tile_refusal")
