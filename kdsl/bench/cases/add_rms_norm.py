"""add_rms_norm: a decoder layer's residual add and the RMSNorm after it, one launch, over rows of k (the hidden
size), x and the residual bf16.

Baselines: a device copy of the same bytes (the bandwidth ceiling) and the two launches it replaces, torch's add then
kdsl's rms_norm. Checked: h bit for bit against torch's add, y against the norm of h in float64.
"""
from __future__ import annotations

import math

import torch

from kdsl.bench import timing
from kdsl.bench.case import Case
from kdsl.bench.results import COPY

DIMS = ("m", "k")
MEMORY_BOUND = True
GRAPH_EVERY_M = True  # a decode call is a few microseconds: its bar is the graph time
HELP = "vs a device copy of the same bytes (bandwidth ceiling) and torch's add + kdsl's rms_norm"
TOL = 1e-2  # one rounding to bf16 (2^-8 relative) on every element
EPS = 1e-5


def check_add_rms_norm(out: object, ref: torch.Tensor, h_ref: torch.Tensor) -> timing.Check:
    try:
        y, h = out  # type: ignore[misc]
    except (TypeError, ValueError):
        return math.nan, f"expected (y, h), got {type(out).__name__}"
    err, why = timing.check_close(y, ref, TOL)
    if why is None and not torch.equal(h, h_ref):
        why = f"h differs from torch's x + residual in {int((h != h_ref).sum())} elements"
    return err, why


def setup(case: Case) -> timing.CaseSetup:
    fused, norm = timing.kdsl_op("add_rms_norm"), timing.kdsl_op("rms_norm")
    m, k = case.m, case.k
    x = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    residual = torch.randn(m, k, device=timing.DEVICE, dtype=torch.bfloat16)
    weight = (1.0 + 0.1 * torch.randn(k, device=timing.DEVICE)).to(torch.bfloat16)
    h_ref = x + residual
    ref = timing.rms_norm_reference(h_ref, weight, EPS)
    bytes_moved = 4 * m * k * 2 + 2 * k  # x and residual in, y and h out
    return timing.CaseSetup(
        kdsl={"add_rms_norm": lambda: fused(x, residual, weight, EPS)},
        check=lambda out: check_add_rms_norm(out, ref, h_ref),
        baselines={COPY: timing.copy_baseline(bytes_moved),
                   "add+rms_norm": lambda: norm(x + residual, weight, EPS)},
        tolerance=TOL, bytes_moved=bytes_moved)
