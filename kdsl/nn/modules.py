"""Quantized drop-ins for nn.Linear: y = x W^T + bias, with W held the way kdsl's kernels read it.

FP8Linear keeps DeepSeek-V3 block-FP8 weights (weight float8_e4m3fn [N, K] and weight_scale_inv float32
per block) and quantizes activations per token on every call. W4A16Linear keeps int4 weights prepared for
the w4a16 kernels (kdsl.ops.gptq_prepare / awq_prepare), which depend on the device's arch: build or load
the module on the device it will run on.
"""
from __future__ import annotations

import torch
from torch import nn

from kdsl import ops, registry
from kdsl.ops.w4a16 import PREPARED_OP, W4A16Prepared
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
# FP8Linear runs the fused fp8_linear (one launch) for up to this many rows outside torch.compile, where the
# host's cost per launch sets the pace of eager decode; otherwise act_quant + fp8_gemm, whose kernels take less
# GPU time (on an H100 the fused kernel took 0.87-1.34x their GPU time at M = 1, 1.19-1.79x at M = 16, 2.4-4.6x
# at M = 64: benchmarks/RESULTS.md, fp8_linear section). Under torch.compile (its CUDA graphs included) the host
# cost is gone and GPU time decides, so compiled code takes the two kernels: its outputs may differ from eager
# ones by a rounding (the fused kernel adds the bias in fp32, and the GEMM tiles differ). A CUDA graph captured
# by hand records what eager calls launch (the fused kernel at few rows), so the eager warm-up compiles it.
FUSED_MAX_ROWS = 16


def _kernel_name(op: str, scheme: str, device: torch.device) -> str:
    """The kernel the registry picks for op on device, or why there is none (for repr)."""
    try:
        return registry.dispatch(op, scheme, device).name
    except (LookupError, RuntimeError) as error:
        return f"none ({str(error).splitlines()[0]})"


class _QuantizedLinear(nn.Module):
    """Keeps its quantized weights' dtypes through .to(dtype) / .half() / .bfloat16(): those move them to
    another device at most (a cast would silently change what the kernels read); the bias follows the cast."""

    def _apply(self, fn, recurse=True):
        before = {name: t for name, t in self._buffers.items() if t is not None and name != "bias"}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self


class FP8Linear(_QuantizedLinear):
    """Block-FP8 linear layer: per-token activation quantization (act_quant), then fp8_gemm; eager calls of few
    rows run the two in one launch (kdsl.ops.fp8_linear, bias added in its fp32 accumulator; FUSED_MAX_ROWS)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 scheme: BlockFP8 | None = None):
        super().__init__()
        self.scheme = scheme or BlockFP8()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise TypeError(f"weight: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        block_n, block_k = self.scheme.weight_block
        blocks = (-(-n // block_n), -(-k // block_k))
        if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != blocks:
            raise ValueError(f"weight_scale_inv: expected float32 {blocks} (one scale per {block_n}x{block_k} block "
                             f"of weight {tuple(weight.shape)}), got {weight_scale_inv.dtype} "
                             f"{tuple(weight_scale_inv.shape)}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: BlockFP8 | None = None) -> "FP8Linear":
        """Quantize a float nn.Linear's weight in the scheme's blocks (kdsl.ops.weight_quant)."""
        scheme = scheme or BlockFP8()
        q, s = ops.weight_quant(linear.weight.detach(), block_size=scheme.weight_block)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, s, bias, scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype if x.dtype in FLOAT_OUT else torch.bfloat16
        if x.dim() > 0 and x.numel() <= FUSED_MAX_ROWS * x.shape[-1] and not torch.compiler.is_compiling():
            return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, out_dtype=out_dtype)
        a, a_s = ops.act_quant(x, group_size=self.scheme.act_group)
        y = ops.fp8_gemm(a, a_s, self.weight, self.weight_scale_inv, out_dtype=out_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        kernel = _kernel_name("fp8_gemm", self.scheme.name, self.weight.device)
        fused = _kernel_name("fp8_linear", self.scheme.name, self.weight.device)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.name}, kernel={kernel}, fused={fused} (uncompiled, M <= {FUSED_MAX_ROWS})")


class W4A16Linear(_QuantizedLinear):
    """Int4-weight linear layer on prepared weights (GPTQ v1/v2 with or without act-order, AWQ): w4a16_gemm.
    Activations must come in the dtype the weights were prepared with (the scales' dtype)."""

    def __init__(self, prepared: W4A16Prepared, bias: torch.Tensor | None = None,
                 scheme: GPTQ | AWQ | None = None):
        super().__init__()
        if not isinstance(prepared, W4A16Prepared):
            raise TypeError(f"prepared: expected kdsl.ops.gptq_prepare/awq_prepare output, got {type(prepared).__name__}")
        if bias is not None and tuple(bias.shape) != (prepared.n,):
            raise ValueError(f"bias: expected shape ({prepared.n},), got {tuple(bias.shape)}")
        self.scheme = scheme
        self.in_features, self.out_features = prepared.k, prepared.n
        self._fields = {name: getattr(prepared, name) for name in (
            "scheme", "source", "bits", "group_size", "layout", "dtype", "k", "n", "contiguous_groups", "zero_bias")}
        for name in ("qweight", "zeros", "scales", "groups", "perm"):
            self.register_buffer(name, getattr(prepared, name))
        self.register_buffer("bias", bias)

    @property
    def prepared(self) -> W4A16Prepared:
        """The weights as kdsl.ops.w4a16_gemm takes them (the module's buffers, wherever .to() moved them)."""
        return W4A16Prepared(qweight=self.qweight, zeros=self.zeros, scales=self.scales, groups=self.groups,
                             perm=self.perm, **self._fields)

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: GPTQ | AWQ | None = None) -> "W4A16Linear":
        """Round-to-nearest int4 quantization of a float nn.Linear (kdsl.ops.gptq_quantize: GPTQ's storage
        format, not its error-compensating algorithm), prepared for the weight's device. AWQ schemes get the
        same round-to-nearest weights: prepared, the two are one layout."""
        scheme = scheme or GPTQ()
        weight = linear.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
        sym = getattr(scheme, "sym", False)
        ck = ops.gptq_quantize(weight.to(dtype), bits=scheme.bits, group_size=scheme.group_size, sym=sym)
        prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=scheme.bits,
                                    group_size=scheme.group_size, checkpoint_format="gptq")
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(prepared, bias, scheme)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, scheme: GPTQ | None = None) -> "W4A16Linear":
        """From a GPTQ checkpoint's tensors (layout: kdsl.ops.gptq_checkpoint), prepared on their device."""
        scheme = scheme or GPTQ()
        prepared = ops.gptq_prepare(qweight, qzeros, scales, g_idx, bits=scheme.bits, group_size=scheme.group_size,
                                    checkpoint_format=scheme.checkpoint_format)
        return cls(prepared, None if bias is None else bias.to(scales.dtype), scheme)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, scheme: AWQ | None = None) -> "W4A16Linear":
        """From an AutoAWQ "gemm" checkpoint's tensors, prepared on their device."""
        scheme = scheme or AWQ()
        prepared = ops.awq_prepare(qweight, qzeros, scales, group_size=scheme.group_size)
        return cls(prepared, None if bias is None else bias.to(scales.dtype), scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.w4a16_gemm(x, self.prepared)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        scheme = self.scheme.name if self.scheme is not None else self._fields["source"]
        kernel = _kernel_name(PREPARED_OP, self._fields["scheme"], self.qweight.device)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={scheme}, weights={self._fields['scheme']} {self._fields['layout']}, kernel={kernel}")
