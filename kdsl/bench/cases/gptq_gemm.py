"""gptq_gemm: y [M, N] = x [M, K] @ w, w from GPTQ INT4 checkpoint tensors (group 128, "gptq" format).

Rows: gptq_gemm on the checkpoint tensors (no act-order, so g_idx is left out: the contiguous-group path), and
where kdsl.ops has gptq_prepare, gptq_gemm[prepared] (repacked once outside the timed call: w4a16_gemm's kernels)
and gptq_gemm[prepared,desc_act] (the same weights as an act-order checkpoint). Baseline: fp16 torch.matmul on
the dequantized weights. Graph-timed at every M: GPTQ's W4A16 bar is stated on CUDA-graph timing.

`kdsl tune` tunes both GPTQ GEMMs on these cases: gptq_gemm's kernel (scheme GPTQ) and w4a16_gemm's, the kernel
behind the prepared rows (scheme W4A16, weights from gptq_prepare in the layout the kernel reads).
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
when kdsl.ops has gptq_prepare); CUDA graphs at every M"""
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


def setup(case: Case) -> timing.CaseSetup:
    gemm = timing.kdsl_op("gptq_gemm")
    m, n, k = case.m, case.n, case.k
    inputs = gptq_gemm_inputs(m, n, k)
    x, qweight, qzeros, scales, ref = inputs.x, inputs.qweight, inputs.qzeros, inputs.scales, inputs.ref
    w16 = inputs.w_ref.half()
    # No act-order here, so g_idx is left out: the bench times the contiguous-group path.
    kdsl = {"gptq_gemm": lambda: gemm(x, qweight, qzeros, scales, None, bits=4, group_size=GROUP)}
    from kdsl import ops
    if hasattr(ops, "gptq_prepare"):  # repacked weights, prepared once outside the timed call
        try:
            prepared = ops.gptq_prepare(qweight, qzeros, scales, None, bits=4, group_size=GROUP,
                                        checkpoint_format="gptq")
            kdsl["gptq_gemm[prepared]"] = lambda: gemm(x, prepared)
        except Exception as exc:  # noqa: BLE001 - only this row fails, the plain gptq_gemm still runs
            kdsl["gptq_gemm[prepared]"] = timing.raising(exc)
        try:  # the same weights as a desc_act checkpoint: rows permuted, the group of each row in g_idx
            act_order = desc_act_checkpoint(inputs)
            prepared_act_order = ops.gptq_prepare(act_order.qweight, act_order.qzeros, act_order.scales,
                                                  act_order.g_idx, bits=4, group_size=GROUP, checkpoint_format="gptq")
            kdsl["gptq_gemm[prepared,desc_act]"] = lambda: gemm(act_order.x, prepared_act_order)
        except Exception as exc:  # noqa: BLE001 - only this row fails
            kdsl["gptq_gemm[prepared,desc_act]"] = timing.raising(exc)
    groups = scales.shape[0]
    return timing.CaseSetup(
        kdsl=kdsl, check=lambda out: timing.check_close(out, ref, timing.GEMM_TOL),
        baselines={"fp16_matmul": lambda: torch.matmul(x, w16)},
        tolerance=timing.GEMM_TOL, flops=2 * m * n * k,
        bytes_moved=2 * m * k + k * n // 2 + groups * n // 2 + 2 * groups * n + 2 * m * n)


def gptq_problem(entry, shape) -> timing.Problem:
    """gptq_gemm's kernel on the checkpoint tensors of a case at a tune Shape (M, N, K)."""
    inputs = gptq_gemm_inputs(shape.m, shape.n, shape.k)
    x, qweight, qzeros, scales = inputs.x, inputs.qweight, inputs.qzeros, inputs.scales
    y = torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device)
    return timing.kernel_problem(y, inputs.ref, timing.GEMM_TOL,
                                 lambda p: entry.launch(x, qweight, qzeros, scales, None, y, p))


def w4a16_problem(entry, shape) -> timing.Problem:
    """w4a16_gemm's kernel on the same weights, prepared by gptq_prepare for the layout the entry reads."""
    from kdsl.ops import gptq_prepare

    inputs = gptq_gemm_inputs(shape.m, shape.n, shape.k)
    w = gptq_prepare(inputs.qweight, inputs.qzeros, inputs.scales, None, bits=4, group_size=GROUP,
                     checkpoint_format="gptq")
    if w.layout != entry.layout:
        raise RuntimeError(f"gptq_prepare wrote layout {w.layout}, but {entry.name} reads {entry.layout}")
    x = inputs.x
    y = torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device)
    return timing.kernel_problem(
        y, inputs.ref, timing.GEMM_TOL,
        lambda p: entry.launch(x, w.perm, w.qweight, w.zeros, w.scales, w.groups, w.contiguous_groups, y, p))


# Unlike the bench, the tuner times these by graphs up to timing.GRAPH_MAX_M only (do_bench above it).
TUNES = {"gptq_gemm": timing.Tune(GPTQ(), gptq_problem), "w4a16_gemm": timing.Tune(W4A16(), w4a16_problem)}
