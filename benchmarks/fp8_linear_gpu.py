"""GPU time of fp8_linear (act_quant fused into the fp8 GEMM) against act_quant + fp8_gemm, CUDA-graph replay.

    python benchmarks/fp8_linear_gpu.py [--ms 1,16,64] [--json PATH] [--sweep]

At the `kdsl bench` fp8_gemm shapes (kdsl.bench.shapes, deepseek-v3), x bf16 [M, K], the weights quantized with
weight_quant; each callable is called once eagerly (compiles, records its launch plan, grows split-K scratch)
and then timed with kdsl.bench.timing.measure (triton.testing.do_bench_cudagraph, median), bf16 F.linear on the
same x alongside. The fused result is checked against the unfused one (relative Frobenius error) first.
--sweep also times candidate tiles of the fused kernel (module.launch into a preallocated output, CUDA-graph
replay, triton.testing.do_bench_cudagraph as measure uses it): the tiles kernel_defs/block_fp8.toml picks from.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

import kdsl
from kdsl.bench.timing import measure
from kdsl.codegen.render import tile_params
from kdsl.kernels.block_fp8.fp8_linear_portable import IMPL
from kdsl.schema.tiling import Tile

SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
# (block_m, block_n, num_warps, num_stages, split_k): split_k is the cap split_for plans under
CANDIDATES = [(16, 64, 4, 4, 8), (16, 128, 4, 3, 8), (16, 128, 8, 3, 8), (32, 128, 4, 3, 8), (64, 64, 8, 2, 4),
              (64, 128, 8, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,16,64")
    parser.add_argument("--json")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    module = kdsl.registry.dispatch("fp8_linear", kdsl.BlockFP8().name, torch.device("cuda")).load()
    ops = kdsl.ops
    cuda = torch.device("cuda")
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16)
        b, b_s = ops.weight_quant(w)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
            fused = lambda: ops.fp8_linear(x, b, b_s)  # noqa: E731
            unfused = lambda: ops.fp8_gemm(*ops.act_quant(x), b, b_s)  # noqa: E731
            dense = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            y, y0 = fused(), unfused()
            dense()
            torch.cuda.synchronize()
            err = ((y.double() - y0.double()).norm() / y0.double().norm()).item()
            t = {name: measure(fn, graph=True, host=False) for name, fn in
                 (("fp8_linear", fused), ("act_quant+fp8_gemm", unfused), ("F.linear bf16", dense))}
            row = {"m": m, "n": n, "k": k, "rel_err_vs_unfused": err,
                   "tile": kdsl.registry.dispatch("fp8_linear", kdsl.BlockFP8().name, cuda).tile_for(m, n),
                   **{f"{name} graph_us": None if v.graph_ms is None else v.graph_ms * 1e3 for name, v in t.items()},
                   **{f"{name} eager_us": None if v.eager_ms is None else v.eager_ms * 1e3 for name, v in t.items()}}
            if args.sweep:
                for bm, bn, warps, stages, split in CANDIDATES:
                    tile = tile_params(Tile(block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages,
                                            split_k=split), IMPL)
                    out = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
                    launch = lambda tile=tile, out=out: module.launch(x, b, b_s, None, out, tile)  # noqa: E731
                    launch()
                    err_tile = ((out.double() - y0.double()).norm() / y0.double().norm()).item()
                    us = triton.testing.do_bench_cudagraph(launch, return_mode="median") * 1e3
                    row[f"tile {bm}x{bn} w{warps} s{stages} k{split} graph_us"] = us
                    row[f"tile {bm}x{bn} w{warps} s{stages} k{split} rel_err"] = err_tile
            rows.append(row)
            g = lambda name: row[f"{name} graph_us"] or float("nan")  # noqa: E731
            print(f"M={m:4d} N={n:5d} K={k:5d}  fp8_linear {g('fp8_linear'):7.1f} us  act_quant+fp8_gemm "
                  f"{g('act_quant+fp8_gemm'):7.1f} us  ratio {g('fp8_linear') / g('act_quant+fp8_gemm'):5.2f}  "
                  f"F.linear {g('F.linear bf16'):7.1f} us  err {err:.1e}", flush=True)
            if args.sweep:
                print("    " + "  ".join(f"{key.removeprefix('tile ').removesuffix(' graph_us')}: {v:.1f}"
                                      for key, v in row.items() if key.startswith("tile ") and key.endswith("graph_us")),
                      flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                              indent=1)


if __name__ == "__main__":
    main()
