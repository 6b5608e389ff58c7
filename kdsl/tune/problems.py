"""GPU problems for the search: the bench's inputs and fp32 references bound to a generated kernel.

Imported only on the run path (torch, triton, a CUDA GPU). A candidate is launched through the
registry entry's module `launch` with the tile dict from kdsl.codegen.render.tile_params (the
implementation's options included), so no definition has to change to try it; prepared W4A16
weights come from kdsl.ops.gptq_prepare for the entry's declared layout.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from kdsl.bench import timing
from kdsl.bench.shapes import GROUP
from kdsl.tune.search import Problem, ProblemFactory, Shape


def problem_factory(op: str, entry) -> ProblemFactory:
    """Shape -> Problem for `entry` (a kdsl.runtime KernelEntry of `op`), on timing.DEVICE."""
    builders = {"fp8_gemm": _fp8_gemm, "gptq_gemm": _gptq_gemm, "w4a16_gemm": _w4a16_gemm, "fp8_bmm": _fp8_bmm}
    build = builders[op]

    def make(shape: Shape) -> Problem:
        torch.cuda.empty_cache()  # the search has let go of the previous shape's inputs
        torch.manual_seed(zlib.crc32(f"tune {op} {shape.label()}".encode()))  # reproducible per shape
        with timing.full_fp32_matmul():
            return build(entry, shape)
    return make


def _problem(out: torch.Tensor, ref: torch.Tensor, tolerance: float, run: Callable[[dict], None]) -> Problem:
    def launch(params: dict) -> torch.Tensor:
        run(params)
        return out

    def check(params: dict) -> timing.Check:
        out.fill_(float("nan"))  # a kernel that writes nothing must not pass on an earlier result
        run(params)
        torch.cuda.synchronize()
        return timing.check_close(out, ref, tolerance)

    return Problem(launch=launch, check=check)


def _fp8_gemm(entry, shape: Shape) -> Problem:
    inputs = timing.fp8_gemm_inputs(shape.m, shape.n, shape.k)
    a, a_s, b, b_s = inputs.a, inputs.a_s, inputs.b, inputs.b_s
    c = torch.empty(shape.m, shape.n, dtype=torch.bfloat16, device=a.device)
    return _problem(c, inputs.ref, timing.GEMM_TOL, lambda p: entry.launch(a, a_s, b, b_s, c, p))


def _fp8_bmm(entry, shape: Shape) -> Problem:
    """As kdsl bench's fp8_bmm case: a is the transpose(0, 1) view of [M, B, K] activations (MLA's layout), b
    [B, N, K] per-head block weights. Up to timing.COLD_MAX_M rows each launch takes the next of several copies of
    the weights and writes its own output, so a CUDA graph of launches reads the weights cold from DRAM and writes
    every output back, as the bench's calls do (one reused output buffer would stay in L2)."""
    batch = shape.batch or 1
    m, n = shape.m, shape.n
    _, a, a_s, b, b_s, _, ref = timing.fp8_bmm_inputs(batch, m, n, shape.k)
    copies = timing.cold_copies(m, b)
    weights = [(b, b_s)] + [(b.clone(), b_s.clone()) for _ in range(copies - 1)]
    outs = [torch.empty(batch, m, n, dtype=torch.bfloat16, device=a.device) for _ in range(copies)]
    turn = [0]

    def launch(params: dict) -> torch.Tensor:
        i = turn[0] % copies
        turn[0] += 1
        entry.launch(a, a_s, *weights[i], outs[i], params)
        return outs[i]

    def check(params: dict) -> timing.Check:
        outs[turn[0] % copies].fill_(float("nan"))  # a kernel that writes nothing must not pass on an earlier result
        out = launch(params)
        torch.cuda.synchronize()
        return timing.check_close(out, ref, timing.GEMM_TOL)

    return Problem(launch=launch, check=check)


def _gptq_gemm(entry, shape: Shape) -> Problem:
    inputs = timing.gptq_gemm_inputs(shape.m, shape.n, shape.k)
    x, qweight, qzeros, scales = inputs.x, inputs.qweight, inputs.qzeros, inputs.scales
    y = torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device)
    return _problem(y, inputs.ref, timing.GEMM_TOL,
                    lambda p: entry.launch(x, qweight, qzeros, scales, None, y, p))


def _w4a16_gemm(entry, shape: Shape) -> Problem:
    from kdsl.ops import gptq_prepare

    inputs = timing.gptq_gemm_inputs(shape.m, shape.n, shape.k)
    w = gptq_prepare(inputs.qweight, inputs.qzeros, inputs.scales, None, bits=4, group_size=GROUP,
                     checkpoint_format="gptq")
    if w.layout != entry.layout:
        raise RuntimeError(f"gptq_prepare wrote layout {w.layout}, but {entry.name} reads {entry.layout}")
    x = inputs.x
    y = torch.empty(shape.m, shape.n, dtype=x.dtype, device=x.device)
    return _problem(y, inputs.ref, timing.GEMM_TOL,
                    lambda p: entry.launch(x, w.perm, w.qweight, w.zeros, w.scales, w.groups, w.contiguous_groups, y, p))
