"""w4a16_gemm/planes_mma: W4A16 GEMM on k_planes weights as y^T = w^T x^T.

The dequantized weights are the MMA's register operand (Hopper's wgmma reads it from registers), so a
weight tile never makes a shared-memory round trip; LOP3 turns each nibble pair into the operand's half2.
Decode tiles (block_m <= 16) apply the scale to each K tile's fp32 partial instead of each weight.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import SplitOptions, needs_layout, plane_tile_problems


def problems(where: str, scheme, variant, tile, options: SplitOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "k_planes") + plane_tile_problems(where, tile)


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "planes_mma", "w4a16/planes_mma.py.j2", 80, None,
    "W4A16 MMA on k_planes words, y^T = w^T x^T with the weights as the register operand, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16)
