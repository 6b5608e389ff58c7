"""fp8_grouped_gemm: one MoE projection (N, K) over the routed slots in DeepGEMM's contiguous layout (each expert's
rows padded to 128), against the bf16 per-expert loop and torch._grouped_mm and the roofline (kdsl.bench.moe)."""
from __future__ import annotations

import torch

from kdsl.bench import moe, timing
from kdsl.bench.case import GROUP_MULTIPLE, Case

DIMS = ("experts", "topk", "m", "n", "k")  # m: tokens, each routed to topk of the experts
HELP = """\
one MoE projection over the routed slots (contiguous layout padded to 128
rows) vs a bf16 per-expert loop and torch._grouped_mm, and the roofline"""
MULTIPLES = {"k": GROUP_MULTIPLE}


def setup(case: Case) -> timing.CaseSetup:
    """Contiguous layout: the T * k slots sorted by expert, each group padded to 128 rows (-1 ids)."""
    experts, topk, tokens, n, k, topk_ids, routed, weights, copies, flops, bytes_moved = moe.grouped_common(case)
    grouped = timing.kdsl_op("fp8_grouped_gemm")
    group_ids = moe.contiguous_layout(topk_ids, experts)
    x = torch.randn(group_ids.numel(), k, device=timing.DEVICE, dtype=torch.bfloat16)
    a, a_s = timing.torch_act_quant(x)
    defined = group_ids >= 0
    b0, s0, _ = weights[0]
    ref = torch.zeros(group_ids.numel(), n, device=timing.DEVICE)
    rows_of = {e: (group_ids == e).nonzero().squeeze(1) for e, _, _ in routed}
    for e, rows in rows_of.items():
        ref[rows] = moe.deq_rows(a[rows], a_s[rows]) @ timing.fp8_weight_reference(b0[e], s0[e]).T

    def check(outs):
        return timing.check_close(outs[-1][defined], ref[defined], timing.GEMM_TOL)

    baselines = {"bf16_loop": lambda: [[x[rows] @ w[e].T for e, rows in rows_of.items()] for _, _, w in weights]}
    grouped_mm = moe.grouped_mm_or_none()
    if grouped_mm is not None:
        x_sorted = x[defined]  # the slots without padding, sorted by expert
        offsets = torch.cumsum(torch.bincount(group_ids[defined].long(), minlength=experts), 0).to(torch.int32)
        baselines["bf16_grouped_mm"] = lambda: [grouped_mm(x_sorted, w.transpose(1, 2), offs=offsets)
                                                for _, _, w in weights]
    return timing.CaseSetup(
        kdsl={"fp8_grouped_gemm": lambda: [grouped(a, a_s, b, s, group_ids, check_ids=False) for b, s, _ in weights]},
        check=check, baselines=baselines, tolerance=timing.GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=copies,
        roofline_ms=moe.roofline_ms(bytes_moved, flops))
