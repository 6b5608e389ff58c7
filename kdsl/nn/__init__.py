"""kdsl inside a PyTorch model: quantized nn.Linear drop-ins, quantize_ and load_quantized."""
from kdsl.nn.convert import CheckpointError, load_quantized, quantize_
from kdsl.nn.modules import FP8Linear, W4A16Linear

__all__ = ["FP8Linear", "W4A16Linear", "quantize_", "load_quantized", "CheckpointError"]
