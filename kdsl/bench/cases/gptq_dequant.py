"""gptq_dequant: GPTQ INT4 checkpoint tensors (group 128, no act-order) to fp16 w [N, K].
Baselines: a device copy of the same bytes and the torch expression."""
from __future__ import annotations

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.bench.results import COPY

DIMS = ("n", "k")
MEMORY_BOUND = True
HELP = "vs a device copy of the same bytes and the torch expression (INT4 -> fp16)"
MULTIPLES = {"k": GROUP_MULTIPLE, "n": (8, "8 (int4 packing of qzeros)")}


def setup(case: Case) -> timing.CaseSetup:
    quantize, dequant = timing.kdsl_op("gptq_quantize"), timing.kdsl_op("gptq_dequant")
    n, k = case.n, case.k
    packed = quantize(torch.randn(n, k, device=timing.DEVICE, dtype=torch.float16) * 0.02, bits=4, group_size=GROUP,
                      sym=False)
    qweight, qzeros, scales = packed["qweight"], packed["qzeros"], packed["scales"]
    g_idx = torch.arange(k, device=timing.DEVICE, dtype=torch.int32) // GROUP

    def torch_dequant() -> torch.Tensor:
        return timing.gptq_reference_weight(qweight, qzeros, scales, g_idx).t().half()

    ref = timing.gptq_reference_weight(qweight, qzeros, scales, g_idx).t()  # [N, K], as gptq_dequant returns
    bytes_moved = 4 * qweight.numel() + 4 * qzeros.numel() + 2 * scales.numel() + 2 * n * k
    return timing.CaseSetup(
        kdsl={"gptq_dequant": lambda: dequant(qweight, qzeros, scales, bits=4, group_size=GROUP)},
        check=lambda out: timing.check_close(out, ref, timing.DEQUANT_TOL),
        baselines={COPY: timing.copy_baseline(bytes_moved), "torch": torch_dequant},
        tolerance=timing.DEQUANT_TOL, bytes_moved=bytes_moved)
