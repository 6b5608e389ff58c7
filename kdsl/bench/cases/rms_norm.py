"""rms_norm: a decoder layer's RMSNorm over rows of k (the hidden size), x bf16.

Baselines: a device copy of the same bytes (the bandwidth ceiling) and torch.nn.functional.rms_norm (the fused kernel
torch.nn.RMSNorm runs). Checked against the norm in float64.
"""
from __future__ import annotations

import torch

from kdsl.bench import timing
from kdsl.bench.case import Case
from kdsl.bench.results import COPY

DIMS = ("m", "k")
MEMORY_BOUND = True
GRAPH_EVERY_M = True  # a decode call is a few microseconds: its bar is the graph time
HELP = "vs a device copy of the same bytes (bandwidth ceiling) and torch.nn.functional.rms_norm"
TOL = 1e-2  # one rounding to bf16 (2^-8 relative) on every element
EPS = 1e-5


def setup(case: Case) -> timing.CaseSetup:
    norm = timing.kdsl_op("rms_norm")
    m, k = case.m, case.k
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    weight = (1.0 + 0.1 * torch.randn(k, device=timing.DEVICE)).to(torch.bfloat16)
    ref = timing.rms_norm_reference(x, weight, EPS)
    bytes_moved = 2 * m * k * 2 + 2 * k
    return timing.CaseSetup(
        kdsl={"rms_norm": lambda: norm(x, weight, EPS)},
        check=lambda out: timing.check_close(out, ref, TOL),
        baselines={COPY: timing.copy_baseline(bytes_moved),
                   "torch": lambda: torch.nn.functional.rms_norm(x, (k,), weight, EPS)},
        tolerance=TOL, bytes_moved=bytes_moved)
