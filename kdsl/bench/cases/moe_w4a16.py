"""moe_w4a16: the W4A16 MoE layer (GPU only), Qwen3-30B-A3B's int4 experts.

Inputs: a random layer of E experts in GPTQ's int4 format (group 128, asymmetric: random integer weights, zeros
and scales, built on the device), prepared once by kdsl.ops.gptq_moe_prepare, bf16 activations and a random routing
of T tokens (kdsl.bench.moe.random_routing). Every kdsl result is checked against an fp32 reference computed one
routed expert at a time on the dequantized weights.

Rows: `moe_w4a16`; at decode `moe_w4a16[check_ids=False]` (no host sync for the ids check); and
`moe_w4a16[desc_act]`: the same layer with act-order, every expert's K permuted inside each group (each of gate and
up its own permutation) and the stored rows moved with it, so the product is the same and the layer gathers x's
and h's rows through the permutations (once per sorted row). Baselines, in the same run on the same routing: bf16 on the dequantized
weights, as a per-expert loop over the routed experts (their rows found once, outside the timed call) and as
`torch._grouped_mm` where this torch has it. Decode (T <= 128: CUDA graphs) is judged by bytes, the routed experts'
int4 weights, scales and zeros plus x and y, against the measured copy rate; prefill by FLOPs against the bf16
tensor-core rate, taken as half the measured FP8 rate. Up to T = 128 each callable cycles through copies of the
layer, so that every call finds its experts cold in L2.
"""
from __future__ import annotations

import dataclasses

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.bench.moe import DECODE_MAX_T, MOE_TOL, bf16_baselines, layer_copies, random_routing, routed_rows
from kdsl.schema import W4A16

DIMS = ("experts", "topk", "m", "hidden", "inter")  # int4 experts (GPTQ, group 128)
HELP = """\
the MoE layer on int4 GPTQ experts (group 128; also with act-order, [desc_act]) vs
moe_fp8's bf16 baselines; roofline: routed experts' int4 bytes (decode), bf16 FLOPs (prefill)"""
MULTIPLES = {"hidden": GROUP_MULTIPLE, "inter": GROUP_MULTIPLE}

SHIFTS = tuple(range(0, 32, 4))


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 16) -> int32 [R / 8, C], row r in bits 4 (r % 8) (GPTQ's qweight)."""
    shifts = torch.tensor(SHIFTS, device=q.device, dtype=torch.int64)
    words = (q.to(torch.int64).view(-1, 8, q.shape[1]) << shifts[None, :, None]).sum(1)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor(SHIFTS, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(1) >> shifts[None, :, None]) & 15).reshape(-1, words.shape[1])


def gptq_layer(experts: int, k: int, n: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One projection of E experts as GPTQ stores it ({"qweight", "qzeros", "scales"} stacked over experts, "gptq"
    format, group 128) with the real zeros int32 [E, G, N] and the int weights [E, K, N] (for the reference)."""
    groups = k // GROUP
    q = torch.randint(0, 16, (experts, k, n), device=timing.DEVICE, dtype=torch.int32)
    zeros = torch.randint(1, 16, (experts, groups, n), device=timing.DEVICE, dtype=torch.int32)
    # (q - zero) spans about +-8: scales of ~ 1 / (8 sqrt(k)) give each product ~ N(0, 1/k) weights
    scales = ((torch.rand(experts, groups, n, device=timing.DEVICE) + 0.5) * (k ** -0.5 / 4)).to(torch.bfloat16)
    qweight = torch.stack([_pack_rows(q[e]) for e in range(experts)])
    qzeros = torch.stack([_pack_rows((zeros[e] - 1).T.contiguous()).T.contiguous() for e in range(experts)])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, zeros, q


def _dense(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's fp32 [K, N] = (q - zero) * scale per group of 128 rows."""
    return (q - zeros.repeat_interleave(GROUP, 0)).float() * scales.float().repeat_interleave(GROUP, 0)


def _within_groups(experts: int, segments: int, k: int) -> torch.Tensor:
    """int32 [E, S, K]: a random permutation of K that moves rows only inside their group of 128."""
    noise = torch.rand(experts, segments, k // GROUP, GROUP, device=timing.DEVICE)
    base = torch.arange(0, k, GROUP, device=timing.DEVICE)[:, None]
    return (noise.argsort(-1) + base).flatten(-2).to(torch.int32)


def _act_order(prepared, perm: torch.Tensor):
    """prepared with act-order: stored row k of segment s becomes row perm[e, s, k] of the original, so with x's
    columns gathered through perm the product is unchanged (perm keeps every row in its group)."""
    segments = perm.shape[1]
    cols = prepared.n // segments
    qweight = torch.empty_like(prepared.qweight)
    for e in range(prepared.experts):
        q = _unpack_rows(prepared.qweight[e])
        moved = torch.cat([q[perm[e, s].long(), s * cols:(s + 1) * cols] for s in range(segments)], dim=1)
        qweight[e] = _pack_rows(moved)
    return dataclasses.replace(prepared, qweight=qweight, perm=perm)


def _copy(prepared):
    return dataclasses.replace(prepared, **{name: getattr(prepared, name).clone()
                                            for name in ("qweight", "zeros", "scales", "perm")
                                            if getattr(prepared, name) is not None})


def _expert_bytes(hidden: int, inter: int) -> int:
    """Bytes an expert's weights occupy: int4 words, and a 2-byte scale and zero per group and column."""
    return 3 * hidden * inter // 2 + 2 * 2 * (hidden // GROUP * 2 * inter + inter // GROUP * hidden)


def _reference(x, routed, topk_weights, dense13, dense2, inter: int) -> torch.Tensor:
    """fp32 y [T, H], one routed expert at a time; dense13(e), dense2(e): expert e's fp32 [H, 2I], [I, H]."""
    ref = torch.zeros(x.shape, device=x.device)
    for e, token, slot in routed:
        gu = x[token].float() @ dense13(e)
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        ref.index_add_(0, token, topk_weights[token, slot, None] * (h @ dense2(e)))
    return ref


def setup(case: Case) -> timing.CaseSetup:
    moe = timing.kdsl_op("moe_w4a16")
    prepare = timing.kdsl_op("gptq_moe_prepare")
    experts, topk, tokens, hidden, inter = case.experts, case.topk, case.m, case.hidden, case.inter
    topk_weights, topk_ids = random_routing(tokens, experts, topk)
    routed = routed_rows(topk_ids, experts)

    gate_up, zeros13, q13 = gptq_layer(experts, hidden, 2 * inter)
    down, zeros2, q2 = gptq_layer(experts, inter, hidden)
    w13 = prepare(gate_up["qweight"], gate_up["qzeros"], gate_up["scales"], None, group_size=GROUP)
    w2 = prepare(down["qweight"], down["qzeros"], down["scales"], None, group_size=GROUP)
    expert_bytes = _expert_bytes(hidden, inter)
    copies = layer_copies(tokens, len(routed) * expert_bytes)
    layers = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(copies - 1)]
    act_order = [(_act_order(a, _within_groups(experts, 2, hidden)), _act_order(b, _within_groups(experts, 1, inter)))
                 for a, b in layers]
    x = torch.randn(tokens, hidden, device=timing.DEVICE, dtype=torch.bfloat16)

    # fp32 reference and the bf16 weights of the baselines ([E, N, K], nn.Linear's layout), one expert at a time
    dense13 = lambda e: _dense(q13[e], zeros13[e], gate_up["scales"][e])  # noqa: E731
    dense2 = lambda e: _dense(q2[e], zeros2[e], down["scales"][e])  # noqa: E731
    ref = _reference(x, routed, topk_weights, dense13, dense2, inter)
    w13_bf16 = torch.empty(experts, 2 * inter, hidden, device=timing.DEVICE, dtype=torch.bfloat16)
    w2_bf16 = torch.empty(experts, hidden, inter, device=timing.DEVICE, dtype=torch.bfloat16)
    for e in range(experts):
        w13_bf16[e], w2_bf16[e] = dense13(e).T.to(torch.bfloat16), dense2(e).T.to(torch.bfloat16)
    del q13, q2, zeros13, zeros2
    bf16_layers = [(w13_bf16, w2_bf16)] + [(w13_bf16.clone(), w2_bf16.clone()) for _ in range(copies - 1)]

    baselines = bf16_baselines(x, bf16_layers, routed, topk_weights, topk_ids, experts, inter)

    flops = 6 * tokens * topk * hidden * inter
    bytes_moved = len(routed) * expert_bytes + 2 * 2 * tokens * hidden + 8 * tokens * topk
    kdsl = {"moe_w4a16": lambda: [moe(x, a, b, topk_weights, topk_ids) for a, b in layers]}
    if tokens <= DECODE_MAX_T:  # eager decode without the ids check's host sync (captured graphs skip it anyway)
        kdsl["moe_w4a16[check_ids=False]"] = lambda: [moe(x, a, b, topk_weights, topk_ids, check_ids=False)
                                                      for a, b in layers]
    kdsl["moe_w4a16[desc_act]"] = lambda: [moe(x, a, b, topk_weights, topk_ids) for a, b in act_order]
    copy_rate, fp8_rate = timing.machine_ceilings()
    check = lambda outs: timing.check_close(outs[-1], ref, MOE_TOL)  # noqa: E731
    return timing.CaseSetup(
        kdsl=kdsl, check=check, baselines=baselines, baseline_checks={name: check for name in baselines},
        tolerance=MOE_TOL, flops=flops, bytes_moved=bytes_moved, calls=copies,
        roofline_ms=1e3 * max(bytes_moved / copy_rate, flops / (fp8_rate / 2)),
        variant_of={"moe_w4a16[desc_act]": "moe_w4a16"})



def tune_problem(entry, shape) -> timing.Problem:
    """The sorted kernel (entry: moe_w4a16's, on the scheme of W4A16() below) on a random GPTQ layer at a tune Shape
    (T tokens routed to topk of E experts, H = shape.k, I = shape.n), prepared for the layout the entry reads,
    checked against the fp32 per-expert reference; the ids are not checked (no host sync in the timed launch).
    At decode (T <= 128) launches take turns over copies of the layer, as the bench's calls do, so the routed
    experts are read cold from DRAM."""
    from kdsl.ops import gptq_moe_prepare

    experts, topk, tokens, hidden, inter = shape.experts, shape.topk, shape.m, shape.k, shape.n
    topk_weights, topk_ids = random_routing(tokens, experts, topk)
    gate_up, zeros13, q13 = gptq_layer(experts, hidden, 2 * inter)
    down, zeros2, q2 = gptq_layer(experts, inter, hidden)
    w13 = gptq_moe_prepare(gate_up["qweight"], gate_up["qzeros"], gate_up["scales"], None, group_size=GROUP)
    w2 = gptq_moe_prepare(down["qweight"], down["qzeros"], down["scales"], None, group_size=GROUP)
    if w13.layout != entry.layout:
        raise RuntimeError(f"gptq_moe_prepare wrote layout {w13.layout}, but {entry.name} reads {entry.layout}")
    x = torch.randn(tokens, hidden, device=timing.DEVICE, dtype=torch.bfloat16)
    routed = routed_rows(topk_ids, experts)
    ref = _reference(x, routed, topk_weights, lambda e: _dense(q13[e], zeros13[e], gate_up["scales"][e]),
                     lambda e: _dense(q2[e], zeros2[e], down["scales"][e]), inter)
    copies = layer_copies(tokens, len(routed) * _expert_bytes(hidden, inter))
    layers = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(copies - 1)]

    def run(i, y, params):
        a, b = layers[i]
        entry.launch(x, a.qweight, a.zeros, a.scales, a.perm, b.qweight, b.zeros, b.scales, b.perm,
                     topk_weights, topk_ids, y, None, params)

    return timing.cycling_problem([torch.empty_like(x) for _ in range(copies)], ref, MOE_TOL, run)


# Tiles per bucket of tokens per routed expert, on the preset's moe_w4a16 layers (kdsl.tune.search.shapes_for_bucket).
TUNES = {"moe_w4a16": timing.Tune(W4A16(), tune_problem)}
