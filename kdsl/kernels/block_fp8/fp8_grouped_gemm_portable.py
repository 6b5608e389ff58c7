"""fp8_grouped_gemm/portable and fp8_grouped_gemm_masked/portable: block-FP8 GEMMs over the experts of a MoE layer
with pointer loads (sm_89+), fp8_gemm/portable's tile and options.

grouped (contiguous layout): rows of A grouped by expert, an expert id per row (-1: padding); a tile whose rows
belong to one expert makes one pass over K, one holding several experts one pass per expert.
masked: A [E, max_m, K] with a per-expert row count read on the device; the grid covers max_m rows per expert."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options, operand_ring_bytes

IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm", "portable", "block_fp8/fp8_grouped_gemm_portable.py.j2", 89, None,
    "contiguous layout (an expert id per row), pointer loads, one pass over K per expert in a tile",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16)

MASKED_IMPL = KernelImpl(
    "block_fp8", "fp8_grouped_gemm_masked", "portable", "block_fp8/fp8_grouped_gemm_masked_portable.py.j2", 89,
    None, "masked layout (rows per expert read on the device), pointer loads",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16)
