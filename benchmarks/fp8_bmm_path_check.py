"""Why kdsl bench's fp8_bmm figures can differ from fp8_bmm_sweep.py's for the same tile: one process, one GPU.

    python benchmarks/fp8_bmm_path_check.py [OUT.json]

For a few MLA cells, the bench's inputs (kdsl.bench.timing's quantizers, weights cycled cold) and five ways
to run the same registry tile, each timed with triton.testing.do_bench_cudagraph (default rep, as the bench):
  op_fresh        kdsl.ops.fp8_bmm returning a new output per call (what kdsl bench times)
  op_out          kdsl.ops.fp8_bmm(..., out=c), one output buffer reused
  launch_reused   the module's launch() into one reused output (what fp8_bmm_sweep.py times)
  launch_fresh    the module's launch() into a new output per call
and bf16 torch.bmm (the bench's baseline) before them, then the bench's cuBLAS blockwise loop (a long, busy
graph), then op_fresh and bf16 again: whether what ran before changes the figure.
"""
import json
import sys

import torch
import triton.testing as tt

import kdsl
from kdsl import registry
from kdsl.bench import timing

CELLS = [(128, 128, 512, 1), (128, 128, 512, 64), (128, 512, 128, 128), (128, 512, 128, 1), (16, 512, 128, 1),
         (16, 128, 512, 128)]


def graph_us(fn, calls):
    return 1e3 * tt.do_bench_cudagraph(fn, return_mode="median") / calls


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "fp8_bmm_path_check.json"
    entry = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90")
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    for batch, n, k, m in CELLS:
        torch.manual_seed(batch + n + m)
        x = torch.randn(m, batch, k, device="cuda", dtype=torch.bfloat16)
        q, s = timing.torch_act_quant(x.view(m * batch, k))
        a, a_s = q.view(m, batch, k).transpose(0, 1), s.view(m, batch, k // 128).transpose(0, 1)
        quantized = [timing.torch_weight_quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
                     for _ in range(batch)]
        b = torch.stack([wq for wq, _ in quantized])
        b_s = torch.stack([ws for _, ws in quantized])
        w16 = torch.stack([timing.fp8_weight_reference(wq, ws) for wq, ws in quantized]).to(torch.bfloat16)
        copies = min(timing.MAX_COPIES, -(-timing.COLD_BYTES // b.numel()))
        weights = [(b, b_s, w16)] + [(b.clone(), b_s.clone(), w16.clone()) for _ in range(copies - 1)]
        x_t = x.transpose(0, 1)
        c = torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)
        tile = entry.tile_for(m, n)
        module = entry.modules[tile["impl"]].load()
        fns = {
            "bf16": lambda: [torch.bmm(x_t, w.transpose(1, 2)) for _, _, w in weights],
            "op_fresh": lambda: [kdsl.ops.fp8_bmm(a, a_s, bq, bs) for bq, bs, _ in weights],
            "op_out": lambda: [kdsl.ops.fp8_bmm(a, a_s, bq, bs, out=c) for bq, bs, _ in weights],
            "launch_reused": lambda: [module.launch(a, a_s, bq, bs, c, tile) for bq, bs, _ in weights],
            "launch_fresh": lambda: [module.launch(a, a_s, bq, bs, torch.empty_like(c), tile) for bq, bs, _ in weights],
        }
        scaled = [[timing.scaled_mm_baseline(a[g], a_s[g], bq[g], bs[g]) for g in range(batch)]
                  for bq, bs, _ in weights]
        row = {"batch": batch, "n": n, "k": k, "m": m, "copies": copies, "tile": tile}
        for name in ("bf16", "op_fresh", "op_out", "launch_reused", "launch_fresh"):
            row[name + "_us"] = graph_us(fns[name], copies)
        row["cublas_loop_us"] = graph_us(lambda: [[fn() for fn in loop] for loop in scaled], copies)
        row["op_fresh_after_us"] = graph_us(fns["op_fresh"], copies)
        row["bf16_after_us"] = graph_us(fns["bf16"], copies)
        rows.append(row)
        print(f"B={batch} N={n} K={k} M={m}: " + " | ".join(
            f"{key[:-3]} {val:.2f}" for key, val in row.items() if key.endswith("_us"))
            + f" | op_fresh vs bf16 {row['bf16_us'] / row['op_fresh_us']:.2f}x, launch_reused vs bf16 "
            f"{row['bf16_us'] / row['launch_reused_us']:.2f}x", flush=True)
        del weights, scaled, fns
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
