"""The tensor API. Every op checks its arguments, then launches the kernel the registry picks.

Each is also a PyTorch custom op, torch.ops.kdsl.<name>, which torch.compile traces as one node; the functions
here switch to it while compiling and skip the dispatcher otherwise. An op's custom-op spec (kdsl.ops.spec.OpSpec:
schema, implementation, fake kernel) sits beside its public function in its family module, in SPECS;
kdsl.ops.library registers every declared spec."""
from kdsl.ops.activation import silu_mul, silu_mul_quant
from kdsl.ops.awq import awq_dequant, awq_gemm, awq_prepare
from kdsl.ops.block_fp8 import act_quant, fp8_bmm, fp8_gemm, fp8_linear, weight_dequant, weight_quant
from kdsl.ops.gptq import gptq_dequant, gptq_gemm, gptq_prepare, gptq_quantize
from kdsl.ops.norm import add_rms_norm, add_rms_norm_quant, rms_norm, rms_norm_quant
from kdsl.ops.moe import fp8_grouped_gemm, fp8_grouped_gemm_masked, moe_fp8
from kdsl.ops.w4a16_moe import W4A16ExpertsPrepared, awq_moe_prepare, gptq_moe_prepare, moe_w4a16
from kdsl.ops.w4a16 import GPTQPrepared, W4A16Prepared, w4a16_dequant, w4a16_gemm
from kdsl.ops import library  # noqa: F401  registers torch.ops.kdsl.* (torch.compile goes through them)

__all__ = [
    "act_quant", "weight_quant", "weight_dequant", "fp8_gemm", "fp8_bmm", "fp8_linear",
    "gptq_quantize", "gptq_dequant", "gptq_gemm", "gptq_prepare",
    "awq_gemm", "awq_dequant", "awq_prepare",
    "w4a16_gemm", "w4a16_dequant", "W4A16Prepared", "GPTQPrepared",
    "fp8_grouped_gemm", "fp8_grouped_gemm_masked", "moe_fp8",
    "gptq_moe_prepare", "awq_moe_prepare", "moe_w4a16", "W4A16ExpertsPrepared",
    "silu_mul", "silu_mul_quant", "rms_norm", "rms_norm_quant", "add_rms_norm", "add_rms_norm_quant",
]
