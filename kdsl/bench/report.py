"""Presenting results: the stdout table, the JSON document and the optional ratio plot.

JSON document (SCHEMA_VERSION 1); non-finite numbers are written as null:

    {"schema_version": 1,
     "tool": "kdsl bench",
     "command": "python -m kdsl bench --op fp8_gemm",
     "date": "2025-01-01T12:00:00+00:00",             # UTC, ISO 8601
     "environment": {"gpu": str, "arch": "sm_90", "torch": str, "triton": str, "cuda": str|null},
     "shapes": "deepseek-v3",                          # the --shapes argument
     "ops": ["fp8_gemm", ...],                         # ops selected
     "timing": {"eager": "...", "graph": "..."},       # how times were taken
     "summary": {"results": int, "ok": int, "wrong": int, "errors": int, "not_available": int},
     "results": [{
        "op": "fp8_gemm", "impl": "fp8_gemm",          # impl may be e.g. "gptq_gemm[prepared]"
        "shape": {"m": 16, "n": 2112, "k": 7168},      # only the dims the op has
        "status": "ok" | "WRONG" | "ERROR" | "not available",
        "detail": str|null,                            # why it is not ok
        "variant_of": str,                             # only on a variant row (act-order's desc_act): the row it
        "time_vs_variant_of": float|null,              # is held against, this row's time over that row's, and
        "variant_times": "graph" | "eager" | null,     # which times (CUDA-graph where both rows have one)
        "flops": int|null, "bytes": int|null,          # per call; bytes = read + written
        "rel_err": float|null, "tolerance": float|null,
        "ceiling_fraction": float|null,                # see Result.ceiling_fraction
        "kdsl": TIMING,
        "baselines": {"cublas_blockwise": TIMING + {"ratio_eager", "ratio_graph"}, ...}}]}

    TIMING = {"eager_ms": float|null, "graph_ms": float|null, "host_us": float|null, "tflops": float|null,
              "tbps": float|null, "error": str|null, "rel_err": float|null,
              "kernels_us": {kernel name: device µs per call}}   # only with --kernels, largest first

ratio_* = baseline time / kdsl time (> 1: kdsl faster), null where either side has no time.
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
import shlex
import sys
from pathlib import Path

from kdsl.bench.results import ERROR, OK, ROOFLINE, UNAVAILABLE, WRONG, Result, Timing

SCHEMA_VERSION = 1
TIMING_NOTE = {
    "eager": "triton.testing.do_bench(return_mode='median'), L2 flushed before each call",
    "graph": "triton.testing.do_bench_cudagraph(return_mode='median'), for M <= 128 (gptq_gemm, fp8_bmm: "
             "every M)",
}
_STATUS_CELL = {OK: "ok", WRONG: "WRONG", ERROR: "ERROR", UNAVAILABLE: "n/a"}


def group_by_op(results: list[Result]) -> dict[str, list[Result]]:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.case.op, []).append(r)
    return groups


def baseline_names(results: list[Result]) -> list[str]:
    return list(dict.fromkeys(name for r in results for name in r.baselines))


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt) + suffix


def _ratio_cell(r: Result, name: str) -> str:
    base = r.baselines.get(name)
    if base is None or r.kdsl.eager_ms is None:
        return "-"
    if base.error:
        return "n/a"
    eager, graph = r.ratio(name), r.ratio(name, "graph")
    return _num(eager, ".2f", "x") + (f" / {graph:.2f}x" if graph is not None else "")


def _host_cell(r: Result, name: str | None) -> str:
    """kdsl's host time per call, and its multiple of the first baseline's (<= 1.25 is the bar)."""
    mine = r.kdsl.host_us
    base = r.baselines.get(name) if name else None
    if mine is None:
        return "-"
    if base is None or not base.host_us:
        return _num(mine, ".1f")
    return f"{mine:.1f} ({mine / base.host_us:.2f}x)"


def _ceiling_cell(r: Result) -> str:
    fraction = r.ceiling_fraction()
    if r.memory_bound:
        return _num(None if fraction is None else 100 * fraction, ".0f", "%")
    return _num(fraction, ".2f", "x")


def _render(header: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Columns before `left` are left-aligned (labels), the rest right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in [header, *rows]]


def format_roofline_table(op: str, results: list[Result]) -> list[str]:
    """Ops held against a measured roofline (fp8_gemm, gptq_gemm, fp8_bmm, the MoE ops): rates and fraction on
    CUDA-graph times where taken; the host-time column where any row measured host time."""
    names = [n for n in baseline_names(results) if n != ROOFLINE]
    host = any(r.kdsl.host_us is not None for r in results)
    host_header = [f"host us (x {names[0]})" if names else "host us"] if host else []
    header = ["shape", "impl", "kdsl ms", "graph ms", "TB/s", "TFLOP/s", "of roofline", *(f"vs {n}" for n in names),
              *host_header, "rel err", "status"]
    rows = [[r.case.label(), r.impl, _num(r.kdsl.eager_ms, ".4f"), _num(r.kdsl.graph_ms, ".4f"),
             _num(r.tbps(r.best_ms), ".2f"), _num(r.tflops(r.best_ms), ".1f"),
             _num(None if r.ceiling_fraction() is None else 100 * r.ceiling_fraction(), ".0f", "%"),
             *(_ratio_cell(r, n) for n in names), *([_host_cell(r, names[0] if names else None)] if host else []),
             _num(r.rel_err, ".2e"), _STATUS_CELL[r.status]] for r in results]
    return [f"== {op} ==  ratios = baseline time / kdsl time (>1: kdsl faster), eager / cuda-graph; "
            "TB/s, TFLOP/s and roofline on cuda-graph times where taken", *_render(header, rows, left=2)]


def format_op_table(op: str, results: list[Result]) -> str:
    names = baseline_names(results)
    memory_bound = results[0].memory_bound
    unit = "TB/s" if memory_bound else "TFLOP/s"
    # Memory-bound ops have a measured ceiling (copy); GEMMs are held against their fastest baseline.
    ceiling = "of copy BW" if memory_bound else "vs best"
    host = f"host us (x {names[0]})" if names else "host us"
    header = ["shape", "impl", "kdsl ms", "graph ms", unit, ceiling, *(f"vs {n}" for n in names), host, "rel err",
              "status"]
    rows = []
    for r in results:
        rows.append([r.case.label(), r.impl, _num(r.kdsl.eager_ms, ".4f"), _num(r.kdsl.graph_ms, ".4f"),
                     _num(r.rate(r.kdsl.eager_ms), ".2f" if memory_bound else ".1f"),
                     _ceiling_cell(r),
                     *(_ratio_cell(r, n) for n in names), _host_cell(r, names[0] if names else None),
                     _num(r.rel_err, ".2e"), _STATUS_CELL[r.status]])
    title = f"== {op} ==  ratios = baseline time / kdsl time (>1: kdsl faster), eager / cuda-graph"
    lines = format_roofline_table(op, results) if ROOFLINE in names else [title, *_render(header, rows, left=2)]
    notes = [f"  {r.case.label()} {r.impl}: {r.status}: {r.detail}" for r in results if r.status != OK]
    seen: dict[tuple[str, str], list[str]] = {}
    for r in results:
        for name, t in r.baselines.items():
            if t.error:
                seen.setdefault((name, t.error), []).append(r.case.label())
    notes += [f"  baseline {name} unavailable for {labels[0]}" + (f" (+{len(labels) - 1} more)" if len(labels) > 1 else "")
              + f": {err}" for (name, err), labels in seen.items()]
    return "\n".join([*lines, *notes, *_inexact_baseline_notes(results), *format_variant_table(results)])


def _by_row(results: list[Result]) -> dict[tuple, Result]:
    return {(r.case.op, r.case.label(), r.impl): r for r in results}


def variant_cost(r: Result, rows: dict[tuple, Result]) -> tuple[float | None, str | None]:
    """(the time of r over that of the row it is a variant of, in the same case; "graph" or "eager": which
    times, CUDA-graph where both rows have one), or (None, None) where either time is missing."""
    reference = rows.get((r.case.op, r.case.label(), r.variant_of)) if r.variant_of else None
    if reference is None:
        return None, None
    for mode in ("graph", "eager"):
        mine, theirs = getattr(r.kdsl, f"{mode}_ms"), getattr(reference.kdsl, f"{mode}_ms")
        if mine and theirs:
            return mine / theirs, mode
    return None, None


def format_variant_table(results: list[Result]) -> list[str]:
    """Per pair of a variant row and the row it is held against (act-order's desc_act and plain GPTQ): the time
    ratio at each shape."""
    rows = _by_row(results)
    lines = []
    for variant, reference in dict.fromkeys((r.impl, r.variant_of) for r in results if r.variant_of):
        pairs = [(r, *variant_cost(r, rows)) for r in results if r.impl == variant]
        table = [[r.case.label(), _num(ratio, ".3f"), mode or "-"] for r, ratio, mode in pairs]
        lines += [f"  {variant} / {reference}: time ratio (>1: the variant is slower)",
                  *("    " + line for line in _render(["shape", "ratio", "times"], table, left=1))]
    return lines


def _inexact_baseline_notes(results: list[Result]) -> list[str]:
    """One line per checked baseline outside the case's tolerance somewhere: its times are still compared, so the
    table says so."""
    outside: dict[str, dict[str, tuple[float, float]]] = {}  # name -> label -> (rel err, tolerance)
    for r in results:  # a case's kdsl rows share its baselines: each label once
        for name, t in r.baselines.items():
            if t.rel_err is not None and r.tolerance is not None and not t.rel_err <= r.tolerance:
                outside.setdefault(name, {})[r.case.label()] = (t.rel_err, r.tolerance)
    notes = []
    for name, found in outside.items():
        labels, checks = list(found), list(found.values())
        notes.append(f"  baseline {name} outside the tolerance {checks[0][1]:g} for {labels[0]}"
                     + (f" (+{len(labels) - 1} more)" if len(labels) > 1 else "")
                     + f": rel err up to {max(err for err, _ in checks):.3g}")
    return notes


def format_table(results: list[Result]) -> str:
    tables = "\n\n".join(format_op_table(op, rs) for op, rs in group_by_op(results).items())
    kernels = format_kernels(results)
    return tables + ("\n\n" + kernels if kernels else "")


KERNEL_LINES = 6  # kernels listed per implementation; the rest are summed into one line


def format_kernels(results: list[Result]) -> str:
    """kdsl bench --kernels: for each result, kdsl's and each baseline's device µs per call by kernel, against the
    call's timed (CUDA-graph, else eager) time; the difference is what no kernel ran (launch gaps, host)."""
    lines, shown = [], set()
    for r in results:
        # a case's baselines are shared by its kdsl rows: each is listed once
        baselines = [(name, t) for name, t in r.baselines.items()
                     if t.kernels_us is not None and (r.case, name) not in shown]
        shown.update((r.case, name) for name, _ in baselines)
        for name, t in [(r.impl, r.kdsl), *baselines]:
            if t.kernels_us is None:
                continue
            call_ms = t.graph_ms or t.eager_ms
            lines += kernel_lines(f"{r.case.op} {r.case.label()} {name}", t.kernels_us,
                                  None if call_ms is None else call_ms * 1e3, "call")
    return ("== per-kernel device time (--kernels) ==\n" + "\n".join(lines)) if lines else ""


def kernel_lines(head: str, kernels_us: dict[str, float], timed_us: float | None, per: str,
                 most: int = KERNEL_LINES) -> list[str]:
    """One implementation's breakdown: a head line (the kernels' sum against the timed `per` where there is one),
    then its `most` largest kernels and the rest summed."""
    total = sum(kernels_us.values())
    lines = [f"{head}: kernels {total:.1f} us" + (f" of {timed_us:.1f} us per {per}" if timed_us else "")]
    items = list(kernels_us.items())
    lines += [f"    {us:9.2f} us  {kernel[:110]}" for kernel, us in items[:most]]
    if items[most:]:
        lines.append(f"    {sum(us for _, us in items[most:]):9.2f} us  ({len(items) - most} more kernels)")
    return lines


def summarize(results: list[Result]) -> dict[str, int]:
    count = lambda status: sum(r.status == status for r in results)  # noqa: E731
    return {"results": len(results), "ok": count(OK), "wrong": count(WRONG), "errors": count(ERROR),
            "not_available": count(UNAVAILABLE)}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _timing_doc(r: Result, t: Timing) -> dict[str, object]:
    kernels = {} if t.kernels_us is None else {"kernels_us": {k: _finite(us) for k, us in t.kernels_us.items()}}
    return {"eager_ms": _finite(t.eager_ms), "graph_ms": _finite(t.graph_ms), "host_us": _finite(t.host_us),
            "tflops": _finite(r.tflops(t.eager_ms)),
            "tbps": _finite(r.tbps(t.eager_ms)), "error": t.error, "rel_err": _finite(t.rel_err), **kernels}


def result_doc(r: Result, rows: dict[tuple, Result] | None = None) -> dict[str, object]:
    """One result as JSON; rows (every result by op, shape and impl) give a variant row its cost against the row
    it is a variant of."""
    ratio, mode = variant_cost(r, rows or {})
    variant = {"variant_of": r.variant_of, "time_vs_variant_of": _finite(ratio), "variant_times": mode} \
        if r.variant_of else {}
    return {
        "op": r.case.op, "impl": r.impl, "shape": r.case.dims(), "status": r.status, "detail": r.detail, **variant,
        "flops": r.flops, "bytes": r.bytes_moved, "rel_err": _finite(r.rel_err), "tolerance": r.tolerance,
        "ceiling_fraction": _finite(r.ceiling_fraction()), "kdsl": _timing_doc(r, r.kdsl),
        "baselines": {name: {**_timing_doc(r, t), "ratio_eager": _finite(r.ratio(name)),
                             "ratio_graph": _finite(r.ratio(name, "graph"))} for name, t in r.baselines.items()},
    }


def build_document(results: list[Result], *, shapes: str, ops: list[str], command: str,
                   environment: dict[str, str | None], date: str | None = None) -> dict[str, object]:
    rows = _by_row(results)
    return {
        "schema_version": SCHEMA_VERSION, "tool": "kdsl bench", "command": command,
        "date": date or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment, "shapes": shapes, "ops": list(ops), "timing": TIMING_NOTE,
        "summary": summarize(results), "results": [result_doc(r, rows) for r in results],
    }


def write_json(document: dict[str, object], path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_ratios(results: list[Result], path: str | Path) -> None:
    """One bar chart per op: eager baseline/kdsl time ratio per case and baseline, line at 1."""
    import matplotlib  # optional extra, imported only when --plot is given

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(op, [r for r in rs if r.kdsl.eager_ms]) for op, rs in group_by_op(results).items()]
    groups = [(op, rs) for op, rs in groups if rs]
    widest = max((len(rs) for _, rs in groups), default=1)
    fig, axes = plt.subplots(max(len(groups), 1), 1, squeeze=False,
                             figsize=(max(8.0, 0.45 * widest + 3), 3.5 * max(len(groups), 1)))
    for ax, (op, rs) in zip(axes[:, 0], groups):
        names = baseline_names(rs)
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            ratios = [r.ratio(name) or 0.0 for r in rs]
            ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(rs))], ratios, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([r.case.label() + ("" if r.impl == op else f" {r.impl}") for r in rs],
                           rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("baseline time / kdsl time")
        ax.set_title(f"{op} (>1: kdsl faster)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "kdsl":
        return shlex.join(["python", "-m", "kdsl", *argv[1:]])
    return shlex.join(argv)
