"""w4a16_dequant/blockwise: prepared int4 weights -> w [N, K] in the activation dtype, any prepared layout.

One program per [block_n, block_k] tile of w: it loads the tile's packed words (checkpoint-order words or one
k_planes tile), unpacks them with the magic-number dequant every W4A16 kernel shares (prepared.py.j2), and stores
the tile K-contiguous, in the prepared (group-sorted) K order. w4a16_gemm runs it, then torch.matmul(x, w.T) on
cuBLAS, from its variant's `dequant_min_m` rows up: at prefill the GEMM is compute-bound and cuBLAS's fp16 GEMM
beats the W4A16 kernels, while the dequant costs K * N / 2 bytes read and K * N * 2 written.
"""
from kdsl.kernels.base import KernelImpl, Launch
from kdsl.kernels.host import cdiv
from kdsl.kernels.w4a16.common import MAGIC, plane_tile_problems, weights_layout


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    if weights_layout(variant) == "k_planes":
        return plane_tile_problems(where, tile)  # one plane tile of K per program, whole plane tiles of N
    return []


def launch(generated, qweight, zeros, scales, groups, contiguous_groups, perm, w, tile):
    """qweight, zeros and scales as LAYOUT says, in prepared K order; groups int32 [K], the group of each
    prepared row; contiguous_groups: row k is in group k // GROUP_SIZE. perm None: w [N, K] (unit stride along
    K) in scales' dtype, written whole; perm int32 [K] (act-order): w [K, N] (unit stride along N), prepared
    row k written as row perm[k]."""
    N, K = w.shape if perm is None else w.shape[::-1]
    bn, bk = tile["BLOCK_N"], tile["BLOCK_K"]
    magic_bits, magic_bias = MAGIC[w.dtype]
    group_size = generated.constexprs["GROUP_SIZE"]
    return Launch(generated.kernel, (cdiv(K, bk), cdiv(N, bn), 1), (
        qweight, zeros, scales, groups, w, qweight if perm is None else perm,
        N, K, qweight.stride(0), zeros.stride(0), scales.stride(0), w.stride(0),
    ), dict(
        HAS_PERM=perm is not None, UNIFORM_GROUP=contiguous_groups and group_size % bk == 0, GROUP_SIZE=group_size,
        BLOCK_N=bn, BLOCK_K=bk,
        MAGIC_BITS=magic_bits, MAGIC_BIAS=magic_bias, FP32_MATH=w.device.type == "cpu",
        num_warps=tile["num_warps"],
    ))

IMPL = KernelImpl(
    "w4a16", "w4a16_dequant", "blockwise", "w4a16/dequant.py.j2", 80, None,
    "prepared int4 weights to w [N, K] (prepared K order; act-order's w [K, N] in checkpoint order) for "
    "torch.matmul, one tile per program",
    tile_knobs=frozenset({"block_n", "block_k"}), problems=problems, reads_prepared_weights=True,
    dequant_for="w4a16_gemm", launch=launch)
