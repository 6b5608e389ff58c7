"""A mixture-of-experts layer's experts as a module: kdsl.ops.moe_fp8 (block FP8: FP8MoE, FP8Experts) or
kdsl.ops.moe_w4a16 (int4 GPTQ / AWQ: W4A16MoE, W4A16Experts) on held weights.

The router (its logits, softmax and top-k) and any shared expert are the model's: forward takes the routing
it made, (topk_weights, topk_ids), and returns the weighted sum of the routed experts' gated MLPs,
down(silu(gate(x)) * up(x)). FP8 weights are DeepSeek-V3's: e4m3 with one float32 scale per 128x128 block, each
expert's gate and up projections stacked as w13 [E, 2I, H] (gate rows first), the down projections w2 [E, H, I].
int4 weights are prepared once per projection (kdsl.ops.gptq_moe_prepare / awq_moe_prepare), gate and up as one.
Inference only, like every kdsl module.
"""
from __future__ import annotations

import torch

from kdsl import ops, registry
from kdsl.ops import moe as moe_ops
from kdsl.ops import w4a16_moe
from kdsl.nn.modules import KeepsQuantizedDtypes
from kdsl.ops.w4a16_moe import W4A16ExpertsPrepared
from kdsl.schema import GPTQ
from kdsl.schema.scheme import AWQ

OP = "moe_fp8"


class FP8MoE(KeepsQuantizedDtypes):
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


# ---------------------------------------------------------------------------------------------------------------
# W4A16: int4 experts (GPTQ v1/v2, AWQ)

W4A16_OP = "moe_w4a16"
_PROJECTIONS = ("w13", "w2")
_TENSORS = ("qweight", "zeros", "scales", "perm")


def _stack_gate_up(gate: dict, up: dict) -> dict:
    """One projection's checkpoint tensors from gate's and up's, each stacked over experts: every tensor concatenated
    along N (gate columns, then up columns), g_idx as [E, 2, K] (each half its own groups) where either has one."""
    stacked = {role: torch.cat([gate[role], up[role]], dim=-1) for role in ("qweight", "qzeros", "scales")
               if gate.get(role) is not None and up.get(role) is not None}
    g_gate, g_up = gate.get("g_idx"), up.get("g_idx")
    if g_gate is not None or g_up is not None:
        k = (g_gate if g_gate is not None else g_up).shape[-1]
        rows = torch.arange(k, dtype=torch.int32, device=stacked["qweight"].device)
        default = None
        if g_gate is None or g_up is None:
            size = k // stacked["scales"].shape[1]
            default = (rows // size).expand(stacked["qweight"].shape[0], k)
        stacked["g_idx"] = torch.stack([default if g_gate is None else g_gate, default if g_up is None else g_up], 1)
    return stacked


class W4A16MoE(KeepsQuantizedDtypes):
    """Experts of a MoE layer on int4 weights: forward(x, topk_weights, topk_ids) -> kdsl.ops.moe_w4a16(...).

    w13 (every expert's gate_proj then up_proj, K = H, N = 2I) and w2 (down_proj, K = I, N = H): kdsl.ops
    .gptq_moe_prepare / awq_moe_prepare outputs of one scheme, prepared for the device they run on (from_gptq,
    from_awq and from_float prepare them). x must come in the dtype they were prepared with (the scales').
    check_ids: forward refuses expert ids outside [0, E) by name (one host sync per call, skipped while a CUDA graph
    is captured: kdsl.ops.moe)."""

    def __init__(self, w13: W4A16ExpertsPrepared, w2: W4A16ExpertsPrepared, *, check_ids: bool = True, scheme=None):
        super().__init__()
        w4a16_moe._check_prepared("w13", w13)
        w4a16_moe._check_prepared("w2", w2)
        if w13.scheme not in registry.served_schemes(W4A16_OP):
            registry.require_scheme(W4A16_OP, w13.scheme, f"bits = {w13.bits}, group_size = {w13.group_size}")
        # The op's own checks on an empty batch: shapes, dtypes and devices of the two projections, refused here.
        probe = torch.empty((0, w13.k), dtype=w13.dtype, device=w13.device)
        w4a16_moe._moe_w4a16_outputs(probe, w13, w2, torch.empty((0, 1), device=w13.device),
                                     torch.empty((0, 1), dtype=torch.int32, device=w13.device))
        self.scheme = scheme
        self.num_experts, self.hidden_size, self.intermediate_size = w13.experts, w13.k, w13.n // 2
        self.check_ids = check_ids
        self._fields = {name: getattr(w13, name) for name in ("scheme", "source", "bits", "group_size", "layout",
                                                              "zero_bias")}
        for projection, prepared in (("w13", w13), ("w2", w2)):
            for name in _TENSORS:
                self.register_buffer(f"{projection}_{name}", getattr(prepared, name))

    @property
    def prepared(self) -> tuple[W4A16ExpertsPrepared, W4A16ExpertsPrepared]:
        """(w13, w2) as kdsl.ops.moe_w4a16 takes them, from the module's buffers (wherever .to() moved them); built
        again only when a buffer was replaced."""
        tensors = tuple(self._buffers[f"{p}_{name}"] for p in _PROJECTIONS for name in _TENSORS)
        cached = self.__dict__.get("_prepared_cache")
        if cached is None or any(a is not b for a, b in zip(cached[0], tensors)):
            fields = self._fields
            shared = (fields["scheme"], fields["source"], fields["bits"], fields["group_size"],
                      fields["layout"]["zeros"], fields["layout"].get("weights", ""), fields["zero_bias"])
            cached = (tensors, (w4a16_moe.prepared_from_args(*tensors[:4], *shared),
                                w4a16_moe.prepared_from_args(*tensors[4:], *shared)))
            self.__dict__["_prepared_cache"] = cached
        return cached[1]

    @classmethod
    def from_gptq(cls, gate: dict, up: dict, down: dict, scheme=None, *, dtype: torch.dtype | None = None,
                  check_ids: bool = True) -> "W4A16MoE":
        """From GPTQ checkpoint tensors, each projection's stacked over the experts: {"qweight" [E, K/8, N],
        "qzeros" [E, G, N/8], "scales" [E, G, N], "g_idx" [E, K] (optional)}, gate and up [I, H] linears (K = H,
        N = I), down [H, I]; scheme: a kdsl.GPTQ (bits, group_size, checkpoint_format; default GPTQ()). dtype: the
        activations' (the scales are converted; default theirs). Prepared on the tensors' device."""
        scheme = scheme or GPTQ()
        opts = dict(bits=scheme.bits, group_size=scheme.group_size, checkpoint_format=scheme.checkpoint_format)

        def prepare(t: dict) -> W4A16ExpertsPrepared:
            scales = t["scales"] if dtype is None else t["scales"].to(dtype)
            return ops.gptq_moe_prepare(t["qweight"], t["qzeros"], scales, t.get("g_idx"), **opts)

        return cls(prepare(_stack_gate_up(gate, up)), prepare(down), check_ids=check_ids, scheme=scheme)

    @classmethod
    def from_awq(cls, gate: dict, up: dict, down: dict, scheme=None, *, dtype: torch.dtype | None = None,
                 check_ids: bool = True) -> "W4A16MoE":
        """From AutoAWQ "gemm" tensors, each projection's stacked over the experts: {"qweight" [E, K, N/8],
        "qzeros" [E, G, N/8] (absent or None: symmetric), "scales" [E, G, N]}; scheme: a kdsl AWQ (default AWQ())."""
        scheme = scheme or AWQ()

        def prepare(t: dict) -> W4A16ExpertsPrepared:
            scales = t["scales"] if dtype is None else t["scales"].to(dtype)
            return ops.awq_moe_prepare(t["qweight"], t.get("qzeros"), scales, group_size=scheme.group_size)

        return cls(prepare(_stack_gate_up(gate, up)), prepare(down), check_ids=check_ids, scheme=scheme)

    @classmethod
    def from_float(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scheme=None, *,
                   check_ids: bool = True) -> "W4A16MoE":
        """Round-to-nearest int4 experts from float weights (kdsl.ops.gptq_quantize per expert: GPTQ's storage format,
        not its algorithm): gate and up [E, I, H] (nn.Linear's [out, in]), down [E, H, I]; fp16/bf16 weights keep
        their dtype, others become fp16."""
        scheme = scheme or GPTQ()
        if gate.shape != up.shape or gate.dim() != 3:
            raise ValueError(f"gate, up: expected two [E, I, H] tensors of one shape, got {tuple(gate.shape)} and "
                             f"{tuple(up.shape)}")
        dtype = gate.dtype if gate.dtype in (torch.float16, torch.bfloat16) else torch.float16
        sym = getattr(scheme, "sym", False)

        def quantize(w: torch.Tensor) -> dict:
            made = [ops.gptq_quantize(w_e.detach().to(dtype), bits=scheme.bits, group_size=scheme.group_size, sym=sym)
                    for w_e in w]
            return {role: torch.stack([m[role] for m in made]) for role in ("qweight", "qzeros", "scales")}

        return cls.from_gptq(quantize(gate), quantize(up), quantize(down), GPTQ(bits=scheme.bits,
                             group_size=scheme.group_size), check_ids=check_ids)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [..., H] in the prepared dtype, topk_weights float32 [..., k], topk_ids int32 [..., k] -> [..., H]."""
        lead = x.shape[:-1]
        k = topk_ids.shape[-1] if topk_ids.dim() else 0
        w13, w2 = self.prepared
        y = ops.moe_w4a16(x.reshape(-1, x.shape[-1]), w13, w2, topk_weights.reshape(-1, k), topk_ids.reshape(-1, k),
                          check_ids=self.check_ids)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        device = self.w13_qweight.device
        fields = self._fields
        try:
            kernel = registry.dispatch(W4A16_OP, fields["scheme"], device).name
        except (LookupError, RuntimeError) as error:
            kernel = f"none ({str(error).splitlines()[0]})"
        act_order = self.w13_perm is not None or self.w2_perm is not None
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, scheme={fields['source']} -> {fields['scheme']} "
                f"{fields['layout']}, act_order={act_order}, dtype={self.w13_scales.dtype}, "
                f"check_ids={self.check_ids}, path={registry.run_path(device)}, kernel={kernel}")


class W4A16Experts(W4A16MoE):
    """W4A16MoE with the call of transformers' fused experts modules (Qwen3MoeExperts and its kin, whose gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] it replaces): forward(hidden_states, top_k_index, top_k_weights).
    kdsl.load_quantized puts it where a GPTQ or AWQ checkpoint stores those experts per expert."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states, top_k_weights.float(), top_k_index.to(torch.int32))
