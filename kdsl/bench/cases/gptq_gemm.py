"""gptq_gemm: y [M, N] = x [M, K] @ w, w from GPTQ INT4 checkpoint tensors (group 128, "gptq" format).

Rows: gptq_gemm on the checkpoint tensors (no act-order, so g_idx is left out: the contiguous-group path), and
where kdsl.ops has gptq_prepare, gptq_gemm[prepared] (repacked once outside the timed call: w4a16_gemm's kernels)
and gptq_gemm[prepared,desc_act] (the same weights as an act-order checkpoint). Baseline: fp16 torch.matmul on
the dequantized weights; the roofline (bytes / measured copy rate, FLOPs / the fp16 tensor-core rate, taken as
half the measured FP8 rate, as moe_w4a16's). Graph-timed at every M: GPTQ's W4A16 bar is stated on CUDA-graph
timing. Up to M = 512 (timing.COLD_MAX_M) every callable, kdsl's rows and the baseline, cycles through copies of
the weights (CaseSetup.calls; one prepared object per copy) so each call reads them cold from DRAM, as a model's
layers do; activations stay as a previous layer leaves them. Host time is per call of the cycle.

`kdsl tune` tunes both GPTQ GEMMs on these cases, on cold weight copies the same way: gptq_gemm's kernel (scheme
GPTQ) and w4a16_gemm's, the kernel behind the prepared rows (scheme W4A16, weights from gptq_prepare in the
layout the kernel reads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.schema import GPTQ, W4A16

DIMS = ("m", "n", "k")
HELP = """\
vs fp16 torch.matmul (INT4, group size 128; also gptq_gemm[prepared]
when kdsl.ops has gptq_prepare); the fraction of the roofline (bytes / measured copy
rate, FLOPs / half the measured FP8 rate); CUDA graphs at every M, and up to M = 512
its calls cycle through copies of the weights so that each reads them cold"""
MULTIPLES = {"k": GROUP_MULTIPLE, "n": (8, "8 (int4 packing of qzeros)")}
GRAPH_EVERY_M = True


@dataclass
class GPTQGemmInputs:
    """A random fp16 weight quantized by kdsl's gptq_quantize (INT4, group 128, "gptq" format,
    no act-order), random fp16 x [M, K], and the fp32 reference of x @ w."""

    x: torch.Tensor
    qweight: torch.Tensor  # int32 [K / 8, N]
    qzeros: torch.Tensor  # int32 [G, N / 8]
    scales: torch.Tensor  # fp16 [G, N]
    w_ref: torch.Tensor  # f32 [K, N], dequantized
    ref: torch.Tensor  # f32 [M, N]


def gptq_gemm_inputs(m: int, n: int, k: int) -> GPTQGemmInputs:
    """Inputs of one gptq_gemm case on timing.DEVICE (the bench's and `kdsl tune`'s); call under full_fp32_matmul."""
    quantize = timing.kdsl_op("gptq_quantize")
    w = torch.randn(n, k, device=timing.DEVICE, dtype=torch.float16) * 0.02
    packed = quantize(w, bits=4, group_size=GROUP, sym=True)
    qweight, qzeros, scales = packed["qweight"], packed["qzeros"], packed["scales"]
    g_idx = packed.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k, device=timing.DEVICE, dtype=torch.int32) // GROUP
    w_ref = timing.gptq_reference_weight(qweight, qzeros, scales, g_idx)  # [K, N]
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.float16)
    return GPTQGemmInputs(x, qweight, qzeros, scales, w_ref, x.float() @ w_ref)


@dataclass
class DescActInputs:
    x: torch.Tensor  # [M, K], x's columns in the checkpoint's row order
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor  # int32 [K]: a permutation's groups, as GPTQ's desc_act writes them


def desc_act_checkpoint(inputs: GPTQGemmInputs) -> DescActInputs:
    """inputs' weights as an act-order checkpoint computing the same product: row perm[i] of the new
    checkpoint holds row i of the old one (group i // GROUP), and x's columns move with the rows."""
    k = inputs.x.shape[-1]
    perm = torch.randperm(k, device=timing.DEVICE)
    q = timing.unpack_int4(inputs.qweight, dim=0)  # [K, N]
    moved = torch.empty_like(q)
    moved[perm] = q
    shifts = torch.arange(8, device=timing.DEVICE, dtype=torch.int64) * 4
    words = (moved.to(torch.int64).view(k // 8, 8, -1) << shifts[None, :, None]).sum(dim=1)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the top nibble
    g_idx = torch.empty(k, device=timing.DEVICE, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, device=timing.DEVICE, dtype=torch.int32) // GROUP
    x = torch.empty_like(inputs.x)
    x[:, perm] = inputs.x
    return DescActInputs(x, qweight, inputs.qzeros, inputs.scales, g_idx)


Checkpoint = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (qweight, qzeros, scales)


def prepare(checkpoint: Checkpoint, g_idx: torch.Tensor | None = None):
    """One copy's W4A16Prepared: gptq_prepare may keep the scales it was given, so each copy prepares its own."""
    from kdsl.ops import gptq_prepare

    return gptq_prepare(*checkpoint, g_idx, bits=4, group_size=GROUP, checkpoint_format="gptq")


def setup(case: Case) -> timing.CaseSetup:
    gemm = timing.kdsl_op("gptq_gemm")
    m, n, k = case.m, case.n, case.k
    inputs = gptq_gemm_inputs(m, n, k)
    x, scales, ref = inputs.x, inputs.scales, inputs.ref
    checkpoints = timing.weight_copies(m, inputs.qweight, inputs.qzeros, scales)
    w16 = inputs.w_ref.half()
    dense = [w16] + [w16.clone() for _ in range(len(checkpoints) - 1)]
    # No act-order here, so g_idx is left out: the bench times the contiguous-group path.
    kdsl = {"gptq_gemm": lambda: [gemm(x, *checkpoint, None, bits=4, group_size=GROUP) for checkpoint in checkpoints]}
    from kdsl import ops
    if hasattr(ops, "gptq_prepare"):  # repacked weights, prepared once outside the timed call
        try:
            prepared = [prepare(checkpoint) for checkpoint in checkpoints]
            kdsl["gptq_gemm[prepared]"] = lambda: [gemm(x, w) for w in prepared]
        except Exception as exc:  # noqa: BLE001 - only this row fails, the plain gptq_gemm still runs
            kdsl["gptq_gemm[prepared]"] = timing.raising(exc)
        try:  # the same weights as a desc_act checkpoint: rows permuted, the group of each row in g_idx
            act_order = desc_act_checkpoint(inputs)
            prepared_act_order = [prepare(checkpoint, act_order.g_idx) for checkpoint in timing.weight_copies(
                m, act_order.qweight, act_order.qzeros, act_order.scales)]
            kdsl["gptq_gemm[prepared,desc_act]"] = lambda: [gemm(act_order.x, w) for w in prepared_act_order]
        except Exception as exc:  # noqa: BLE001 - only this row fails
            kdsl["gptq_gemm[prepared,desc_act]"] = timing.raising(exc)
    groups = scales.shape[0]
    bytes_moved = 2 * m * k + k * n // 2 + groups * n // 2 + 2 * groups * n + 2 * m * n
    flops = 2 * m * n * k
    copy_rate, fp8_rate = timing.machine_ceilings()
    # every copy holds the same weights: the last call's output stands for all
    last = lambda outs: timing.check_close(outs[-1], ref, timing.GEMM_TOL)  # noqa: E731
    return timing.CaseSetup(
        kdsl=kdsl, check=last, baselines={"fp16_matmul": lambda: [torch.matmul(x, w) for w in dense]},
        tolerance=timing.GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=len(checkpoints),
        roofline_ms=1e3 * max(bytes_moved / copy_rate, flops / (fp8_rate / 2)),
        variant_of={"gptq_gemm[prepared,desc_act]": "gptq_gemm[prepared]"})


def gptq_problem(entry, shape) -> timing.Problem:
    """gptq_gemm's kernel on the checkpoint tensors of a case at a tune Shape (M, N, K). Up to timing.COLD_MAX_M rows
    each launch takes the next copy of the weights and writes its own output, so a CUDA graph of launches reads the
    weights cold from DRAM, as the bench's calls do."""
    inputs = gptq_gemm_inputs(shape.m, shape.n, shape.k)
    x = inputs.x
    checkpoints = timing.weight_copies(shape.m, inputs.qweight, inputs.qzeros, inputs.scales)
    outs = [torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device) for _ in checkpoints]
    return timing.cycling_problem(outs, inputs.ref, timing.GEMM_TOL,
                                  lambda i, y, p: entry.launch(x, *checkpoints[i], None, y, p))


def w4a16_problem(entry, shape) -> timing.Problem:
    """w4a16_gemm's kernel on the same weights, prepared by gptq_prepare for the layout the entry reads, one
    prepared copy per launch in turn up to timing.COLD_MAX_M rows (as gptq_problem)."""
    inputs = gptq_gemm_inputs(shape.m, shape.n, shape.k)
    prepared = [prepare(checkpoint)
                for checkpoint in timing.weight_copies(shape.m, inputs.qweight, inputs.qzeros, inputs.scales)]
    if prepared[0].layout != entry.layout:
        raise RuntimeError(f"gptq_prepare wrote layout {prepared[0].layout}, but {entry.name} reads {entry.layout}")
    x = inputs.x
    outs = [torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device) for _ in prepared]

    def run(i: int, y: torch.Tensor, params: dict) -> None:
        w = prepared[i]
        entry.launch(x, w.perm, w.qweight, w.zeros, w.scales, w.groups, w.contiguous_groups, y, params)

    return timing.cycling_problem(outs, inputs.ref, timing.GEMM_TOL, run)


# Unlike the bench, the tuner times these by graphs up to timing.GRAPH_MAX_M only (do_bench above it).
TUNES = {"gptq_gemm": timing.Tune(GPTQ(), gptq_problem), "w4a16_gemm": timing.Tune(W4A16(), w4a16_problem)}
