"""kdsl inside a PyTorch model: quantized nn.Linear drop-ins, quantize_ and RMSNorm (checkpoints: kdsl.checkpoint)."""
from kdsl.nn.convert import QuantizeReport, quantize_
from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.nn.moe import FP8Experts, FP8MoE, W4A16Experts, W4A16MoE
from kdsl.nn.norm import RMSNorm, swap_transformers_norms
from kdsl.nn.schemes import CheckpointError

__all__ = ["FP8Linear", "W4A16Linear", "FP8MoE", "FP8Experts", "W4A16MoE", "W4A16Experts", "quantize_", "QuantizeReport",
           "CheckpointError", "RMSNorm", "swap_transformers_norms"]
