"""w4a16_gemm/mma: W4A16 GEMM on prepared weights in checkpoint word order (any zeros layout).

tl.dot on tiles dequantized in registers (magic-number dequant, LOP3 in PTX from 64-row tiles up), one
load per 8 weights, split-K reduced in-kernel. Serves every arch from sm_80 and the interpreter.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import SplitOptions, needs_layout


def problems(where: str, scheme, variant, tile, options: SplitOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "checkpoint")


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "mma", "w4a16/mma.py.j2", 80, None,
    "W4A16 MMA on checkpoint-order words: tl.dot on tiles dequantized in registers, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16)
