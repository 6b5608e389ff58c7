"""The tensor API. Every op checks its arguments, then launches the kernel the registry picks."""
from kdsl.ops.block_fp8 import act_quant, fp8_gemm, weight_dequant, weight_quant
from kdsl.ops.gptq import gptq_dequant, gptq_gemm, gptq_quantize
from kdsl.ops.gptq_prepare import GPTQPrepared, gptq_prepare

__all__ = ["act_quant", "weight_quant", "weight_dequant", "fp8_gemm", "gptq_quantize", "gptq_dequant", "gptq_gemm", "gptq_prepare", "GPTQPrepared"]
