"""w4a16_gemm/mma: W4A16 GEMM on prepared weights in checkpoint word order (any zeros layout).

tl.dot on tiles dequantized in registers (magic-number dequant, LOP3 in PTX from 64-row tiles up), one
load per 8 weights, split-K reduced in-kernel. Serves every arch from sm_80 and the interpreter.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import (C_HEAD, C_TAIL, C_UNIFORM, MAGIC, SplitOptions, mma_c_launch, mma_split,
                                     needs_layout)


def problems(where: str, scheme, variant, tile, options: SplitOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "checkpoint")


def launch(generated, x, perm, qweight, zeros, scales, groups, contiguous_groups, y, tile):
    """x [M, K]; perm int32 [K] or None; qweight, zeros and scales as LAYOUT says, in prepared K order;
    groups int32 [K], the group of each prepared row; contiguous_groups: row k is in group k // GROUP_SIZE.
    y [M, N] in x's dtype."""
    M, K = x.shape
    N = y.shape[1]
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    kernel = generated.kernel
    tiles, split_k, workspace, counters = mma_split(generated, x, y, tile)
    magic_bits, magic_bias = MAGIC[x.dtype]
    group_size = generated.constexprs["GROUP_SIZE"]
    uniform = contiguous_groups and group_size % bk == 0  # every K tile inside one group
    # One scale per packed word, from 64-row tiles up; below that its join/permute costs more than it
    # saves (H200 sweep).
    asm = x.device.type != "cpu" and uniform and bm >= 64
    return Launch(kernel, (tiles, split_k, 1), (
        x, qweight if perm is None else perm, qweight, zeros, scales, groups,
        y, workspace, counters,
        M, N, K, x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0), y.stride(0),
    ), dict(
        HAS_PERM=perm is not None, UNIFORM_GROUP=uniform, GROUP_SIZE=group_size,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tile["GROUP_M"], SPLIT_K=split_k,
        MAGIC_BITS=magic_bits, MAGIC_BIAS=magic_bias, FP32_MATH=x.device.type == "cpu", ASM_DEQUANT=asm,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    ))

# Layout weights = checkpoint (sm_80+): qweight [K / 8, N].
C_LAUNCH = mma_c_launch(
    C_HEAD + (("stride_qwk", "ldqw"),) + C_TAIL,
    (("UNIFORM_GROUP", C_UNIFORM, (False, True)),
     ("ASM_DEQUANT", f"{C_UNIFORM} * ({{BLOCK_M}} >= 64)", (False, True))), {})


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "mma", "w4a16/mma.py.j2", 80, None,
    "W4A16 MMA on checkpoint-order words: tl.dot on tiles dequantized in registers, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, launch=launch, c_launches={"": C_LAUNCH})
