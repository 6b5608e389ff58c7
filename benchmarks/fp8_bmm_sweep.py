"""Tile sweep of fp8_bmm's sm_90 module (tma_persistent) at MLA's shapes, one process, one GPU.

    python benchmarks/fp8_bmm_sweep.py [OUT.json]

For each (B, N, K) of issue 33 and M in {1, 16, 64, 128, 512, 4096}: every candidate tile of M's bucket is
launched through the generated module's launch() (no registry), checked against the bench's fp32
dequantize-then-bmm reference (kdsl.bench.timing.fp8_bmm_inputs; rounds 1-11 built their operands with
kdsl.ops.act_quant and weight_quant here instead), then timed; bf16 torch.bmm on the dequantized weights and the
portable kernel's shipped tile are timed beside them. a is the transpose(0, 1) view of a [M, B, K] tensor.
CUDA-graph medians at every M (as kdsl bench times fp8_bmm); up to M = 512 over calls that cycle through copies of
the weights (each call reads them cold). Prints each cell's best against bf16 bmm and the bandwidth roofline (a measured 1 GiB copy).
"""
import json
import os
import sys

import torch
import triton.testing as tt

import kdsl
from kdsl import registry
from kdsl.bench.timing import fp8_bmm_inputs
from kdsl.codegen.render import tile_params
from kdsl.kernels import find_impl
from kdsl.schema import Tile

SHAPES = [(128, 512, 128), (128, 128, 512), (16, 512, 128), (16, 128, 512)]
MS = [int(m) for m in os.environ.get("FP8_BMM_SWEEP_MS", "1,16,64,128,512,4096").split(",")]
COLD_BYTES = 128 << 20
# FP8_BMM_SWEEP_FRESH=1: each weight copy's call writes its own output tensor, all alive together, as kdsl
# bench's calls of kdsl.ops.fp8_bmm return theirs (one reused output buffer can stay in L2 between calls; a
# callable's distinct outputs are written back to DRAM). Round 5 ran an earlier form that allocated each
# output inside the call and dropped it, so the allocator handed the same block back: a reused buffer again.
FRESH = os.environ.get("FP8_BMM_SWEEP_FRESH") == "1"


def T(bm, bn, warps, stages=3, group_m=8, **options):
    return dict(block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages, group_m=group_m,
                options=options)


P = dict(pdl=True, prefetch_weights=True)  # programmatic dependent launch, weights prefetched into L2 first
S = dict(swap_ab=True)
NP = dict(persistent=False)
PTR = dict(epilogue="pointer")
BI = dict(batch_inner=True)
CANDIDATES = {  # tenth round (H200; rounds 8, 9 and 11 ran on branches): narrower N tiles where few tiles leave
    # SMs idle (16 heads, N = 128: a 64-wide tile gives 32 programs), and more programs per SM or other group sizes
    # for prefill. The shipped tiles of each bucket come first.
    "small": [T(16, 64, 4, 3, **S, flatten=True, programs_per_sm=4, **P), T(16, 64, 4, 2, **S, programs_per_sm=8, pdl=True),
              T(16, 64, 4, 4, **S, flatten=True, programs_per_sm=8, **P, **PTR),
              T(16, 32, 4, 4, flatten=True, programs_per_sm=8, **P, **PTR), T(16, 16, 4, 4, flatten=True, programs_per_sm=8, **P, **PTR),
              T(16, 32, 4, 2, programs_per_sm=8, pdl=True), T(16, 32, 4, 4, **NP, **P, **PTR), T(16, 128, 4, 2, **S, programs_per_sm=4, pdl=True)],
    "64": [T(64, 64, 4, flatten=True, programs_per_sm=4, **P, **PTR), T(64, 128, 4, flatten=True, **P, **PTR),
           T(64, 32, 4, flatten=True, programs_per_sm=8, **P, **PTR), T(64, 16, 4, flatten=True, programs_per_sm=8, **P, **PTR),
           T(64, 32, 4, 4, **NP, **P, **PTR)],
    "128": [T(64, 128, 4, 2, **NP, **P), T(64, 64, 4, 4, **NP, **P, **PTR), T(64, 128, 4, flatten=True),
            T(64, 128, 4, flatten=True, pdl=True, **PTR), T(64, 32, 4, 4, **NP, **P, **PTR),
            T(64, 32, 4, flatten=True, programs_per_sm=8, **P, **PTR), T(64, 64, 4, flatten=True, programs_per_sm=4, pdl=True, **PTR)],
    "large": [T(64, 128, 4, flatten=True), T(64, 128, 4, flatten=True, pdl=True, **PTR),
              T(64, 128, 4, 2, flatten=True, programs_per_sm=3), T(64, 128, 4, 2, flatten=True, programs_per_sm=4),
              T(64, 128, 4, group_m=4, flatten=True), T(64, 128, 4, group_m=16, flatten=True),
              T(64, 128, 8, flatten=True), T(64, 64, 4, flatten=True, programs_per_sm=4)],
}


def bucket(m):
    return "small" if m <= 16 else "64" if m <= 64 else "128" if m <= 128 else "large"


def label(fields):
    opts = ",".join(f"{k}={v}" for k, v in fields["options"].items())
    group = f"g{fields['group_m']}" if fields["group_m"] != 8 else ""
    return (f"{fields['block_m']}x{fields['block_n']}w{fields['num_warps']}s{fields['num_stages']}{group}"
            + (f"[{opts}]" if opts else ""))


def timed(calls, m):
    """ms per call of `calls` (a list of callables run in turn): CUDA-graph medians at every M, as kdsl bench
    times fp8_bmm."""
    fn = lambda: [c() for c in calls]  # noqa: E731
    return tt.do_bench_cudagraph(fn, rep=10, return_mode="median") / len(calls)


def copy_rate():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (tt.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "fp8_bmm_sweep.json"
    tma = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90")
    portable = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_89")
    module, portable_module = tma.load(), portable.load()
    impl = find_impl("fp8_bmm", "tma_persistent")
    rows = []
    global CANDIDATES
    try:  # a programmatic dependent launch captured in a CUDA graph (needs CUDA >= 12.3's programmatic edges)
        a = torch.zeros(1, 16, 128, device="cuda").to(torch.float8_e4m3fn)
        b = torch.zeros(1, 64, 128, device="cuda").to(torch.float8_e4m3fn)
        a_s, b_s = torch.ones(1, 16, 1, device="cuda"), torch.ones(1, 1, 1, device="cuda")
        c = torch.empty(1, 16, 64, device="cuda", dtype=torch.bfloat16)
        tile = tile_params(Tile(**T(16, 64, 4, 2, swap_ab=True, persistent=False, pdl=True, prefetch_weights=True)), impl)
        tt.do_bench_cudagraph(lambda: module.launch(a, a_s, b, b_s, c, tile), rep=5)
        print("pdl: captured and replayed in a CUDA graph", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"pdl: not capturable here ({type(exc).__name__}: {exc}); pdl candidates dropped", flush=True)
        CANDIDATES = {key: [c for c in cands if not c["options"].get("pdl")] for key, cands in CANDIDATES.items()}
    rate = copy_rate()
    print(torch.cuda.get_device_name(), f"copy {rate / 1e12:.2f} TB/s", flush=True)
    for batch, n, k in SHAPES:
        for m in MS:
            x, a, a_s, b, b_s, w_deq, ref = fp8_bmm_inputs(batch, m, n, k)
            copies = min(64, -(-COLD_BYTES // b.numel())) if m <= 512 else 1
            weights = [(b, b_s)] + [(b.clone(), b_s.clone()) for _ in range(copies - 1)]
            w16s = [w_deq.to(torch.bfloat16) for _ in range(copies)]
            x_t = x.transpose(0, 1)
            c = torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)
            row = {"batch": batch, "m": m, "n": n, "k": k, "copies": copies}
            row["roofline_ms"] = 1e3 * (a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * batch * m * n) / rate
            if m >= 512:  # the output's bytes alone, written (zero_) and copied: what the store side can reach
                c2 = torch.empty_like(c)
                row["zero_out_ms"] = tt.do_bench_cudagraph(lambda: c.zero_(), rep=10, return_mode="median")
                row["copy_out_ms"] = tt.do_bench_cudagraph(lambda: c.copy_(c2), rep=10, return_mode="median")
                print(f"  output {c.numel() * 2 / 1e6:.0f} MB: zero_ {row['zero_out_ms'] * 1e3:.1f} us "
                      f"({c.numel() * 2 / row['zero_out_ms'] / 1e9:.2f} TB/s), copy {row['copy_out_ms'] * 1e3:.1f} us "
                      f"({c.numel() * 4 / row['copy_out_ms'] / 1e9:.2f} TB/s)", flush=True)
                del c2
            row["bf16_bmm_ms"] = timed([lambda w16=w16: torch.bmm(x_t, w16.transpose(1, 2)) for w16 in w16s], m)
            ptile = portable.tile_for(m, n)
            row["portable_ms"] = timed([lambda bq=bq, bs=bs: portable_module.launch(a, a_s, bq, bs, c, ptile)
                                        for bq, bs in weights], m)
            results = {}
            for fields in CANDIDATES[bucket(m)]:
                name = label(fields)
                try:
                    tile = tile_params(Tile(**fields), impl)
                    c.fill_(float("nan"))
                    module.launch(a, a_s, b, b_s, c, tile)
                    torch.cuda.synchronize()
                    err = ((c.float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        results[name] = {"error": f"rel err {err:.3g}"}
                        continue
                    outs = [torch.empty_like(c) if FRESH else c for _ in weights]
                    ms = timed([lambda bq=bq, bs=bs, out=out: module.launch(a, a_s, bq, bs, out, tile)
                                for (bq, bs), out in zip(weights, outs)], m)
                    del outs
                    results[name] = {"ms": ms, "rel_err": err}
                except Exception as exc:  # noqa: BLE001 - a candidate that fails is a row
                    results[name] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}
            row["candidates"] = results
            rows.append(row)
            good = {nm: r["ms"] for nm, r in results.items() if "ms" in r}
            best = min(good, key=good.get) if good else None
            print(f"B={batch} N={n} K={k} M={m}: bf16 {row['bf16_bmm_ms'] * 1e3:.1f} us, portable "
                  f"{row['portable_ms'] * 1e3:.1f} us | " + " | ".join(
                      f"{nm} {r['ms'] * 1e3:.1f}" if "ms" in r else f"{nm} ERR {r['error']}" for nm, r in results.items())
                  + (f" || best {best} {good[best] * 1e3:.1f} us = {row['bf16_bmm_ms'] / good[best]:.2f}x bf16, "
                     f"{row['roofline_ms'] / good[best]:.0%} of roofline" if best else ""),
                  flush=True)
            del weights, w16s, ref, w_deq
            torch.cuda.empty_cache()
            with open(out_path, "w") as f:  # after every cell: a run cut short keeps what it measured
                json.dump({"gpu": torch.cuda.get_device_name(), "copy_rate": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
