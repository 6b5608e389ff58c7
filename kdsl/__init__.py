"""kdsl: declare quantization schemes and tilings, generate Triton kernels, dispatch them.

    import kdsl
    scheme = kdsl.scheme_from_hf(config["quantization_config"])
    q, s = kdsl.ops.act_quant(x)
    y = kdsl.ops.fp8_gemm(q, s, w, w_scale_inv)
"""
import os

# Triton 3.9 warns on every compile unless this is set; fusing multiply-adds is its default anyway.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from kdsl import ops, registry  # noqa: E402
from kdsl.runtime.registry import NoKernelError  # noqa: E402
from kdsl.schema import GPTQ, BlockFP8, scheme_from_hf  # noqa: E402

__all__ = ["BlockFP8", "GPTQ", "scheme_from_hf", "NoKernelError", "ops", "registry"]
__version__ = "0.1.0"
