"""kdsl.ops.fp8_bmm on kdsl.ops.act_quant's output at MLA prefill sizes, against fp32 dequantize-then-bmm; and
act_quant against the bench's torch reference quantizer on the same activations.

    python benchmarks/fp8_bmm_large_check.py
"""
import torch

import kdsl
from kdsl.bench.timing import torch_act_quant

for batch, m, n, k in [(16, 4096, 128, 512), (128, 4096, 128, 512), (128, 4096, 512, 128), (16, 2048, 128, 512)]:
    torch.manual_seed(0)
    x = torch.randn(m, batch, k, device="cuda", dtype=torch.bfloat16)
    q, s = kdsl.ops.act_quant(x)
    rq, rs = torch_act_quant(x.view(m * batch, k))
    q_same = (q.view(-1, k).view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
    s_err = ((s.reshape(-1, k // 128) - rs).abs().max()).item()
    a, a_s = q.transpose(0, 1), s.transpose(0, 1)
    w = torch.randn(batch, n, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = zip(*(kdsl.ops.weight_quant(w[g]) for g in range(batch)))
    b, b_s = torch.stack(wq), torch.stack(ws)
    w_deq = b.float() * b_s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)
    ref = torch.bmm(a.float() * a_s.repeat_interleave(128, -1), w_deq.transpose(1, 2))
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
    err = ((c.float() - ref).norm() / ref.norm()).item()
    bad_rows = ((c.float() - ref).abs().amax(dim=(0, 2)) > 0.05 * ref.abs().amax()).nonzero().flatten()
    print(f"B={batch} M={m} N={n} K={k}: q {x.shape} s {tuple(s.shape)} strides {s.stride()}; act_quant vs torch: "
          f"{q_same:.6f} of codes equal, max scale diff {s_err:.3g}; fp8_bmm rel err {err:.3g}; rows off: "
          f"{bad_rows.numel()} (first {bad_rows[:5].tolist()})", flush=True)
    del x, q, s, rq, rs, a, a_s, w, b, b_s, w_deq, ref, c
    torch.cuda.empty_cache()
