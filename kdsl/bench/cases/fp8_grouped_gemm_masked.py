"""fp8_grouped_gemm_masked: one MoE projection (N, K) in the masked layout [E, T, K] (a decode layout: max_m = T
rows per expert), against the bf16 per-expert loop and the roofline (kdsl.bench.moe)."""
from __future__ import annotations

import torch

from kdsl.bench import moe, timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case

DIMS = ("experts", "topk", "m", "n", "k")  # m: tokens, each routed to topk of the experts
HELP = """\
one MoE projection over the routed slots (masked [E, T, K]) vs the bf16
per-expert loop and the roofline"""
MULTIPLES = {"k": GROUP_MULTIPLE}


def setup(case: Case) -> timing.CaseSetup:
    """Masked layout: a [E, max_m = T, K] (no expert gets more than T of the T tokens), masked_m on the device,
    expected_m = ceil(T * k / E) as a serving stack would pass it."""
    experts, topk, tokens, n, k, topk_ids, routed, weights, copies, flops, bytes_moved = moe.grouped_common(case)
    masked = timing.kdsl_op("fp8_grouped_gemm_masked")
    counts = torch.zeros(experts, dtype=torch.int32, device=timing.DEVICE)
    for e, token, _ in routed:
        counts[e] = token.numel()
    x = torch.randn(experts, tokens, k, device=timing.DEVICE, dtype=torch.bfloat16)
    a, a_s = timing.torch_act_quant(x.view(-1, k))
    a, a_s = a.view(experts, tokens, k), a_s.view(experts, tokens, k // GROUP)
    expected_m = max(1, -(-tokens * topk // experts))
    b0, s0, _ = weights[0]
    ref = {e: moe.deq_rows(a[e, :token.numel()], a_s[e, :token.numel()]) @ timing.fp8_weight_reference(b0[e], s0[e]).T
           for e, token, _ in routed}

    def check(outs):
        out = outs[-1]
        return timing.check_close(torch.cat([out[e, :r.shape[0]] for e, r in ref.items()]), torch.cat(list(ref.values())),
                             timing.GEMM_TOL)

    return timing.CaseSetup(
        kdsl={"fp8_grouped_gemm_masked": lambda: [masked(a, a_s, b, s, counts, expected_m=expected_m)
                                                  for b, s, _ in weights]},
        check=check,
        baselines={"bf16_loop": lambda: [[x[e, :token.numel()] @ w[e].T for e, token, _ in routed]
                                         for _, _, w in weights]},
        tolerance=timing.GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=copies,
        roofline_ms=moe.roofline_ms(bytes_moved, flops))
