"""Quick GPU correctness sweep over the issue's shapes (run on the lent GPU; prints a table)."""
import sys
import time

import torch

import kdsl
from kdsl import ops, registry


def rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


def fp8_ref(a_q, a_s, b_q, b_s):
    m, k = a_q.shape
    n = b_q.shape[0]
    a = (a_q.float().view(m, k // 128, 128) * a_s[..., None]).view(m, k)
    b = b_q.float() * b_s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return a @ b.T


def main():
    torch.manual_seed(0)
    bad = 0
    print("arch", registry.device_arch(), registry.select("fp8_gemm", kdsl.BlockFP8()).name)
    for n, k in [(2112, 7168), (7168, 16384), (576, 7168), (72, 256)]:
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = ops.weight_quant(w)
        # scales from an arbitrary source, as a checkpoint's weight_scale_inv
        ws = torch.rand_like(ws) * 1e-3 + 1e-4
        for m in [1, 16, 4096]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = ops.act_quant(x)
            t = time.perf_counter()
            y = ops.fp8_gemm(xq, xs, wq, ws)
            torch.cuda.synchronize()
            e = rel(y, fp8_ref(xq, xs, wq, ws))
            bad += e > 1e-2
            print(f"fp8_gemm m={m} n={n} k={k} err={e:.2e} first-call {time.perf_counter() - t:.2f}s")
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        for gs, act_order in [(128, False), (128, True), (-1, False)]:
            ck = ops.gptq_quantize(w, group_size=gs, sym=False)
            g = ck["g_idx"][torch.randperm(k, device="cuda")].contiguous() if act_order else None
            wd = ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], g, group_size=gs)
            for m in [1, 16, 64, 256]:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                y = ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], g, group_size=gs)
                e = rel(y, x.float() @ wd.float().T)
                bad += e > 1e-2
                print(f"gptq_gemm m={m} k={k} n={n} g={gs} actorder={act_order} err={e:.2e}")
    print("BAD", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
