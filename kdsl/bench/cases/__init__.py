"""The bench suite: one module per op `kdsl bench` times, kdsl/bench/cases/<op>.py, found by walking this package
(adding a module adds the op to the CLI, the shape files and, where it declares TUNES, to `kdsl tune`).

A case module declares
    DIMS           the op's shape-file keys, in kdsl.bench.case.DIM_ORDER ("m", if present, may be a list)
    HELP           its lines in `kdsl bench --help`: what kdsl is timed against
    MULTIPLES      {dim: (multiple, why)}: what a shape file's dims must be multiples of (why completes
                   "is not a multiple of ..."); optional
    setup(case)    -> kdsl.bench.timing.CaseSetup: fresh inputs, kdsl's callables, the baselines, the checks
    GRAPH_EVERY_M  True where the op's bar is on CUDA-graph timing at every M (else up to timing.GRAPH_MAX_M);
                   optional
    MEMORY_BOUND   True where the op is rated in TB/s against a copy of the same bytes (else TFLOP/s); optional
    TUNES          {op: kdsl.bench.timing.Tune} for the kernels `kdsl tune` tunes on this op's shapes; optional

and imports what it shares with other ops from kdsl.bench.timing (timing loops, checks, inputs) and kdsl.bench.moe.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
import sys
import zlib
from types import ModuleType

import torch

from kdsl.bench import profile, timing
from kdsl.bench.case import Case
from kdsl.bench.results import ERROR, OK, ROOFLINE, UNAVAILABLE, WRONG, Result, Timing


def _case_modules() -> dict[str, ModuleType]:
    return {info.name: importlib.import_module(f"{__name__}.{info.name}")
            for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")}


CASES = _case_modules()  # op -> its case module
OPS = tuple(CASES)
# op -> its Tune, and op -> the bench op whose cases give its shapes (gptq_gemm's serve both GPTQ GEMMs)
TUNES = {op: tune for module in CASES.values() for op, tune in getattr(module, "TUNES", {}).items()}
TUNE_SHAPE_OPS = {op: name for name, module in CASES.items() for op in getattr(module, "TUNES", {})}


def op_dims(op: str) -> tuple[str, ...]:
    return CASES[op].DIMS


def op_multiples(op: str) -> dict[str, tuple[int, str]]:
    return getattr(CASES[op], "MULTIPLES", {})


def graph_timed(case: Case) -> bool:
    """Whether the case is also timed by CUDA-graph replay."""
    every_m = getattr(CASES[case.op], "GRAPH_EVERY_M", False)
    return case.m is not None and (case.m <= timing.GRAPH_MAX_M or every_m)


def _kernel_times(case: Case, impl: str, fn, calls: int) -> dict[str, float] | None:
    """fn's breakdown by kernel, or None (said on stderr, past the open progress line) where the profiler fails."""
    times, why = profile.kernel_times_or_why(fn, calls)
    if why:
        print(f"\nkdsl bench: no kernel breakdown for {case.op} {case.label()} {impl}: {why}", file=sys.stderr)
    return times


def run_case(case: Case, host_time: bool = True, kernels: bool = False) -> list[Result]:
    """All results of one case: one per kdsl implementation, sharing the baseline timings. host_time=False
    skips the host-time batches (kdsl bench --no-host-time); kernels=True splits every timed implementation's
    time by GPU kernel (kdsl bench --kernels)."""
    torch.manual_seed(zlib.crc32(f"{case.op} {case.label()}".encode()))  # reproducible, never zeros
    module = CASES[case.op]
    memory_bound = getattr(module, "MEMORY_BOUND", False)
    try:
        with timing.full_fp32_matmul():
            setup = module.setup(case)
    except timing.OpUnavailable as exc:
        return [Result(case, case.op, Timing(error=str(exc)), status=UNAVAILABLE, detail=str(exc),
                       memory_bound=memory_bound)]
    except Exception as exc:  # noqa: BLE001 - e.g. kdsl's quantizer rejecting the shape
        return [Result(case, case.op, Timing(error=timing.describe(exc)), status=ERROR,
                       detail=f"setup: {timing.describe(exc)}", memory_bound=memory_bound)]

    graph = graph_timed(case)
    host = setup.host_time and host_time
    baselines: dict[str, Timing] = {}
    for name, fn in setup.baselines.items():
        try:
            err, _ = timing.run_once(fn, setup.baseline_checks.get(name))
        except Exception as exc:  # noqa: BLE001 - e.g. _scaled_mm refusing a shape: baseline unavailable
            baselines[name] = Timing(error=timing.describe(exc))
            continue
        baselines[name] = timing.per_call(timing.measure(fn, graph, host, setup.calls), setup.calls)
        baselines[name].rel_err = None if math.isnan(err) else err
        if kernels and baselines[name].error is None:
            baselines[name].kernels_us = _kernel_times(case, name, fn, setup.calls)
    if setup.roofline_ms is not None:
        baselines[ROOFLINE] = Timing(eager_ms=setup.roofline_ms, graph_ms=setup.roofline_ms if graph else None)

    results = []
    for impl, fn in setup.kdsl.items():
        result = Result(case, impl, Timing(), baselines, flops=setup.flops, bytes_moved=setup.bytes_moved,
                        tolerance=setup.tolerance, memory_bound=memory_bound, variant_of=setup.variant_of.get(impl))
        try:
            result.rel_err, why = timing.run_once(fn, setup.check)
        except Exception as exc:  # noqa: BLE001
            error = timing.describe(exc)
            result.status, result.detail, result.kdsl = ERROR, error, Timing(error=error)
            results.append(result)
            continue
        if why is not None:
            result.status, result.detail = WRONG, why
        # a wrong kernel is still timed, and flagged
        result.kdsl = timing.per_call(timing.measure(fn, graph, host, setup.calls), setup.calls)
        if result.kdsl.error and result.status == OK:
            result.status, result.detail = ERROR, result.kdsl.error
        if kernels and result.kdsl.error is None:
            result.kdsl.kernels_us = _kernel_times(case, impl, fn, setup.calls)
        results.append(result)
    del setup
    torch.cuda.empty_cache()
    return results
