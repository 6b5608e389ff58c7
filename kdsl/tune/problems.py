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
    builders = {"fp8_gemm": _fp8_gemm, "gptq_gemm": _gptq_gemm, "w4a16_gemm": _w4a16_gemm}
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
