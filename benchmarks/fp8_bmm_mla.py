"""fp8_bmm at DeepSeek-V3 MLA shapes against bf16 torch.bmm, CUDA-graph medians, one process (the registry's
kernel: the portable one when this was written; sm_90 now picks tma_persistent, see `kdsl bench --op fp8_bmm`).

    python benchmarks/fp8_bmm_mla.py

B = 128 heads; (N, K) = (512, 128) and (128, 512); a is the transpose(0, 1) view of a [M, B, K] tensor, as
MLA passes it. Bytes: fp8 a and b, float32 scales, bf16 output; the fraction is of a device copy's bandwidth
measured in the same run.
"""
import torch
import triton.testing as tt

import kdsl

B = 128


def main():
    copy_src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = tt.do_bench_cudagraph(lambda: copy_dst.copy_(copy_src), return_mode="median")
    bandwidth = 2 * copy_src.numel() / (copy_ms * 1e-3)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for n, k in ((512, 128), (128, 512)):
        for m in (1, 64, 512, 4096):
            x = torch.randn(m, B, k, device="cuda", dtype=torch.bfloat16)
            q, s = kdsl.ops.act_quant(x)  # [M, B, K], [M, B, K/128]
            a, a_s = q.transpose(0, 1), s.transpose(0, 1)
            w = torch.randn(B, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            wq, ws = zip(*(kdsl.ops.weight_quant(w[i]) for i in range(B)))
            b, b_s = torch.stack(wq), torch.stack(ws)
            ours = tt.do_bench_cudagraph(lambda: kdsl.ops.fp8_bmm(a, a_s, b, b_s), return_mode="median")
            xt, wt = x.transpose(0, 1), w.transpose(1, 2)
            theirs = tt.do_bench_cudagraph(lambda: torch.bmm(xt, wt), return_mode="median")
            moved = a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * B * m * n
            ref = torch.bmm(xt.float(), w.float().transpose(1, 2))
            err = ((kdsl.ops.fp8_bmm(a, a_s, b, b_s).float() - ref).norm() / ref.norm()).item()
            print(f"N={n} K={k} M={m:5d}: fp8_bmm {ours * 1e3:8.1f} us, bf16 bmm {theirs * 1e3:8.1f} us, "
                  f"ratio {theirs / ours:5.2f}x, {moved / (ours * 1e-3) / bandwidth:5.1%} of copy bandwidth, "
                  f"rel err vs fp32 {err:.3f}")


if __name__ == "__main__":
    main()
