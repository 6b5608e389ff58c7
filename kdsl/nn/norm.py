"""kdsl.nn.RMSNorm: a decoder layer's RMSNorm through kdsl.ops.rms_norm (one kernel; torch.nn.RMSNorm's takes
about three times as long at decode on an H200: kernel_defs/rms_norm.toml)."""
from __future__ import annotations

import torch
from torch import nn

from kdsl import ops


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in fp32, rounded once to x's dtype: what
    torch.nn.RMSNorm computes for one normalized dimension with an elementwise weight. Inference only: the weight
    is a Parameter that does not require grad (state dict key `weight`, as torch's and transformers' norms)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def from_module(cls, norm: nn.Module) -> RMSNorm:
        """The kdsl norm of a torch.nn.RMSNorm (one normalized dimension, elementwise_affine; its eps, or where that
        is None the finfo eps of its weight's dtype, which torch would take for inputs of that dtype) or of a
        transformers RMSNorm (`weight`, `variance_epsilon`). Shares the weight's storage."""
        if isinstance(norm, nn.RMSNorm):
            if len(norm.normalized_shape) != 1 or norm.weight is None:
                raise ValueError(f"norm: kdsl.nn.RMSNorm takes one normalized dimension with an elementwise weight, "
                                 f"got normalized_shape={tuple(norm.normalized_shape)}, "
                                 f"elementwise_affine={norm.weight is not None}")
            eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        elif isinstance(getattr(norm, "weight", None), torch.Tensor) and hasattr(norm, "variance_epsilon"):
            eps = norm.variance_epsilon
        else:
            raise TypeError(f"norm: expected a torch.nn.RMSNorm or a module with `weight` and `variance_epsilon` "
                            f"(transformers' RMSNorm), got {type(norm).__name__}")
        weight = norm.weight.detach()
        if weight.dim() != 1:
            raise ValueError(f"norm.weight: expected one dimension, got shape {tuple(weight.shape)}")
        module = cls(weight.shape[0], eps, dtype=weight.dtype, device="meta")
        module.weight = nn.Parameter(weight, requires_grad=False)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
