"""kdsl bench --kernels: a callable's time split by GPU kernel, from torch.profiler's trace.

The callable is captured in a CUDA graph (as do_bench_cudagraph times it) and the graph replayed REPLAYS times under
the profiler, CUDA activity only; where it cannot be captured, it runs eagerly instead (the same kernels, launched
one by one). Every kernel, memset and memcpy of the trace is summed by name and divided by the calls made: device
µs per call. Their sum leaves out the gaps between kernels, so the report gives it beside the timed call.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable

REPLAYS = 20
GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")  # the trace categories that take device time


def per_call_totals(events: Iterable[tuple[str, float]], runs: int, calls: int) -> dict[str, float]:
    """{name: µs per call}, from (name, device µs) events of `runs` runs of a callable that makes `calls` calls each,
    largest first."""
    totals: dict[str, float] = {}
    for name, us in events:
        totals[name] = totals.get(name, 0.0) + us
    share = runs * calls
    return dict(sorted(((name, us / share) for name, us in totals.items()), key=lambda item: -item[1]))


def trace_events(trace: dict) -> list[tuple[str, float]]:
    """(name, duration µs) of each GPU event in a chrome trace (torch.profiler's export_chrome_trace). A kernel
    launched with several grids (one generated kernel serving two GEMMs of a layer) is named with its grid, so
    each launch keeps a line of its own."""
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in GPU_EVENTS and "dur" in e]
    grids: dict[str, set] = {}
    for e in events:
        grids.setdefault(e["name"], set()).add(str(e.get("args", {}).get("grid")))
    return [(e["name"] + (f" grid={e['args']['grid']}" if len(grids[e["name"]]) > 1 else ""), float(e["dur"]))
            for e in events]


def captured(fn: Callable[[], object]):
    """fn's launches captured in a CUDA graph, after warm-up calls on a side stream (as torch's docs do)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _replayer(fn: Callable[[], object]) -> Callable[[], object]:
    """A CUDA graph of fn, as a function that replays it; fn itself where capture fails."""
    import torch

    try:
        return captured(fn).replay
    except Exception:  # noqa: BLE001 - not every op can be captured: profile its eager launches
        torch.cuda.synchronize()
        return fn


def kernel_times(fn: Callable[[], object], calls: int = 1, replays: int = REPLAYS) -> dict[str, float]:
    """{GPU kernel name: device µs per call} of fn, which makes `calls` calls (weight copies), largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run = _replayer(fn)
    run()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")  # one cycle is all we take
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                run()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return per_call_totals(trace_events(trace), replays, calls)


def kernel_times_or_why(fn: Callable[[], object], calls: int = 1) -> tuple[dict[str, float] | None, str | None]:
    """(kernel_times(fn, calls), None), or (None, why) where the profiler fails: a breakdown is extra, so the
    caller says why on its own progress line and the run goes on."""
    try:
        return kernel_times(fn, calls), None
    except Exception as error:  # noqa: BLE001 - e.g. no CUPTI on this machine
        first = str(error).strip().splitlines()
        return None, f"{type(error).__name__}: {first[0][:300] if first else ''}"
