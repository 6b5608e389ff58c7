"""The manual tile sweep that `python -m kdsl tune` replaces; use the command.

    python -m kdsl tune --op fp8_gemm|gptq_gemm|gptq_gemm_prepared [--bucket M_MAX ...] [--write]

searches each M bucket's tiles, checks them against the fp32 references, scores them over the
preset's shapes, and writes the winners into kernel_defs/ (see README.md, "Tuning"). This script
stays for act_quant (which the command does not tune) and to reproduce
benchmarks/results/tile_sweep_h200.txt: it launches the generated modules directly with fixed
candidate lists and prints the best three per (op, M, shape); winners are copied by hand.
"""
import itertools
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import kdsl
from kdsl import ops, registry
from kdsl.codegen.render import tile_params
from kdsl.schema.tiling import Tile
from kdsl.bench.timing import scaled_mm_baseline


def tile(bm, bn, bk, warps, stages, group_m=8, split_k=1, persistent=False, order="m_major", swap=False, ws=False):
    """A candidate as the generated modules read it, built through the schema's own Tile."""
    return tile_params(Tile(block_m=bm, block_n=bn, block_k=bk, group_m=group_m, split_k=split_k, num_warps=warps,
                            num_stages=stages, persistent=persistent, tile_order=order, swap_ab=swap,
                            warp_specialize=ws))


def baseline(label, fn, graph):
    ms = (do_bench_cudagraph if graph else do_bench)(fn, return_mode="median")
    print(f"{label}: {ms * 1e3:8.1f} us  baseline")
    return ms


def best(label, run, candidates, graph, base_ms=None, check=None):
    """Time every candidate; print the best three. check(): relative error of the last run,
    taken for each candidate so a fast wrong tile is shown as wrong."""
    results = []
    for cand in candidates:
        try:
            run(cand)
            torch.cuda.synchronize()
            errs = {id(cand): check()} if check else {}
            ms = (do_bench_cudagraph if graph else do_bench)(lambda: run(cand), return_mode="median")
        except Exception as error:  # out of resources etc.
            print(f"  {label} {cand}: {type(error).__name__}", file=sys.stderr)
            continue
        results.append((ms, cand, errs.get(id(cand))))
    results.sort(key=lambda r: r[0])
    for ms, cand, rel in results[:3]:
        err = f" err {rel:.1e}" if rel is not None else ""
        c = cand
        ratio = f" {base_ms / ms:5.2f}x" if base_ms else ""
        print(f"{label}: {ms * 1e3:8.1f} us{ratio}  {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} "
              f"s{c['num_stages']} g{c['GROUP_M']} sk{c['SPLIT_K']} p{int(c['persistent'])} {c['tile_order']} "
              f"swap{int(c['swap_ab'])} ws{int(c['warp_specialize'])}{err}", flush=True)
    return results


def sweep_fp8(which):
    entry = registry.select("fp8_gemm", kdsl.BlockFP8())
    for n, k in [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]:
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        b_s = torch.rand(triton.cdiv(n, 128), k // 128, device="cuda") + 0.5
        for m in which:
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            a_s = torch.rand(m, k // 128, device="cuda") + 0.5
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            graph = m <= 128
            base = baseline(f"fp8_gemm m={m} n={n} k={k}", scaled_mm_baseline(a, a_s, b, b_s), graph)
            if m >= 512:
                cands = [tile(128, 128, 128, 8, s, persistent=True) for s in [3, 4]]
                cands += [tile(128, 256, 128, 8, 3, persistent=p) for p in [False, True]]
                cands += [tile(256, 128, 128, 8, 3, persistent=p) for p in [False, True]]
                cands += [tile(bm, bn, 128, 4, s) for bm, bn, s in
                          [(64, 128, 4), (64, 128, 5), (64, 128, 6), (128, 128, 3), (128, 128, 4), (64, 256, 3), (128, 64, 4)]]
                cands += [tile(128, 128, 128, 8, 2), tile(128, 128, 128, 8, 3)]
            else:
                cands = [tile(64, bn, 128, 4, s, split_k=sk)
                         for bn, s, sk in itertools.product([32, 64, 128], [4, 6], [1, 2, 4, 8])]
            best(f"fp8_gemm m={m} n={n} k={k}", lambda t: entry.launch(a, a_s, b, b_s, c, t), cands, graph, base)


def sweep_gptq_prepared(ms=(1, 16, 64, 256)):
    entry = registry.select("gptq_gemm_prepared", kdsl.GPTQ())
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        ck = ops.gptq_quantize(w)
        prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"])
        w16 = ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"]).T.contiguous()  # [K, N]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            graph = m <= 128
            base = baseline(f"gptqp m={m} k={k} n={n}", lambda: torch.matmul(x, w16), graph)
            if m == 1:  # block_m = 1: the CUDA-core GEMV
                cands = [tile(1, bn, bk, wp, 1, split_k=sk) for bn, bk, sk, wp in
                         itertools.product([64, 128], [256, 512, 1024], [2, 4], [4, 8])]
                cands.append(tile(16, 128, 128, 4, 3, split_k=8))
            elif m <= 16:
                cands = [tile(16, bn, bk, 4, st, split_k=sk) for bn, bk, sk, st in
                         itertools.product([64, 128], [128, 256], [4, 8], [3, 5])]
            elif m <= 64:
                cands = [tile(64, bn, bk, 4, st, split_k=sk) for bn, bk, sk, st in
                         itertools.product([64, 128], [64, 128], [1, 2, 4], [3, 4])]
            else:
                cands = [tile(bm, 128, bk, wp, st, split_k=sk) for bm, bk, wp, sk, st in
                         itertools.product([64, 128], [64, 128], [4, 8], [1, 2], [3, 4])]

            def run(t):
                entry.launch(x, None, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                             True, y, t)
            ref = x.float() @ w16.float()

            def rel_err():
                return ((y.float() - ref).norm() / ref.norm()).item()
            best(f"gptqp m={m} k={k} n={n}", run, cands, graph, base, check=rel_err)


def sweep_gptq():
    entry = registry.select("gptq_gemm", kdsl.GPTQ())
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        ck = ops.gptq_quantize(w)
        for m in [1, 16, 64, 256]:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            if m <= 16:
                cands = [tile(16, bn, 128, 4, 3, split_k=sk) for bn, sk in itertools.product([32, 64, 128], [1, 4, 8])]
            else:
                cands = [tile(bm, bn, 64, w_, 3, split_k=sk) for bm, bn, w_, sk in
                         itertools.product([64, 128], [64, 128], [4, 8], [1, 2])]
            best(f"gptq_gemm m={m} k={k} n={n}",
                 lambda t: entry.launch(x, ck["qweight"], ck["qzeros"], ck["scales"], None, y, t), cands, graph=m <= 128)


def sweep_act_quant():
    entry = registry.select("act_quant", kdsl.BlockFP8())
    for m, k in [(4096, 7168), (16384, 7168)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(m, k // 128, device="cuda")
        cands = [tile(bm, 128, 128, w, 1) for bm, w in itertools.product([4, 8, 16, 32, 64], [1, 2, 4, 8])]
        best(f"act_quant m={m} k={k}", lambda t: entry.launch(x, q, s, t), cands, graph=False)


if __name__ == "__main__":
    what = sys.argv[1:] or ["act_quant", "gptq", "gptq_prepared", "fp8_small", "fp8_large"]
    if "act_quant" in what:
        sweep_act_quant()
    if "gptq" in what:
        sweep_gptq()
    if "gptq_prepared" in what:
        sweep_gptq_prepared()
    if "gptq_prepared_m1" in what:
        sweep_gptq_prepared([1])
    if "fp8_small" in what:
        sweep_fp8([16, 128])
    if "fp8_large" in what:
        sweep_fp8([4096])
