"""Ragged shapes for compute-sanitizer memcheck: M=1, N=2112, K=7168 and friends."""
import torch

import kdsl
from kdsl import ops

torch.manual_seed(0)
# (1, 72, 384) ends mid-tile and mid-step. (40, 16400, 384): the wide-N tile of M <= 64 (n_min),
# 16 columns past whole tiles. (300, 2112, 384) and (4100, 1000, 384): the Gluon deferred-rescale
# tiles of M <= 512 and above, ragged in M and N, three K blocks (the odd tail); (520, 136, 256): two.
for m, n, k in [(1, 2112, 7168), (3, 72, 256), (1, 576, 7168), (1, 72, 384), (100, 2112, 7168), (130, 72, 384), (40, 16400, 384),
                (300, 2112, 384), (4100, 1000, 384), (520, 136, 256)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = ops.weight_quant(w)
    xq, xs = ops.act_quant(x)
    ops.fp8_gemm(xq, xs, wq, ws)
    ops.weight_dequant(wq, ws)
# K = 384: a partial GEMV block; N = 8200: the wide-N tile of M > 64 (n_min), one column past whole tiles.
for m, k, n in [(1, 4096, 4104), (5, 256, 40), (1, 384, 72), (1, 384, 8200)]:
    ck = ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16), group_size=128)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"])
    ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"].flip(0).contiguous())
    ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"])
    for g_idx in (None, ck["g_idx"].flip(0).contiguous()):  # prepared, plain and act-order
        prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], g_idx)
        for rows in sorted({1, m, 33, 130}):  # every tile bucket (1: the GEMV), split-K included
            ops.gptq_gemm(torch.randn(rows, k, device="cuda", dtype=torch.float16), prepared)
# One group (group_size -1): K = 200 is not whole 128-row tiles, so the GEMV's x pairs stop mid-tile.
ck = ops.gptq_quantize(torch.randn(136, 200, device="cuda", dtype=torch.float16), group_size=-1)
prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], group_size=-1)
for rows in (1, 5, 40, 300):  # 40 and 300: the Gluon overlap_gluon tiles, K not a whole block
    ops.gptq_gemm(torch.randn(rows, 200, device="cuda", dtype=torch.float16), prepared)
torch.cuda.synchronize()
print("ragged shapes ran on", torch.cuda.get_device_name(), "via", kdsl.registry.select("fp8_gemm", kdsl.BlockFP8()).name)
