"""Seconds taken by the first call of an op on a new (N, K) in a fresh process (issue 4's bar:
no runtime sweep, only compilation, <= 2 s on a warm Triton cache). Run it twice: the first run
fills Triton's cache (cold), the second shows the warm figure.

    python benchmarks/first_call.py 4096 7168
"""
import sys
import time

import torch

import kdsl
from kdsl import ops

n, k = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
wq, ws = ops.weight_quant(w)
xq, xs = ops.act_quant(x)
torch.cuda.synchronize()
start = time.perf_counter()
ops.fp8_gemm(xq, xs, wq, ws)
torch.cuda.synchronize()
print(f"fp8_gemm first call M=16 N={n} K={k}: {time.perf_counter() - start:.2f} s")

ck = ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16))
prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"])
x16 = torch.randn(1, k, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
start = time.perf_counter()
ops.gptq_gemm(x16, prepared)
torch.cuda.synchronize()
print(f"gptq_gemm[prepared] first call M=1 N={n} K={k}: {time.perf_counter() - start:.2f} s")
print("kdsl", kdsl.__name__, "on", torch.cuda.get_device_name())
