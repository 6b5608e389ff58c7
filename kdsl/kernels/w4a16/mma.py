"""w4a16_gemm/mma: W4A16 GEMM on prepared weights in checkpoint word order (any zeros layout).

tl.dot on tiles dequantized in registers (magic-number dequant, LOP3 in PTX from 64-row tiles up), one
load per 8 weights, split-K reduced in-kernel. Serves every arch from sm_80 and the interpreter.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.described import described
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import C_HEAD, C_TAIL, C_UNIFORM, SplitOptions, mma_c_launch, needs_layout


def problems(where: str, scheme, variant, tile, options: SplitOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "checkpoint")


# Layout weights = checkpoint (sm_80+): qweight [K / 8, N].
C_LAUNCH = mma_c_launch(
    C_HEAD + (("stride_qwk", "ldqw"),) + C_TAIL,
    (("UNIFORM_GROUP", C_UNIFORM, (False, True)),
     # One scale per packed word, from 64-row tiles up; below that its join/permute costs more than it saves
     # (H200 sweep). Inline PTX: not under the interpreter.
     ("ASM_DEQUANT", f"{C_UNIFORM} * ({{BLOCK_M}} >= 64)", (False, True))), {}, {"ASM_DEQUANT": False})


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "mma", "w4a16/mma.py.j2", 80, None,
    "W4A16 MMA on checkpoint-order words: tl.dot on tiles dequantized in registers, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, launch=described(C_LAUNCH))
