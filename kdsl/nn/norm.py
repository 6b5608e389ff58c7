"""kdsl.nn.RMSNorm: a decoder layer's RMSNorm through kdsl.ops.rms_norm (one kernel; torch.nn.RMSNorm's takes
about three times as long at decode on an H200: kernel_defs/rms_norm.toml), and the transformers norms it stands in
for (kdsl.from_pretrained swaps them)."""
from __future__ import annotations

import torch
from torch import nn

from kdsl import ops
from kdsl.nn.convert import _swap

# transformers' norms whose forward is Llama's: hidden_states in fp32, times rsqrt(mean(hidden_states^2) +
# variance_epsilon), rounded to the input's dtype, times weight. tests/test_rms_norm.py compares each one that the
# installed transformers has with the kdsl module.
TRANSFORMERS_LLAMA_NORMS = frozenset({
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeRMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm",
})


def _qualified_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def is_transformers_llama_norm(module: nn.Module) -> bool:
    """Whether module is one of TRANSFORMERS_LLAMA_NORMS (by class, not by its attributes: a norm of other maths is
    left alone)."""
    return _qualified_name(module) in TRANSFORMERS_LLAMA_NORMS


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in fp32, rounded once to x's dtype: what
    torch.nn.RMSNorm computes for one normalized dimension with an elementwise weight. round_normalized: x * rsqrt(...)
    rounded to x's dtype before the weight, as transformers' Llama-family norms (a weight of another dtype than x is
    then applied in torch, as they apply it: the result takes torch's promoted dtype). Inference only: the weight is a
    Parameter that does not require grad (state dict key `weight`, as torch's and transformers' norms)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, round_normalized: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        self.eps = float(eps)
        self.round_normalized = bool(round_normalized)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def from_module(cls, norm: nn.Module) -> RMSNorm:
        """The kdsl norm of a torch.nn.RMSNorm (one normalized dimension, elementwise_affine; its eps, or where that
        is None the finfo eps of its weight's dtype, which torch would take for inputs of that dtype) or of one of
        transformers' Llama-family norms (TRANSFORMERS_LLAMA_NORMS: `weight`, `variance_epsilon`, round_normalized).
        Shares the weight's storage."""
        if isinstance(norm, nn.RMSNorm):
            if len(norm.normalized_shape) != 1 or norm.weight is None:
                raise ValueError(f"norm: kdsl.nn.RMSNorm takes one normalized dimension with an elementwise weight, "
                                 f"got normalized_shape={tuple(norm.normalized_shape)}, "
                                 f"elementwise_affine={norm.weight is not None}")
            eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
            round_normalized = False
        elif is_transformers_llama_norm(norm):
            eps, round_normalized = norm.variance_epsilon, True
        else:
            raise TypeError(f"norm: expected a torch.nn.RMSNorm or one of transformers' Llama-family RMSNorms "
                            f"(kdsl.nn.norm.TRANSFORMERS_LLAMA_NORMS), got {_qualified_name(norm)}")
        weight = norm.weight.detach()
        if weight.dim() != 1:
            raise ValueError(f"norm.weight: expected one dimension, got shape {tuple(weight.shape)}")
        module = cls(weight.shape[0], eps, round_normalized=round_normalized, dtype=weight.dtype, device="meta")
        module.weight = nn.Parameter(weight, requires_grad=False)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.round_normalized and self.weight.dtype != x.dtype:
            normalized = ops.rms_norm(x, torch.ones_like(self.weight, dtype=x.dtype), self.eps, True)
            return self.weight * normalized
        return ops.rms_norm(x, self.weight, self.eps, self.round_normalized)

    def forward_quantized(self, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm quantized per token in groups of group_size as kdsl.ops.act_quant quantizes (what FP8Linear's
        forward_quantized takes): one rms_norm_quant launch from the norm's fp32 rows; a round_normalized weight of
        another dtype than x, as forward applies it, then act_quant."""
        if self.round_normalized and self.weight.dtype != x.dtype:
            return ops.act_quant(self(x), group_size)
        return ops.rms_norm_quant(x, self.weight, self.eps, group_size, self.round_normalized)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), h) for h = x + residual in x's dtype: a decoder layer's residual add and this norm in one
        add_rms_norm launch (a round_normalized weight of another dtype than x: the add, then forward)."""
        if self.round_normalized and self.weight.dtype != x.dtype:
            h = x + residual
            return self(h), h
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.round_normalized)

    def forward_add_quantized(self, x: torch.Tensor, residual: torch.Tensor,
                              group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, s, h): forward_quantized of h = x + residual, and h, in one add_rms_norm_quant launch (a
        round_normalized weight of another dtype than x: the add, then forward_quantized)."""
        if self.round_normalized and self.weight.dtype != x.dtype:
            h = x + residual
            return (*self.forward_quantized(h, group_size), h)
        return ops.add_rms_norm_quant(x, residual, self.weight, self.eps, group_size, self.round_normalized)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", round_normalized=True" if self.round_normalized else "")


def swap_transformers_norms(model: nn.Module) -> int:
    """Replace every one of transformers' Llama-family norms inside model (TRANSFORMERS_LLAMA_NORMS) with the
    kdsl.nn.RMSNorm that computes the same thing in one kernel, sharing its weight; returns how many."""
    found = [(name, module) for name, module in model.named_modules() if name and is_transformers_llama_norm(module)]
    for name, module in found:
        _swap(model, name, RMSNorm.from_module(module))
    return len(found)
