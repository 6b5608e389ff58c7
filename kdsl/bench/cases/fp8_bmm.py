"""fp8_bmm: MLA's per-head GEMM, C [B, M, N] = A [B, M, K] @ B [B, N, K]^T with block scales per batch.

a is the transpose(0, 1) view of act_quant's [M, B, K] activations (as MLA passes it), b [B, N, K] per-head
128x128 block weights. Baselines: bf16 torch.bmm on the dequantized weights (the same transposed view of the bf16
activations), and per-batch loops (one CUDA graph when graph-timed) of cuBLAS blockwise torch._scaled_mm and of
kdsl's fp8_gemm; the roofline (bytes / measured copy rate, FLOPs / measured FP8 rate). Up to M = 512
(timing.COLD_MAX_M) the callables cycle through copies of the weights (CaseSetup.calls) so every call reads them
cold from DRAM, CUDA graphs included; activations stay as a previous layer leaves them.

Graph-timed at every M: up to an M where its eager launch (host time) would hide the kernel (B = 16 at M = 4096
runs in ~30 us). `kdsl tune` tunes its kernel on these cases, timed the same way.
"""
from __future__ import annotations

import torch

from kdsl.bench import timing
from kdsl.bench.case import GROUP, GROUP_MULTIPLE, Case
from kdsl.schema import BlockFP8

DIMS = ("batch", "m", "n", "k")  # batch: MLA's heads
HELP = """\
vs bf16 torch.bmm on the dequantized weights and per-batch loops of torch._scaled_mm
(blockwise) and of kdsl's fp8_gemm; a is MLA's transposed [M, B, K] view; the
fraction of the roofline (bytes / measured copy rate, FLOPs / measured FP8 rate); CUDA
graphs at every M, and up to M = 512 its calls cycle through copies of the weights so that
each reads them cold"""
MULTIPLES = {"k": GROUP_MULTIPLE, "n": (16, "16 (fp8_bmm's N)")}
GRAPH_EVERY_M = True


def fp8_bmm_inputs(batch: int, m: int, n: int, k: int) -> tuple:
    """One fp8_bmm case on timing.DEVICE (the bench's and `kdsl tune`'s): bf16 activations x [M, B, K]; a, a_s, the
    transpose(0, 1) views of their act_quant (MLA's layout); per-head block weights b [B, N, K], b_s; their fp32
    dequantized w [B, N, K]; and the fp32 reference [B, M, N]."""
    x = torch.randn(m, batch, k, device=timing.DEVICE, dtype=torch.bfloat16)
    q, s = timing.torch_act_quant(x.view(m * batch, k))
    a, a_s = q.view(m, batch, k).transpose(0, 1), s.view(m, batch, k // GROUP).transpose(0, 1)
    quantized = [timing.torch_weight_quant(torch.randn(n, k, device=timing.DEVICE, dtype=torch.bfloat16))
                 for _ in range(batch)]
    b = torch.stack([wq for wq, _ in quantized])
    b_s = torch.stack([ws for _, ws in quantized])
    w = torch.stack([timing.fp8_weight_reference(wq, ws) for wq, ws in quantized])
    ref = torch.bmm(a.float() * a_s.repeat_interleave(GROUP, -1), w.transpose(1, 2))
    return x, a, a_s, b, b_s, w, ref


def setup(case: Case) -> timing.CaseSetup:
    bmm, gemm = timing.kdsl_op("fp8_bmm"), timing.kdsl_op("fp8_gemm")
    batch, m, n, k = case.batch, case.m, case.n, case.k
    x, a, a_s, b, b_s, w, ref = fp8_bmm_inputs(batch, m, n, k)
    x_t = x.transpose(0, 1)
    weights = timing.weight_copies(m, b, b_s, w.to(torch.bfloat16))
    scaled = [[timing.scaled_mm_baseline(a[g], a_s[g], bq[g], bs[g]) for g in range(batch)] for bq, bs, _ in weights]
    last = lambda outs: timing.check_close(outs[-1], ref, timing.GEMM_TOL)  # noqa: E731  (every copy holds the same weights)
    stacked = lambda outs: timing.check_close(torch.stack(outs[-1]), ref, timing.GEMM_TOL)  # noqa: E731
    bytes_moved = a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * batch * m * n
    flops = 2 * batch * m * n * k
    copy_rate, fp8_rate = timing.machine_ceilings()
    return timing.CaseSetup(
        kdsl={"fp8_bmm": lambda: [bmm(a, a_s, bq, bs, out_dtype=torch.bfloat16) for bq, bs, _ in weights]},
        check=last,
        baselines={"bf16_bmm": lambda: [torch.bmm(x_t, w16.transpose(1, 2)) for _, _, w16 in weights],
                   "cublas_blockwise_loop": lambda: [[fn() for fn in loop] for loop in scaled],
                   "fp8_gemm_loop": lambda: [[gemm(a[g], a_s[g], bq[g], bs[g]) for g in range(batch)]
                                             for bq, bs, _ in weights]},
        baseline_checks={"cublas_blockwise_loop": stacked, "fp8_gemm_loop": stacked},
        tolerance=timing.GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=len(weights), host_time=False,
        roofline_ms=1e3 * max(bytes_moved / copy_rate, flops / fp8_rate))


def tune_problem(entry, shape) -> timing.Problem:
    """As the bench case: a is the transpose(0, 1) view of [M, B, K] activations (MLA's layout), b [B, N, K]
    per-head block weights. Up to timing.COLD_MAX_M rows each launch takes the next of several copies of the
    weights and writes its own output, so a CUDA graph of launches reads the weights cold from DRAM and writes
    every output back, as the bench's calls do (one reused output buffer would stay in L2)."""
    batch = shape.batch or 1
    m, n = shape.m, shape.n
    _, a, a_s, b, b_s, _, ref = fp8_bmm_inputs(batch, m, n, shape.k)
    weights = timing.weight_copies(m, b, b_s)
    outs = [torch.empty(batch, m, n, dtype=torch.bfloat16, device=a.device) for _ in weights]
    return timing.cycling_problem(outs, ref, timing.GEMM_TOL,
                                  lambda i, out, params: entry.launch(a, a_s, *weights[i], out, params))


# Graphs at every M, as the bench times it: B = 16 calls run in 5-25 us at M = 512-4096, under an eager launch.
TUNES = {"fp8_bmm": timing.Tune(BlockFP8(), tune_problem, graph_every_m=True)}
