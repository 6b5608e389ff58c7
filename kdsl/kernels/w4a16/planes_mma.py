"""w4a16_gemm/planes_mma: W4A16 GEMM on k_planes weights as y^T = w^T x^T.

The dequantized weights are the MMA's register operand (Hopper's wgmma reads it from registers), so a
weight tile never makes a shared-memory round trip; LOP3 turns each nibble pair into the operand's half2.
Decode tiles (block_m <= 16) apply the scale to each K tile's fp32 partial instead of each weight.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import (C_HEAD, C_PLANE_UNIFORM, C_PLANE_WORD_GROUPS, C_TAIL, MAGIC, SplitPdlOptions,
                                     mma_c_launch, mma_split, needs_layout, plane_tile_problems)


def problems(where: str, scheme, variant, tile, options: SplitPdlOptions) -> list[str]:
    return needs_layout(f"{where}.impl", variant, "k_planes") + plane_tile_problems(where, tile)


def launch(generated, x, perm, qweight, zeros, scales, groups, contiguous_groups, y, tile):
    """x [M, K]; perm int32 [K] or None; qweight, zeros and scales as LAYOUT says, in prepared K order;
    groups int32 [K], the group of each prepared row; contiguous_groups: row k is in group k // GROUP_SIZE.
    y [M, N] in x's dtype."""
    M, K = x.shape
    N = y.shape[1]
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    module, kernel = generated.module, generated.kernel
    tiles, split_k, workspace, counters = mma_split(generated, x, y, tile)
    magic_bits, magic_bias = MAGIC[x.dtype]
    group_size = generated.constexprs["GROUP_SIZE"]
    uniform = contiguous_groups and group_size % module.PLANE_TILE_K.value == 0  # every plane tile in one group
    # Contiguous groups of whole nibble-pair spans: one group per plane (a word spans the tile).
    word_groups = contiguous_groups and group_size % module.PAIR_SPAN.value == 0
    asm = x.device.type != "cpu" and uniform
    # Decode tiles: the MMA is small and the unpacking dominates, so the scale moves onto the fp32
    # partial of each K tile (H200, M = 16, vs fp16: 1.08/1.97/2.13/2.27 -> 1.20/2.21/2.52/2.49).
    # From 64 rows up the extra wait on every K tile's MMA costs more (M = 64: 1.20 -> 0.97).
    scale_after = asm and bm <= 16
    return Launch(kernel, (tiles, split_k, 1), (
        x, qweight if perm is None else perm, qweight, zeros, scales, groups,
        y, workspace, counters,
        M, N, K, x.stride(0), zeros.stride(0), scales.stride(0), y.stride(0),
    ), dict(
        HAS_PERM=perm is not None, UNIFORM_GROUP=uniform, WORD_GROUPS=word_groups, GROUP_SIZE=group_size,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tile["GROUP_M"], SPLIT_K=split_k,
        MAGIC_BITS=magic_bits, MAGIC_BIAS=magic_bias, FP32_MATH=x.device.type == "cpu",
        ASM_DEQUANT=asm, SCALE_AFTER=scale_after, PDL=False,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    ))

# Layout weights = k_planes (sm_90): qweight [N tiles, K tiles, 128, 16], contiguous.
C_LAUNCH = mma_c_launch(
    C_HEAD + C_TAIL,
    (("UNIFORM_GROUP", C_PLANE_UNIFORM, (False, True)),
     ("WORD_GROUPS", C_PLANE_WORD_GROUPS, (False, True)),
     ("ASM_DEQUANT", C_PLANE_UNIFORM, (False, True)),
     ("SCALE_AFTER", f"{C_PLANE_UNIFORM} * ({{BLOCK_M}} <= 16)", (False, True))), {"PDL": False})


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "planes_mma", "w4a16/planes_mma.py.j2", 80, None,
    "W4A16 MMA on k_planes words, y^T = w^T x^T with the weights as the register operand, split-K in-kernel",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitPdlOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, launch=launch,
    # Decode programs are short: how many share an SM and how few K steps a split may leave them decide how
    # many weight bytes are in flight.
    tune_grid={"decode": {"split_fill": (1, 2, 3), "split_min_steps": (4, 8, 16)}}, c_launches={"": C_LAUNCH})
