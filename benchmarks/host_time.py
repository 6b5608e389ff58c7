"""Host time per call of kdsl ops against the torch ops they replace, GPU idle, in one process.

    python benchmarks/host_time.py [--calls 300] [--json PATH]

Each figure: N back-to-back calls timed on the host clock (time.perf_counter), then one synchronize
outside the timed region (kdsl.bench.timing.host_time_us, the same measure `kdsl bench` prints); the
shapes are decode-sized, so the kernels finish sooner than the host issues them and the host is what is
measured. The cases beyond the bench's: act_quant + fp8_gemm against one bf16 F.linear.
"""
from __future__ import annotations

import argparse
import json

import torch

import kdsl
from kdsl.bench.timing import host_time_us


def cases():
    ops = kdsl.ops
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16)
    a, a_s = ops.act_quant(x)
    b, b_s = ops.weight_quant(w)
    a4 = torch.cat([a, a, a, a]).contiguous()  # _scaled_mm wants M a multiple of 4
    a4_s = torch.cat([a_s, a_s, a_s, a_s]).t().contiguous().t()
    yield "act_quant M=1 K=7168", lambda: ops.act_quant(x), "-", None
    yield ("fp8_gemm M=1 N=2112 K=7168", lambda: ops.fp8_gemm(a, a_s, b, b_s),
           "torch._scaled_mm (M=4)", lambda: torch._scaled_mm(a4, b.t(), scale_a=a4_s, scale_b=b_s.t(),
                                                            out_dtype=torch.bfloat16))
    yield ("act_quant+fp8_gemm M=1", lambda: ops.fp8_gemm(*ops.act_quant(x), b, b_s),
           "F.linear bf16", lambda: torch.nn.functional.linear(x, w))
    wh = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    ck = ops.gptq_quantize(wh)
    prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None)
    xh = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    wt = wh.t().contiguous()
    yield ("gptq_gemm[prepared] M=1 4096x4096", lambda: ops.gptq_gemm(xh, prepared),
           "fp16 x @ w", lambda: xh @ wt)
    yield ("gptq_gemm[checkpoint] M=1 4096x4096",
           lambda: ops.gptq_gemm(xh, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"]), "-", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = []
    for name, fn, base_name, base in cases():
        mine = host_time_us(fn, args.calls)
        theirs = host_time_us(base, args.calls) if base else None
        rows.append({"case": name, "kdsl_us": mine, "baseline": base_name, "baseline_us": theirs})
        ratio = f"{mine / theirs:5.2f}x" if theirs else "   - "
        print(f"{name:38s} kdsl {mine:7.1f} us   {base_name:24s} {theirs or float('nan'):7.1f} us   {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "kdsl": kdsl.__file__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
