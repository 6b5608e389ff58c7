"""Prepared GPTQ at decode sizes (M = 1, 2, 4, 8, 16) on the bench's four shapes: kdsl.ops (the tile the
definition picks) against the M <= 16 MMA tile forced, and fp16 cuBLAS, in one process. The M <= 8 bucket
runs the mma.sync GEMV below N = 16384; this shows what it gains over the MMA tile that served those rows.

    python benchmarks/gptq_decode_rows.py

CUDA-graph medians (triton.testing.do_bench_cudagraph) in microseconds; relative errors against the fp32
reference.
"""
import torch, triton, triton.testing
import kdsl, kdsl.ops as ops
from kdsl.bench import timing as T

entry = kdsl.registry.dispatch("w4a16_gemm", "w4a16.int4.g128", torch.device("cuda"))
g = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
for K, N in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
    for m in (1, 2, 4, 8, 16):
        inp = T.gptq_gemm_inputs(m, N, K)
        w16 = inp.w_ref.half()
        p = ops.gptq_prepare(inp.qweight, inp.qzeros, inp.scales, None, bits=4, group_size=128)
        err = lambda y: float((y.float() - inp.ref).norm() / inp.ref.norm())
        cub = g(lambda: torch.matmul(inp.x, w16))
        kd = g(lambda: ops.gptq_gemm(inp.x, p))
        mma = entry.tile_for(16, N)
        y = torch.full((m, N), float("nan"), dtype=torch.float16, device="cuda")
        fn = lambda: entry.launch(inp.x, p.perm, p.qweight, p.zeros, p.scales, p.groups, p.contiguous_groups, y, mma)
        fn(); e = err(y); t = g(fn)
        print(f"K={K} N={N} M={m}: cuBLAS {cub:.2f} | kdsl.ops {kd:.2f} ({cub/kd:.2f}x, err {err(ops.gptq_gemm(inp.x, p)):.1e})"
              f" | M<=16 MMA tile {t:.2f} ({cub/t:.2f}x, err {e:.1e}) | ops/MMA {t/kd:.2f}x", flush=True)
