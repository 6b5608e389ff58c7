"""The shipped sm_90 fp8_bmm tiles with and without programmatic dependent launch, one process, one GPU.

    python benchmarks/fp8_bmm_pdl_ab.py [OUT.json]

For each (B, N, K) of issue 33 and M in {1, 16, 64, 128, 512, 4096}: the tile the registry picks (through the
generated module's launch()), the same tile with pdl and prefetch_weights off, and bf16 torch.bmm on the
dequantized weights, timed as fp8_bmm_sweep.py times them (CUDA-graph medians; up to M = 512 over calls that
cycle through copies of the weights). In such a graph consecutive fp8_bmm calls are each other's neighbours, so
pdl overlaps one call's start with the previous call's end: the "no pdl" column is what a call gains nothing
from its neighbours. Each tile is checked against the fp32 reference three times (fresh output each time).
"""
import json
import sys

import torch

import kdsl
from kdsl import registry

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_bmm_sweep import COLD_BYTES, MS, SHAPES, timed  # noqa: E402


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "fp8_bmm_pdl_ab.json"
    entry = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90")
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    for batch, n, k in SHAPES:
        for m in MS:
            x = torch.randn(m, batch, k, device="cuda", dtype=torch.bfloat16)
            q, s = kdsl.ops.act_quant(x)
            a, a_s = q.transpose(0, 1), s.transpose(0, 1)
            w = torch.randn(batch, n, k, device="cuda", dtype=torch.bfloat16)
            wq, ws = zip(*(kdsl.ops.weight_quant(w[g]) for g in range(batch)))
            b, b_s = torch.stack(wq), torch.stack(ws)
            w_deq = b.float() * b_s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)
            ref = torch.bmm(a.float() * a_s.repeat_interleave(128, -1), w_deq.transpose(1, 2))
            copies = min(64, -(-COLD_BYTES // b.numel())) if m <= 512 else 1
            weights = [(b, b_s)] + [(b.clone(), b_s.clone()) for _ in range(copies - 1)]
            w16s = [w_deq.to(torch.bfloat16) for _ in range(copies)]
            x_t = x.transpose(0, 1)
            c = torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)
            shipped = entry.tile_for(m, n)
            module = entry.modules[shipped["impl"]].load()
            plain = {**shipped, "pdl": False, "prefetch_weights": False}
            row = {"batch": batch, "m": m, "n": n, "k": k, "copies": copies, "tile": shipped}
            row["bf16_bmm_ms"] = timed([lambda w16=w16: torch.bmm(x_t, w16.transpose(1, 2)) for w16 in w16s], m)
            for name, tile in (("shipped", shipped), ("no_pdl", plain)):
                errs = []
                for _ in range(3):
                    c.fill_(float("nan"))
                    module.launch(a, a_s, b, b_s, c, tile)
                    torch.cuda.synchronize()
                    errs.append(((c.float() - ref).norm() / ref.norm()).item())
                row[name + "_rel_err"] = max(errs)
                row[name + "_ms"] = timed([lambda bq=bq, bs=bs, t=tile: module.launch(a, a_s, bq, bs, c, t)
                                           for bq, bs in weights], m)
            rows.append(row)
            print(f"B={batch} N={n} K={k} M={m}: bf16 {row['bf16_bmm_ms'] * 1e3:.2f} us | shipped "
                  f"{row['shipped_ms'] * 1e3:.2f} us ({row['bf16_bmm_ms'] / row['shipped_ms']:.2f}x, err "
                  f"{row['shipped_rel_err']:.2g}) | no pdl {row['no_pdl_ms'] * 1e3:.2f} us "
                  f"({row['bf16_bmm_ms'] / row['no_pdl_ms']:.2f}x, err {row['no_pdl_rel_err']:.2g}) | pdl "
                  f"{shipped['pdl']}, prefetch {shipped['prefetch_weights']}", flush=True)
            del weights, w16s, ref, w_deq
            torch.cuda.empty_cache()
            with open(out_path, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
