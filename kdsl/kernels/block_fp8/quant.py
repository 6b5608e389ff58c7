"""The block-FP8 quantize and dequantize kernels: memory-bound, one program per row group or weight block."""
from kdsl.kernels.base import KernelImpl

ACT_QUANT_ROWWISE = KernelImpl(
    "block_fp8", "act_quant", "rowwise", "block_fp8/act_quant.py.j2", 89, None,
    "per-token, per-group amax scaling to e4m3", tile_knobs=frozenset({"block_m"}))
WEIGHT_QUANT_BLOCKWISE = KernelImpl(
    "block_fp8", "weight_quant", "blockwise", "block_fp8/weight_quant.py.j2", 89, None,
    "one program per weight block, amax scaling to e4m3", tile_knobs=frozenset())
WEIGHT_DEQUANT_BLOCKWISE = KernelImpl(
    "block_fp8", "weight_dequant", "blockwise", "block_fp8/weight_dequant.py.j2", 89, None,
    "one program per weight block, fp8 x scale", tile_knobs=frozenset())
