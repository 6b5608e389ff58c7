"""fp8_bmm/portable: the batched block-FP8 GEMM (DeepSeek-V3's MLA) with strided pointer loads (sm_89+).

Grid axis 2 walks the batch; every operand comes with its strides, so a batch of `x.transpose(0, 1)`
views (MLA's per-head activations) runs without a copy. Tiles and options as fp8_gemm/portable."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options, operand_ring_bytes

IMPL = KernelImpl(
    "block_fp8", "fp8_bmm", "portable", "block_fp8/fp8_bmm_portable.py.j2", 89, None,
    "batched, strided pointer loads, fp32 accumulation with per-step scales",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16)
