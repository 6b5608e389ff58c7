"""What the int4 schemes (GPTQ, AWQ) share: W4A16Linear from float weights by round-to-nearest, the shape rules of
the w4a16 kernels, and the per-expert tensors of fused experts modules."""
from __future__ import annotations

import torch

from kdsl import ops
from kdsl.nn.modules import W4A16Linear
from kdsl.nn.schemes.base import LayerFormat, SchemeHandler, Spec
from kdsl.schema import GPTQ


class Int4Format(LayerFormat):
    """GPTQ's and AWQ's checkpoint formats: scales in the model's dtype; per-expert tensors (Qwen3-MoE) read into a
    fused experts module (build_experts: the format's own)."""

    experts = True

    def read_dtypes(self, act_dtype):
        return {} if act_dtype is None else {"scales": act_dtype}

    def expert_specs(self, inter: int, hidden: int) -> dict[str, Spec]:
        """One expert's tensors under <experts>.<e>.: gate and up [I, H] linears, down [H, I], as the format stores
        them."""
        return int4_expert_specs(self, inter, hidden)

    def experts_problem(self, inter: int, hidden: int) -> str | None:
        return int4_experts_problem(self.scheme.group_size, inter, hidden)


class Int4Handler(SchemeHandler):
    """GPTQ and AWQ alike: both prepare into the w4a16 layout and run on W4A16Linear."""

    module_class = W4A16Linear

    def unservable(self, scheme, k, n):
        group = k if scheme.group_size == -1 else scheme.group_size
        if k % group:
            return f"in_features = {k} is not a multiple of group_size = {group}"
        if k % 8 or n % 8:
            side = f"in_features = {k}" if k % 8 else f"out_features = {n}"
            return f"{side} is not a multiple of 8 (int4 weights and zeros are packed 8 to an int32)"
        return None

    def from_float(self, scheme, linear):
        return W4A16Linear.from_float(linear, scheme)

    def rtn_symmetric(self, scheme) -> bool:
        """Whether round-to-nearest weights of this scheme are symmetric (as W4A16Linear.from_float makes them)."""
        return False

    def float_checkpoint(self, scheme, linear):
        weight = linear.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
        ck = ops.gptq_quantize(weight.to(dtype), bits=scheme.bits, group_size=scheme.group_size,
                               sym=self.rtn_symmetric(scheme))
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return {**{name: ck[name] for name in ("qweight", "qzeros", "scales")}, "bias": bias}

    def checkpoint_scheme(self, scheme):
        """float_checkpoint's tensors are GPTQ's (v1) whatever the int4 scheme: prepared, the two are one layout."""
        return GPTQ(bits=scheme.bits, group_size=scheme.group_size, sym=self.rtn_symmetric(scheme),
                    checkpoint_format="gptq")


def int4_expert_specs(fmt: LayerFormat, inter: int, hidden: int) -> dict[str, Spec]:
    """The format's tensors of each of an expert's linears (K, N): gate and up (H, I), down (I, H); no bias."""
    specs = {}
    for proj, (k, n) in (("gate_proj", (hidden, inter)), ("up_proj", (hidden, inter)), ("down_proj", (inter, hidden))):
        specs.update({f"{proj}.{role}": spec for role, spec in fmt.specs(k, n).items() if role != "bias"})
    return specs


def int4_experts_problem(group_size: int, inter: int, hidden: int) -> str | None:
    """An int4 fused experts module stacks gate and up along N (whole int32 words of 8 columns) and groups K."""
    if inter % 8:
        return f"expert intermediate size {inter} is not a multiple of 8, so gate and up words cannot be stacked as w13"
    for what, k in (("hidden size", hidden), ("expert intermediate size", inter)):
        if group_size != -1 and k % group_size:
            return f"{what} {k} is not a multiple of group_size = {group_size}"
    return None


def stack_experts(experts: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """{projection: {role: [E, ...]}} from each expert's {"<projection>.<role>": tensor}: every role all experts
    store, stacked; a g_idx only some store is completed with k // group_size order for the others, any other
    optional role only some store (symmetric AWQ's qzeros) is left out."""
    stacked: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted({key for t in experts for key in t}):
        projection, _, role = key.rpartition(".")
        present = [t.get(key) for t in experts]
        if all(p is not None for p in present):
            stacked.setdefault(projection, {})[role] = torch.stack(present)
        elif role == "g_idx":
            k = next(p for p in present if p is not None).shape[0]
            scales = experts[0][f"{projection}.scales"]
            default = torch.arange(k, dtype=torch.int32, device=scales.device) // (k // scales.shape[0])
            stacked.setdefault(projection, {})[role] = torch.stack([default if p is None else p for p in present])
    return stacked
