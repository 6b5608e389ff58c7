"""weight_dequant: 128x128-block FP8 weights [N, K] to bf16. K need not be a multiple of 128 (the scale grid is
ceil(N/128) x ceil(K/128)). Baselines: a device copy of the same bytes and the torch expression."""
from __future__ import annotations

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, Case
from kdsl.bench.results import COPY

DIMS = ("n", "k")
MEMORY_BOUND = True
HELP = "vs a device copy of the same bytes and the torch expression"


def setup(case: Case) -> timing.CaseSetup:
    dequant = timing.kdsl_op("weight_dequant")
    n, k = case.n, case.k
    q, s = timing.torch_weight_quant(torch.randn(n, k, device=timing.DEVICE, dtype=torch.bfloat16))
    ref = timing.fp8_weight_reference(q, s)
    bytes_moved = n * k + 4 * s.numel() + 2 * n * k
    return timing.CaseSetup(
        kdsl={"weight_dequant": lambda: dequant(q, s, block_size=(GROUP, GROUP), out_dtype=torch.bfloat16)},
        check=lambda out: timing.check_close(out, ref, timing.DEQUANT_TOL),
        baselines={COPY: timing.copy_baseline(bytes_moved),
                   "torch": lambda: (q.float() * timing.expand_blocks(s, n, k)).to(torch.bfloat16)},
        tolerance=timing.DEQUANT_TOL, bytes_moved=bytes_moved)
