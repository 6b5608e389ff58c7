"""fp8_gemm: C [M, N] = A [M, K] @ B [N, K]^T with DeepSeek-V3 block scales (1x128 activations, 128x128 weights).

Baselines: cuBLAS blockwise FP8 through torch._scaled_mm (checked too) and bf16 torch.matmul on the unquantized
weights; the roofline (bytes / measured copy rate, FLOPs / measured FP8 rate). Up to M = 512 (timing.COLD_MAX_M)
every callable cycles through copies of the weights (CaseSetup.calls) so each call reads them cold from DRAM, as a
model's layers do, CUDA graphs included; activations stay as a previous layer leaves them. `kdsl tune` tunes its
kernel on these cases (block FP8 128x128), timed the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP_MULTIPLE, Case
from kdsl.schema import BlockFP8

DIMS = ("m", "n", "k")
HELP = """\
vs torch._scaled_mm with DeepSeek block scales (cuBLAS) and bf16 torch.matmul; the
fraction of the roofline (bytes / measured copy rate, FLOPs / measured FP8 rate); up to
M = 512 its calls cycle through copies of the weights so that each reads them cold"""
MULTIPLES = {"k": GROUP_MULTIPLE}


@dataclass
class FP8GemmInputs:
    """Random bf16 x [M, K] and w [N, K], quantized by torch, and the fp32 reference of the GEMM."""

    x: torch.Tensor
    w: torch.Tensor
    a: torch.Tensor  # fp8 [M, K]
    a_s: torch.Tensor  # f32 [M, K / 128]
    b: torch.Tensor  # fp8 [N, K]
    b_s: torch.Tensor  # f32 [ceil(N / 128), K / 128]
    ref: torch.Tensor  # f32 [M, N]


def fp8_gemm_inputs(m: int, n: int, k: int) -> FP8GemmInputs:
    """Inputs of one fp8_gemm case on timing.DEVICE (the bench's and `kdsl tune`'s); call under full_fp32_matmul."""
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=timing.DEVICE, dtype=torch.bfloat16)
    a, a_s = timing.torch_act_quant(x)
    b, b_s = timing.torch_weight_quant(w)
    return FP8GemmInputs(x, w, a, a_s, b, b_s, timing.fp8_gemm_reference(a, a_s, b, b_s))


def setup(case: Case) -> timing.CaseSetup:
    gemm = timing.kdsl_op("fp8_gemm")
    m, n, k = case.m, case.n, case.k
    inputs = fp8_gemm_inputs(m, n, k)
    x, a, a_s, b, b_s, ref = inputs.x, inputs.a, inputs.a_s, inputs.b, inputs.b_s, inputs.ref
    w_kn = inputs.w.t().contiguous()
    weights = timing.weight_copies(m, b, b_s, w_kn)
    scaled = [timing.scaled_mm_baseline(a, a_s, bq, bs) for bq, bs, _ in weights]
    # every copy holds the same weights: the last call's output stands for all
    last = lambda outs: timing.check_close(outs[-1], ref, timing.GEMM_TOL)  # noqa: E731
    bytes_moved = a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * m * n
    flops = 2 * m * n * k
    copy_rate, fp8_rate = timing.machine_ceilings()
    return timing.CaseSetup(
        kdsl={"fp8_gemm": lambda: [gemm(a, a_s, bq, bs, out_dtype=torch.bfloat16) for bq, bs, _ in weights]},
        check=last,
        baselines={"cublas_blockwise": lambda: [fn() for fn in scaled],
                   "bf16_matmul": lambda: [torch.matmul(x, w16) for _, _, w16 in weights]},
        baseline_checks={"cublas_blockwise": last},
        tolerance=timing.GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=len(weights),
        roofline_ms=1e3 * max(bytes_moved / copy_rate, flops / fp8_rate))


def tune_problem(entry, shape) -> timing.Problem:
    """The generated kernel's launch on this case's inputs at a tune Shape (M, N, K). Up to timing.COLD_MAX_M rows
    each launch takes the next of several copies of the weights and writes its own output, so a CUDA graph of
    launches reads the weights cold from DRAM, as the bench's calls do (decode tiles are picked on cold weights)."""
    inputs = fp8_gemm_inputs(shape.m, shape.n, shape.k)
    a, a_s, b, b_s = inputs.a, inputs.a_s, inputs.b, inputs.b_s
    weights = timing.weight_copies(shape.m, b, b_s)
    outs = [torch.empty(shape.m, shape.n, dtype=torch.bfloat16, device=a.device) for _ in weights]
    return timing.cycling_problem(outs, inputs.ref, timing.GEMM_TOL,
                                  lambda i, c, params: entry.launch(a, a_s, *weights[i], c, params))


TUNES = {"fp8_gemm": timing.Tune(BlockFP8(), tune_problem)}
