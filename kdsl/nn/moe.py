"""A block-FP8 mixture-of-experts layer's experts as a module: kdsl.ops.moe_fp8 on held weights.

The router (its logits, softmax and top-k) and any shared expert are the model's: forward takes the routing
it made, (topk_weights, topk_ids), and returns the weighted sum of the routed experts' gated MLPs,
down(silu(gate(x)) * up(x)). Weights are DeepSeek-V3's: e4m3 with one float32 scale per 128x128 block, each
expert's gate and up projections stacked as w13 [E, 2I, H] (gate rows first), the down projections w2 [E, H, I].
Inference only, like every kdsl module.
"""
from __future__ import annotations

import torch
from torch import nn

from kdsl import ops, registry
from kdsl.ops import moe as moe_ops

OP = "moe_fp8"


class FP8MoE(nn.Module):
    """Experts of a MoE layer in block FP8: forward(x, topk_weights, topk_ids) -> kdsl.ops.moe_fp8(...).

    w13 [E, 2I, H] float8_e4m3fn (gate rows, then up rows) with w13_s float32 [E, ceil(2I/128), H/128];
    w2 [E, H, I] float8_e4m3fn with w2_s float32 [E, ceil(H/128), I/128]. check_ids: forward refuses expert ids
    outside [0, E) by name (one host sync per call, skipped while a CUDA graph is captured: kdsl.ops.moe)."""

    def __init__(self, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor, *,
                 check_ids: bool = True):
        super().__init__()
        # The op's own checks on an empty batch: shapes, dtypes, devices and a served scheme, refused here by name.
        hidden = w13.shape[-1] if w13.dim() == 3 else 0
        probe = torch.empty((0, hidden), dtype=torch.bfloat16, device=w13.device)
        self.scheme = moe_ops._moe_fp8_outputs(
            probe, w13, w13_s, w2, w2_s, torch.empty((0, 1), device=w13.device),
            torch.empty((0, 1), dtype=torch.int32, device=w13.device))[0]
        self.num_experts, self.hidden_size, self.intermediate_size = w13.shape[0], hidden, w13.shape[1] // 2
        self.check_ids = check_ids
        self.register_buffer("w13", w13)
        self.register_buffer("w13_s", w13_s)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_s", w2_s)

    @classmethod
    def from_float(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                   check_ids: bool = True) -> "FP8MoE":
        """Quantize float expert weights in 128x128 blocks (kdsl.ops.weight_quant, one expert at a time):
        gate and up [E, I, H] (nn.Linear's [out, in] per expert), down [E, H, I]."""
        if gate.shape != up.shape or gate.dim() != 3:
            raise ValueError(f"gate, up: expected two [E, I, H] tensors of one shape, got {tuple(gate.shape)} and "
                             f"{tuple(up.shape)}")
        pairs = [ops.weight_quant(torch.cat([g, u]).detach()) for g, u in zip(gate, up)]
        downs = [ops.weight_quant(d.detach()) for d in down]
        return cls(torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]),
                   torch.stack([q for q, _ in downs]), torch.stack([s for _, s in downs]), check_ids=check_ids)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() move the quantized weights at most: a cast would change what the kernels read.
        before = {name: t for name, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [..., H] bf16/fp16, topk_weights float32 [..., k], topk_ids int32 [..., k] -> [..., H] in x's dtype."""
        lead = x.shape[:-1]
        k = topk_ids.shape[-1] if topk_ids.dim() else 0
        y = ops.moe_fp8(x.reshape(-1, x.shape[-1]), self.w13, self.w13_s, self.w2, self.w2_s,
                        topk_weights.reshape(-1, k), topk_ids.reshape(-1, k), check_ids=self.check_ids)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        device = self.w13.device
        try:
            kernel = registry.dispatch(OP, self.scheme, device).name
        except (LookupError, RuntimeError) as error:
            kernel = f"none ({str(error).splitlines()[0]})"
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, scheme={self.scheme}, check_ids={self.check_ids}, "
                f"path={registry.run_path(device)}, kernel={kernel}")


class FP8Experts(FP8MoE):
    """FP8MoE with the call of transformers' fused experts modules (DeepseekV3Experts and its kin, whose
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] it replaces): forward(hidden_states, top_k_index,
    top_k_weights). kdsl.load_quantized puts it where a checkpoint stores those experts in block FP8."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states, top_k_weights.float(), top_k_index.to(torch.int32))
