"""kdsl inside a PyTorch model: quantized nn.Linear drop-ins, quantize_ and load_quantized."""
from kdsl.nn.checkpoint import CheckpointError, from_pretrained, load_quantized
from kdsl.nn.convert import QuantizeReport, quantize_
from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.nn.moe import FP8Experts, FP8MoE, W4A16Experts, W4A16MoE

__all__ = ["FP8Linear", "W4A16Linear", "FP8MoE", "FP8Experts", "W4A16MoE", "W4A16Experts", "quantize_", "QuantizeReport", "load_quantized", "from_pretrained", "CheckpointError"]
