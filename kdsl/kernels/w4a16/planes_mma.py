"""w4a16_gemm/planes_mma: W4A16 GEMM on k_planes weights as y^T = w^T x^T.

The dequantized weights are the MMA's register operand (Hopper's wgmma reads it from registers), so a
weight tile never makes a shared-memory round trip; LOP3 turns each nibble pair into the operand's half2.
Decode tiles (block_m <= 16) apply the scale to each K tile's fp32 partial instead of each weight.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.described import described
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import (C_HEAD, C_PLANE_UNIFORM, C_PLANE_WORD_GROUPS, C_TAIL, SplitPdlOptions,
                                     mma_c_launch, needs_layout, plane_tile_problems)


def problems(where: str, scheme, variant, tile, options: SplitPdlOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "k_planes") + plane_tile_problems(where, tile)


# Layout weights = k_planes (sm_90): qweight [N tiles, K tiles, 128, 16], contiguous.
C_LAUNCH = mma_c_launch(
    C_HEAD + C_TAIL,
    (("UNIFORM_GROUP", C_PLANE_UNIFORM, (False, True)),
     ("WORD_GROUPS", C_PLANE_WORD_GROUPS, (False, True)),
     ("ASM_DEQUANT", C_PLANE_UNIFORM, (False, True)),
     # Decode tiles: the MMA is small and the unpacking dominates, so the scale moves onto the fp32 partial of each
     # K tile (H200, M = 16, vs fp16: 1.08/1.97/2.13/2.27 -> 1.20/2.21/2.52/2.49). From 64 rows up the extra wait
     # on every K tile's MMA costs more (M = 64: 1.20 -> 0.97).
     ("SCALE_AFTER", f"{C_PLANE_UNIFORM} * ({{BLOCK_M}} <= 16)", (False, True))), {"PDL": False, "RELEASE": False},
    {"ASM_DEQUANT": False, "SCALE_AFTER": False}, releases=True)


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "planes_mma", "w4a16/planes_mma.py.j2", 80, None,
    "W4A16 MMA on k_planes words, y^T = w^T x^T with the weights as the register operand, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitPdlOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, launch=described(C_LAUNCH),
    # Decode programs are short: how many share an SM and how few K steps a split may leave them decide how
    # many weight bytes are in flight.
    tune_grid={"decode": {"split_fill": (1, 2, 3), "split_min_steps": (4, 8, 16)}})
