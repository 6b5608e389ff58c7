"""GPTQ kernels on checkpoint tensors: the split-K GEMM and the dequantizer."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl


def w4a16_operand_bytes(scheme, tile, options) -> int:
    if tile.block_m == 1:
        return 0  # the GEMV keeps its weights in registers and stages nothing through shared memory
    # fp16 activations (2 bytes) and packed int4 weights (half a byte) per stage.
    return tile.num_stages * (tile.block_m * tile.block_k * 2 + tile.block_k * tile.block_n // 2)


GEMM_SPLITK = KernelImpl(
    "gptq", "gptq_gemm", "splitk", "gptq/gptq_gemm.py.j2", 80, None,
    "W4A16: unpack int4 in registers, fp16/bf16 tensor-core dot, optional split-K with atomics",
    tile_knobs=GEMM_KNOBS | {"split_k"}, shared_bytes=w4a16_operand_bytes, min_block_m=16)
DEQUANT_BLOCKWISE = KernelImpl(
    "gptq", "gptq_dequant", "blockwise", "gptq/gptq_dequant.py.j2", 80, None,
    "unpack int4 checkpoint tensors to [N, K]", tile_knobs=frozenset({"block_n", "block_k"}))
