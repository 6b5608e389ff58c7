"""Host time per call of kdsl ops against the torch ops they replace, GPU idle, in one process.

    python benchmarks/host_time.py [--calls 300] [--rounds 5] [--json PATH] [--only fp8_linear,act_quant+]

Each figure: N back-to-back calls timed on the host clock (time.perf_counter), then one synchronize
outside the timed region (kdsl.bench.timing.host_time_us, the same measure `kdsl bench` prints); the
shapes are decode-sized, so the kernels finish sooner than the host issues them and the host is what is
measured. The host is noisy (3x between runs on the lent H100's), so each case is measured in several
rounds, kdsl and its torch op alternating (which goes first alternates too), and the medians are reported;
the ratio is the median of the rounds' ratios. The torch ops, per the PyTorch-integration issue's bar:
torch._scaled_mm for fp8_gemm, one bf16 F.linear for act_quant + fp8_gemm and for fp8_linear (the two
fused), fp16 x @ w for the prepared int4 GEMM. `alloc` rows time the allocations alone (torch.empty, and torch.empty_like of a one-element
template, which kdsl's launch plans use).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import kdsl
from kdsl.bench.timing import host_time_us


def cases(int4: bool = True):
    """(name, kdsl callable, baseline name, baseline callable or None); int4 False leaves the int4 GEMM cases
    out (and their weights' preparation)."""
    ops = kdsl.ops
    cuda = torch.device("cuda")
    w = torch.randn(2112, 7168, device=cuda, dtype=torch.bfloat16)
    b, b_s = ops.weight_quant(w)
    if int4:
        wh = torch.randn(4096, 4096, device=cuda, dtype=torch.float16)
        ck = ops.gptq_quantize(wh)
        prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None)
        wt = wh.t().contiguous()
    template = torch.empty(1, device=cuda, dtype=torch.bfloat16).expand(1, 2112)
    yield "alloc torch.empty (1, 2112) bf16", lambda: torch.empty((1, 2112), device=cuda, dtype=torch.bfloat16), \
        "torch.empty_like(template)", lambda: torch.empty_like(template)
    for m in (1, 16, 64):
        x = torch.randn(m, 7168, device=cuda, dtype=torch.bfloat16)
        a, a_s = ops.act_quant(x)
        m4 = -(-m // 4) * 4  # _scaled_mm wants M a multiple of 4
        a4 = a.repeat(-(-m4 // m), 1)[:m4].contiguous()
        a4_s = a_s.repeat(-(-m4 // m), 1)[:m4].t().contiguous().t()  # column-major, as _scaled_mm wants
        yield f"act_quant M={m} K=7168", (lambda x=x: ops.act_quant(x)), "-", None
        yield (f"fp8_gemm M={m} N=2112 K=7168", (lambda a=a, a_s=a_s: ops.fp8_gemm(a, a_s, b, b_s)),
               f"torch._scaled_mm (M={m4})",
               (lambda a4=a4, a4_s=a4_s: torch._scaled_mm(a4, b.t(), scale_a=a4_s, scale_b=b_s.t(),
                                                          out_dtype=torch.bfloat16)))
        yield (f"act_quant+fp8_gemm M={m}", (lambda x=x: ops.fp8_gemm(*ops.act_quant(x), b, b_s)),
               "F.linear bf16", (lambda x=x: torch.nn.functional.linear(x, w)))
        yield (f"fp8_linear M={m}", (lambda x=x: ops.fp8_linear(x, b, b_s)),
               "F.linear bf16", (lambda x=x: torch.nn.functional.linear(x, w)))
        if not int4:
            continue
        xh = torch.randn(m, 4096, device=cuda, dtype=torch.float16)
        yield (f"gptq_gemm[prepared] M={m} 4096x4096", (lambda xh=xh: ops.gptq_gemm(xh, prepared)),
               "fp16 x @ w", (lambda xh=xh: xh @ wt))
        yield (f"w4a16_gemm M={m} 4096x4096", (lambda xh=xh: ops.w4a16_gemm(xh, prepared)),
               "fp16 x @ w", (lambda xh=xh: xh @ wt))
    if not int4:
        return
    x1 = torch.randn(1, 4096, device=cuda, dtype=torch.float16)
    yield ("gptq_gemm[checkpoint] M=1 4096x4096",
           lambda: ops.gptq_gemm(x1, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"]), "-", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--only", help="comma-separated prefixes: run only the cases whose name starts with one")
    parser.add_argument("--show-plans", action="store_true", help="print what the launch plans launch at the end")
    args = parser.parse_args()
    rows = []
    only = tuple(args.only.split(",")) if args.only else None
    for name, fn, base_name, base in cases(int4=not only or any(p.startswith(("gptq", "w4a16")) for p in only)):
        if only and not name.startswith(only):
            continue
        mine, theirs = [], []
        for r in range(args.rounds):
            if base is not None and r % 2:
                theirs.append(host_time_us(base, args.calls))
            mine.append(host_time_us(fn, args.calls))
            if base is not None and not r % 2:
                theirs.append(host_time_us(base, args.calls))
        ratio = statistics.median(a / b for a, b in zip(mine, theirs)) if theirs else None
        row = {"case": name, "kdsl_us": statistics.median(mine), "kdsl_rounds": mine, "baseline": base_name,
               "baseline_us": statistics.median(theirs) if theirs else None, "baseline_rounds": theirs,
               "ratio": ratio}
        rows.append(row)
        shown = f"{ratio:5.2f}x" if ratio else "   - "
        print(f"{name:38s} kdsl {row['kdsl_us']:7.1f} us   {base_name:26s} "
              f"{row['baseline_us'] or float('nan'):7.1f} us   {shown}", flush=True)
        if args.json:  # after every row: a run cut short keeps what it measured
            write_json(args, rows)
    if args.show_plans:
        for key, plan in getattr(kdsl.registry, "plans", {}).items():
            print(f"# plan {key[0]}:")
            print(plan.describe() if plan else "  (not replayable)")


def write_json(args, rows: list) -> None:
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "kdsl": kdsl.__file__, "calls": args.calls, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
