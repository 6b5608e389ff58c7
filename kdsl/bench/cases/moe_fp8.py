"""moe_fp8: the block-FP8 MoE layer, T tokens each routed to top-k of E experts (hidden H, intermediate I).

Rows: moe_fp8, and at decode moe_fp8[check_ids=False] (eager decode without the ids check's host sync; captured
graphs skip it anyway). Baselines: bf16 per-expert loops and torch._grouped_mm on the dequantized weights, and
FlagGems' fused MoE (vLLM's Triton kernels) on the same block-FP8 experts where the flag_gems package imports; the
roofline counts the routed experts' bytes (decode) and the FLOPs (prefill). Inputs and the bf16 baselines:
kdsl.bench.moe.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch

from kdsl.bench import moe, timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.schema import BlockFP8

DIMS = ("experts", "topk", "m", "hidden", "inter")  # m: tokens, each routed to topk of the experts
HELP = """\
the MoE layer (T tokens, top-k of E experts) vs bf16 per-expert loops and torch._grouped_mm
on the dequantized weights, and FlagGems' fused MoE where flag_gems imports; the roofline
counts the routed experts' bytes (decode) and the FLOPs (prefill)"""
MULTIPLES = {"hidden": GROUP_MULTIPLE, "inter": GROUP_MULTIPLE}


def _expert_bytes(hidden: int, inter: int) -> int:
    """Bytes an expert's weights occupy: e4m3 gate, up and down, and their fp32 128x128 block scales."""
    return (3 * inter * hidden + 4 * (-(-2 * inter // GROUP) * (hidden // GROUP)
                                      + -(-hidden // GROUP) * (inter // GROUP)))


def _reference(x, layer, routed, topk_weights, inter: int) -> torch.Tensor:
    """fp32 y [T, H], one routed expert at a time, with the kernels' 1x128 activation quantization."""
    xq, xs = timing.torch_act_quant(x)
    x_deq = moe.deq_rows(xq, xs)
    ref = torch.zeros(x.shape, device=x.device)
    q13, s13, q2, s2 = layer
    for e, token, slot in routed:
        gate_up = x_deq[token] @ timing.fp8_weight_reference(q13[e], s13[e]).T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        hq, hs = timing.torch_act_quant(h)
        down_e = moe.deq_rows(hq, hs) @ timing.fp8_weight_reference(q2[e], s2[e]).T
        ref.index_add_(0, token, topk_weights[token, slot, None] * down_e)
    return ref


@functools.cache
def flaggems_fused_experts() -> Callable | None:
    """FlagGems' fused MoE, flag_gems.fused.fused_experts_impl (5.x), imported once per process; None where
    flag_gems is not installed or fails to import (it wants a GPU, sqlalchemy and pyyaml), said once on stderr."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # it may print while importing; stdout is the table's
            from flag_gems.fused import fused_experts_impl
    except Exception as exc:  # noqa: BLE001 - a missing or broken optional peer only drops its baseline
        print(f"kdsl bench: moe_fp8 runs without the flaggems baseline: {timing.describe(exc)}", file=sys.stderr)
        return None
    return fused_experts_impl


def flaggems_baseline(fused_experts: Callable, x, layers, topk_weights, topk_ids) -> Callable[[], object]:
    """FlagGems on each copy of the block-FP8 layer, as given to kdsl: w13 [E, 2I, H] gate then up (it applies
    silu to the first half), w2 [E, H, I], e4m3, with fp32 multipliers per 128x128 block [E, N/128, K/128]; it
    quantizes x and the activation in 1x128 groups itself and weighs each expert's output by its router weight."""
    return lambda: [fused_experts(x, q13, q2, topk_weights, topk_ids, use_fp8_w8a8=True, w1_scale=s13,
                                  w2_scale=s2, block_shape=[GROUP, GROUP]) for q13, s13, q2, s2 in layers]


def setup(case: Case) -> timing.CaseSetup:
    layer = timing.kdsl_op("moe_fp8")
    experts, topk, tokens, hidden, inter = case.experts, case.topk, case.m, case.hidden, case.inter
    topk_weights, topk_ids = moe.random_routing(tokens, experts, topk)
    routed = moe.routed_rows(topk_ids, experts)
    expert_bytes = _expert_bytes(hidden, inter)
    copies = moe.layer_copies(tokens, len(routed) * expert_bytes)
    up = moe.quantized_experts(experts, 2 * inter, hidden, copies)
    down = moe.quantized_experts(experts, hidden, inter, copies)
    layers = [(q13, s13, q2, s2) for (q13, s13, _), (q2, s2, _) in zip(up, down)]
    bf16_layers = [(w13, w2) for (_, _, w13), (_, _, w2) in zip(up, down)]
    x = torch.randn(tokens, hidden, device=timing.DEVICE, dtype=torch.bfloat16)

    ref = _reference(x, layers[0], routed, topk_weights, inter)

    baselines = moe.bf16_baselines(x, bf16_layers, routed, topk_weights, topk_ids, experts, inter)
    check = lambda outs: timing.check_close(outs[-1], ref, moe.MOE_TOL)  # noqa: E731
    baseline_checks = {}
    fused_experts = flaggems_fused_experts()
    if fused_experts is not None:  # checked as kdsl is: it computes the same block-FP8 product
        baselines["flaggems"] = flaggems_baseline(fused_experts, x, layers, topk_weights, topk_ids)
        baseline_checks["flaggems"] = check

    flops = 6 * tokens * topk * hidden * inter
    bytes_moved = len(routed) * expert_bytes + 2 * 2 * tokens * hidden + 8 * tokens * topk
    kdsl = {"moe_fp8": lambda: [layer(x, *weights, topk_weights, topk_ids) for weights in layers]}
    if tokens <= moe.DECODE_MAX_T:  # eager decode without the ids check's host sync (captured graphs skip it anyway)
        kdsl["moe_fp8[check_ids=False]"] = lambda: [layer(x, *weights, topk_weights, topk_ids, check_ids=False)
                                                    for weights in layers]
    return timing.CaseSetup(
        kdsl=kdsl, check=check, baselines=baselines, baseline_checks=baseline_checks, tolerance=moe.MOE_TOL,
        flops=flops, bytes_moved=bytes_moved, calls=copies, roofline_ms=moe.roofline_ms(bytes_moved, flops))


def tune_problem(entry, shape) -> timing.Problem:
    """The sorted kernel on a random block-FP8 layer at a tune Shape (T tokens routed to topk of E experts,
    H = shape.k, I = shape.n), checked against the fp32 per-expert reference; the ids are not checked. At decode
    (T <= 128) launches take turns over copies of the layer, as the bench's calls do, so the routed experts are
    read cold from DRAM."""
    experts, topk, tokens, hidden, inter = shape.experts, shape.topk, shape.m, shape.k, shape.n
    topk_weights, topk_ids = moe.random_routing(tokens, experts, topk)
    routed = moe.routed_rows(topk_ids, experts)
    copies = moe.layer_copies(tokens, len(routed) * _expert_bytes(hidden, inter))
    up = moe.quantized_experts(experts, 2 * inter, hidden, copies)
    down = moe.quantized_experts(experts, hidden, inter, copies)
    layers = [(q13, s13, q2, s2) for (q13, s13, _), (q2, s2, _) in zip(up, down)]
    x = torch.randn(tokens, hidden, device=timing.DEVICE, dtype=torch.bfloat16)
    ref = _reference(x, layers[0], routed, topk_weights, inter)
    return timing.cycling_problem(
        [torch.empty_like(x) for _ in range(copies)], ref, moe.MOE_TOL,
        lambda i, y, params: entry.launch(x, *layers[i], topk_weights, topk_ids, y, None, params))


# Tiles per bucket of tokens per routed expert, on the preset's moe_fp8 layers (kdsl.tune.search.shapes_for_bucket).
TUNES = {"moe_fp8": timing.Tune(BlockFP8(), tune_problem)}
