"""GPU problems for the search: the bench's inputs and fp32 references bound to a generated kernel.

Imported only on the run path (torch, triton, a CUDA GPU). What each op's problem is lives with its bench case
(kdsl/bench/cases/<op>.py, TUNES): a candidate is launched through the registry entry's module `launch` with
the tile dict from kdsl.codegen.render.tile_params (the implementation's options included), so no definition
has to change to try it; prepared W4A16 weights come from kdsl.ops.gptq_prepare for the entry's declared layout.
"""
from __future__ import annotations

import zlib

import torch

from kdsl.bench import timing
from kdsl.bench.cases import TUNES
from kdsl.tune.search import Problem, ProblemFactory, Shape


def problem_factory(op: str, entry) -> ProblemFactory:
    """Shape -> Problem for `entry` (a kdsl.runtime KernelEntry of `op`), on timing.DEVICE."""
    build = TUNES[op].problem

    def make(shape: Shape) -> Problem:
        torch.cuda.empty_cache()  # the search has let go of the previous shape's inputs
        torch.manual_seed(zlib.crc32(f"tune {op} {shape.label()}".encode()))  # reproducible per shape
        with timing.full_fp32_matmul():
            return build(entry, shape)
    return make
