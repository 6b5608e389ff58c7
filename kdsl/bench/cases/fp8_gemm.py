"""fp8_gemm: C [M, N] = A [M, K] @ B [N, K]^T with DeepSeek-V3 block scales (1x128 activations, 128x128 weights).

Baselines: cuBLAS blockwise FP8 through torch._scaled_mm (checked too) and bf16 torch.matmul on the unquantized
weights. `kdsl tune` tunes its kernel on these cases (block FP8 128x128).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP_MULTIPLE, Case
from kdsl.schema import BlockFP8

DIMS = ("m", "n", "k")
HELP = "vs torch._scaled_mm with DeepSeek block scales (cuBLAS) and bf16 torch.matmul"
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
    return timing.CaseSetup(
        kdsl={"fp8_gemm": lambda: gemm(a, a_s, b, b_s, out_dtype=torch.bfloat16)},
        check=lambda out: timing.check_close(out, ref, timing.GEMM_TOL),
        baselines={"cublas_blockwise": timing.scaled_mm_baseline(a, a_s, b, b_s),
                   "bf16_matmul": lambda: torch.matmul(x, w_kn)},
        baseline_checks={"cublas_blockwise": lambda out: timing.check_close(out, ref, timing.GEMM_TOL)},
        tolerance=timing.GEMM_TOL, flops=2 * m * n * k,
        bytes_moved=a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * m * n)


def tune_problem(entry, shape) -> timing.Problem:
    """The generated kernel's launch on this case's inputs at a tune Shape (M, N, K)."""
    inputs = fp8_gemm_inputs(shape.m, shape.n, shape.k)
    a, a_s, b, b_s = inputs.a, inputs.a_s, inputs.b, inputs.b_s
    c = torch.empty(shape.m, shape.n, dtype=torch.bfloat16, device=a.device)
    return timing.kernel_problem(c, inputs.ref, timing.GEMM_TOL, lambda p: entry.launch(a, a_s, b, b_s, c, p))


TUNES = {"fp8_gemm": timing.Tune(BlockFP8(), tune_problem)}
