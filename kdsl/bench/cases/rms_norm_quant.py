"""rms_norm_quant: a decoder layer's RMSNorm quantized for the FP8 GEMM after it (per-token groups of 128, act_quant's
rule), over rows of k (the hidden size), x bf16.

Baselines: a device copy of the same bytes (the bandwidth ceiling), and the two kdsl ops it replaces, rms_norm then
act_quant (what an FP8 layer runs after a norm otherwise). Checked by dequantizing (q * s against the norm in float64)
and by the scales (within SCALE_RTOL of the reference's amax / 448: the kernel's norm is a few fp32 ulps off).
"""
from __future__ import annotations

import math

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.bench.results import COPY

DIMS = ("m", "k")
MEMORY_BOUND = True
GRAPH_EVERY_M = True  # a decode call is a few microseconds: its bar is the graph time
HELP = "vs a device copy of the same bytes (bandwidth ceiling) and kdsl's rms_norm + act_quant"
MULTIPLES = {"k": GROUP_MULTIPLE}
TOL = 5e-2  # dequantized q*s vs the norm: e4m3 keeps 3 mantissa bits
EPS = 1e-5
SCALE_RTOL = 1e-5


def check_rms_norm_quant(out: object, ref: torch.Tensor, ref_s: torch.Tensor) -> timing.Check:
    try:
        q, s = out  # type: ignore[misc]
    except (TypeError, ValueError):
        return math.nan, f"expected (q, s), got {type(out).__name__}"
    if q.dtype != timing.FP8 or s.dtype != torch.float32 or q.shape != ref.shape or s.shape != ref_s.shape:
        return math.nan, (f"q {q.dtype} {tuple(q.shape)}, s {s.dtype} {tuple(s.shape)}; expected {timing.FP8} "
                          f"{tuple(ref.shape)}, torch.float32 {tuple(ref_s.shape)}")
    m, k = ref.shape
    dequant = q.float().view(m, k // GROUP, GROUP) * s[..., None]
    err, why = timing.check_close(dequant.view(m, k), ref, TOL)
    scale_err = ((s - ref_s).abs() / ref_s).max().item()
    if why is None and not scale_err <= SCALE_RTOL:
        why = f"scales differ from amax/448 by up to {scale_err:.3g} relative (> {SCALE_RTOL:g})"
    return err, why


def setup(case: Case) -> timing.CaseSetup:
    fused, norm, quant = timing.kdsl_op("rms_norm_quant"), timing.kdsl_op("rms_norm"), timing.kdsl_op("act_quant")
    m, k = case.m, case.k
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    weight = (1.0 + 0.1 * torch.randn(k, device=timing.DEVICE)).to(torch.bfloat16)
    ref = timing.rms_norm_reference(x, weight, EPS).float()
    ref_s = ref.view(m, k // GROUP, GROUP).abs().amax(-1) / timing.FP8_MAX
    bytes_moved = 2 * m * k + 2 * k + m * k + 4 * ref_s.numel()
    return timing.CaseSetup(
        kdsl={"rms_norm_quant": lambda: fused(x, weight, EPS, GROUP)},
        check=lambda out: check_rms_norm_quant(out, ref, ref_s),
        baselines={COPY: timing.copy_baseline(bytes_moved),
                   "rms_norm+act_quant": lambda: quant(norm(x, weight, EPS), group_size=GROUP)},
        tolerance=TOL, bytes_moved=bytes_moved)
