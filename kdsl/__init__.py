"""kdsl: declare quantization schemes and tilings, generate Triton kernels, dispatch them.

    import kdsl
    scheme = kdsl.scheme_from_hf(config["quantization_config"])
    q, s = kdsl.ops.act_quant(x)
    y = kdsl.ops.fp8_gemm(q, s, w, w_scale_inv)
"""
import os

# Triton 3.9 warns on every compile unless this is set; fusing multiply-adds is its default anyway.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# kdsl.aot adds itself to the runtime when imported, so KDSL_AOT=DIR serves any use of kdsl without the runtime
# importing it.
from kdsl import aot, nn, ops, registry  # noqa: E402
from kdsl.checkpoint import from_pretrained, load_quantized  # noqa: E402
from kdsl.nn import quantize_  # noqa: E402
from kdsl.runtime.registry import NoKernelError  # noqa: E402
from kdsl.runtime.registry import SchemeNotServedError, require_served_scheme, served_schemes  # noqa: E402,F401
from kdsl.schema import GPTQ, BlockFP8  # noqa: E402
from kdsl.schema.scheme import AWQ  # noqa: E402
from kdsl.schema import scheme_from_hf as _scheme_from_config  # noqa: E402


def scheme_from_hf(config: dict) -> BlockFP8 | GPTQ | AWQ:
    """Map a Hugging Face ``quantization_config`` dict to a kdsl scheme that generated kernels serve.

    Keys that do not affect kernels are ignored. What kdsl cannot express raises ValueError naming the
    key; a valid scheme that no generated kernel serves (weight_block_size [64, 64], say) raises
    SchemeNotServedError (a ValueError) naming it and the schemes that are served.
    """
    scheme = _scheme_from_config(config)
    require_served_scheme(scheme)
    return scheme


__all__ = ["BlockFP8", "GPTQ", "AWQ", "scheme_from_hf", "NoKernelError", "SchemeNotServedError", "ops", "registry", "nn",
           "quantize_", "load_quantized", "from_pretrained"]
__version__ = "0.1.0"
