"""act_quant: per-token groups of 128 along K quantized to e4m3, s = amax / 448.

Baselines: a device copy of the same bytes (the bandwidth ceiling) and the torch expression. Checked by
dequantizing (q * s against x) and by the scales themselves (within SCALE_MAX_ULPS of amax / 448).
"""
from __future__ import annotations

import math

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.bench.results import COPY

DIMS = ("m", "k")
MEMORY_BOUND = True
HELP = "vs a device copy of the same bytes (bandwidth ceiling) and the torch expression"
MULTIPLES = {"k": GROUP_MULTIPLE}
TOL = 5e-2  # dequantized q*s vs x: e4m3 keeps 3 mantissa bits
# Scales must equal amax/448; Triton lowers fp32 '/' to div.full.f32 (up to 2 ulp off IEEE),
# so a correct kernel may differ from torch by that much and no more.
SCALE_MAX_ULPS = 2


def check_act_quant(out: object, x: torch.Tensor, ref_s: torch.Tensor) -> timing.Check:
    try:
        q, s = out  # type: ignore[misc]
    except (TypeError, ValueError):
        return math.nan, f"expected (q, s), got {type(out).__name__}"
    if q.dtype != timing.FP8 or s.dtype != torch.float32:
        return math.nan, f"dtypes q={q.dtype}, s={s.dtype}; expected {timing.FP8}, torch.float32"
    if q.shape != x.shape or s.shape != ref_s.shape:
        return math.nan, f"shapes q={tuple(q.shape)}, s={tuple(s.shape)}; expected {tuple(x.shape)}, {tuple(ref_s.shape)}"
    m, k = x.shape
    dequant = q.float().view(m, k // GROUP, GROUP) * s[..., None]
    err, why = timing.check_close(dequant.view(m, k), x.float(), TOL)
    ulp = torch.nextafter(ref_s, torch.full_like(ref_s, math.inf)) - ref_s
    ulps = ((s - ref_s).abs() / ulp).max().item()
    if why is None and not ulps <= SCALE_MAX_ULPS:
        why = f"scales differ from amax/448 by up to {ulps:.3g} ulp (> {SCALE_MAX_ULPS})"
    return err, why


def setup(case: Case) -> timing.CaseSetup:
    quant = timing.kdsl_op("act_quant")
    m, k = case.m, case.k
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    ref_s = x.float().view(m, k // GROUP, GROUP).abs().amax(-1) / timing.FP8_MAX
    bytes_moved = 2 * m * k + m * k + 4 * ref_s.numel()
    return timing.CaseSetup(
        kdsl={"act_quant": lambda: quant(x, group_size=GROUP)},
        check=lambda out: check_act_quant(out, x, ref_s),
        baselines={COPY: timing.copy_baseline(bytes_moved), "torch": lambda: timing.torch_act_quant(x)},
        tolerance=TOL, bytes_moved=bytes_moved)
