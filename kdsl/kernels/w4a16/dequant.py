"""w4a16_dequant/blockwise: prepared int4 weights -> w [N, K] in the activation dtype, any prepared layout.

One program per [block_n, block_k] tile of w: it loads the tile's packed words (checkpoint-order words or one
k_planes tile), unpacks them with the magic-number dequant every W4A16 kernel shares (prepared.py.j2), and stores
the tile K-contiguous, in the prepared (group-sorted) K order. w4a16_gemm runs it, then torch.matmul(x, w.T) on
cuBLAS, from its variant's `dequant_min_m` rows up: at prefill the GEMM is compute-bound and cuBLAS's fp16 GEMM
beats the W4A16 kernels, while the dequant costs K * N / 2 bytes read and K * N * 2 written.
"""
from kdsl.kernels.base import KernelImpl
from kdsl.kernels.w4a16.common import plane_tile_problems, weights_layout


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    if weights_layout(variant) == "k_planes":
        return plane_tile_problems(where, tile)  # one plane tile of K per program, whole plane tiles of N
    return []


IMPL = KernelImpl(
    "w4a16", "w4a16_dequant", "blockwise", "w4a16/dequant.py.j2", 80, None,
    "prepared int4 weights to w [N, K] (prepared K order) for torch.matmul, one tile per program",
    tile_knobs=frozenset({"block_n", "block_k"}), problems=problems, reads_prepared_weights=True,
    dequant_for="w4a16_gemm")
