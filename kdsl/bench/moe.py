"""What the MoE ops' bench cases share (kdsl/bench/cases/moe_fp8.py, fp8_grouped_gemm.py,
fp8_grouped_gemm_masked.py, moe_w4a16.py): a random layer and routing, the fp32 reference's pieces, the bf16
baselines and the cold copies (GPU only).

Inputs: a random layer of E experts (bf16 weights ~ N(0, 1/fan_in), quantized by torch in 128x128 blocks) and a
random routing of T tokens (softmax over N(0, 1) logits, top-k). Every kdsl result is checked against an fp32
reference computed one expert at a time (dequantize, then matmul; the same 1x128 activation quantization).

Baselines, in the same run on the same routing: bf16 on the dequantized weights, as `torch._grouped_mm` (where
this torch has it) over the tokens sorted by expert, and as a per-expert loop over the routed experts (their rows
found once, outside the timed call). Decode (T <= 128: CUDA graphs) is judged by bytes: the routed experts'
weights and scales plus x and y, against the measured copy rate (the roofline row); prefill by TFLOP/s.
Up to T = 128 each callable cycles through copies of the layer, so that every call finds its experts cold in L2.
"""
from __future__ import annotations

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, Case

DECODE_MAX_T = 128
MOE_TOL = 2e-2  # bf16 output vs fp32 reference (the activations' e4m3 rounding is in both)


def quantized_experts(experts: int, n: int, k: int, copies: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """[(q [E, N, K] e4m3, s [E, N/128, K/128], w [E, N, K] bf16: the dequantized weights)], one per copy: every
    callable, kdsl's and the baselines', cycles through the copies (CaseSetup.calls)."""
    q = torch.empty(experts, n, k, dtype=timing.FP8, device=timing.DEVICE)
    s = torch.empty(experts, -(-n // GROUP), -(-k // GROUP), device=timing.DEVICE)
    w = torch.empty(experts, n, k, dtype=torch.bfloat16, device=timing.DEVICE)
    for e in range(experts):
        q[e], s[e] = timing.torch_weight_quant(torch.randn(n, k, device=timing.DEVICE, dtype=torch.bfloat16) * k ** -0.5)
        w[e] = timing.fp8_weight_reference(q[e], s[e]).to(torch.bfloat16)
    return [(q, s, w)] + [(q.clone(), s.clone(), w.clone()) for _ in range(copies - 1)]


def random_routing(tokens: int, experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) from random router logits."""
    logits = torch.randn(tokens, experts, device=timing.DEVICE)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def routed_rows(topk_ids: torch.Tensor, experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, slots) of every routed expert, found on the host once (for the references and the loops)."""
    found = []
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        found.append((e, token, slot))
    return found


def deq_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(GROUP, -1)


def layer_copies(tokens: int, touched_bytes: int) -> int:
    return min(timing.MAX_COPIES, -(-timing.COLD_BYTES // max(1, touched_bytes))) if tokens <= DECODE_MAX_T else 1


def roofline_ms(bytes_moved: int, flops: int) -> float:
    copy_rate, fp8_rate = timing.machine_ceilings()
    return 1e3 * max(bytes_moved / copy_rate, flops / fp8_rate)


def grouped_mm_or_none():
    """torch._grouped_mm where this torch has it (bf16, sm_90+), else None."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or torch.cuda.get_device_capability() < (9, 0):
        return None
    return fn


def _sorted_by_expert(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot order, int32 end offsets per expert) of the flattened slots sorted by expert, on the device
    (scatter_add, not bincount: no host sync, so a CUDA graph captures it)."""
    flat = topk_ids.view(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# the MoE layers

def bf16_baselines(x, bf16_layers, routed, topk_weights, topk_ids, experts: int, inter: int) -> dict:
    """The MoE layer in bf16 on each copy of the weights (w13 [E, 2I, H], w2 [E, H, I]): a per-expert loop, and
    torch._grouped_mm over the slots sorted by expert where this torch has it."""
    tokens, hidden = x.shape
    topk = topk_ids.shape[1]

    def bf16_loop(w13, w2):
        y = torch.zeros(tokens, hidden, device=timing.DEVICE)
        for e, token, slot in routed:
            gate_up = x[token] @ w13[e].T
            h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y.index_add_(0, token, topk_weights[token, slot, None] * (h @ w2[e].T).float())
        return y.to(torch.bfloat16)

    baselines = {"bf16_loop": lambda: [bf16_loop(w13, w2) for w13, w2 in bf16_layers]}
    grouped_mm = grouped_mm_or_none()
    if grouped_mm is not None:
        def bf16_grouped_mm(w13, w2):
            order, offsets = _sorted_by_expert(topk_ids, experts)
            token = order // topk
            # [E, K, N] views, column-major as _grouped_mm wants
            gate_up = grouped_mm(x[token], w13.transpose(1, 2), offs=offsets)
            h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out = grouped_mm(h, w2.transpose(1, 2), offs=offsets).float() * topk_weights.view(-1)[order, None]
            return torch.zeros(tokens, hidden, device=timing.DEVICE).index_add_(0, token, out).to(torch.bfloat16)

        baselines["bf16_grouped_mm"] = lambda: [bf16_grouped_mm(w13, w2) for w13, w2 in bf16_layers]
    return baselines


# ---------------------------------------------------------------------------------------------------------------
# the grouped GEMMs

def contiguous_layout(topk_ids: torch.Tensor, experts: int, align: int = 128) -> torch.Tensor:
    """group_ids [M] of DeepGEMM's contiguous layout for this routing: each expert's slots, padded with -1 rows to a
    multiple of align (on the host: the bench builds the layout once)."""
    counts = torch.bincount(topk_ids.view(-1).long(), minlength=experts).tolist()
    ids = []
    for e, count in enumerate(counts):
        ids += [e] * count + [-1] * (-count % align)
    return torch.tensor(ids, dtype=torch.int32, device=topk_ids.device)


def grouped_common(case: Case):
    experts, topk, tokens, n, k = case.experts, case.topk, case.m, case.n, case.k
    _, topk_ids = random_routing(tokens, experts, topk)
    routed = routed_rows(topk_ids, experts)
    expert_bytes = n * k + 4 * (-(-n // GROUP)) * (k // GROUP)
    copies = layer_copies(tokens, len(routed) * expert_bytes)
    weights = quantized_experts(experts, n, k, copies)
    flops = 2 * tokens * topk * n * k
    bytes_moved = len(routed) * expert_bytes + tokens * topk * (k + 4 * k // GROUP + 2 * n)
    return experts, topk, tokens, n, k, topk_ids, routed, weights, copies, flops, bytes_moved
