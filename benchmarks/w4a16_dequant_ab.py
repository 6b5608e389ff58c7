"""Where should w4a16_gemm switch to dequantize + cuBLAS (issue 47)? Per (K, N) and M, CUDA-graph medians of:

    gemm     the W4A16 GEMM tile the registry picks for (M, N) below dequant_min_m (launched directly)
    deq+mm   w4a16_dequant's kernel into a scratch w [N, K], then torch.mm(x, w.T) (cuBLAS): the dequant path
    dequant  the dequant kernel alone, with its share of the device copy rate (bytes read + written)
    fp16     torch.mm(x, w16.T) on the fp16 weights (nn.Linear's product): the bar

Each timed call cycles through COPIES sets of weights, so every call reads its weights from DRAM as a model's
layers do (an H100's or H200's 50 MB L2 would otherwise hold a 4096x14336 int4 weight). Every path is checked
against the fp32 product first. The last column says which of gemm and deq+mm is faster; the threshold to
declare (`dequant_min_m` in kernel_defs/w4a16.toml, per arch) is the smallest M from which deq+mm wins on
every shape.

    python benchmarks/w4a16_dequant_ab.py                      # Llama-3-8B shapes, M = 512 1024 2048 8192
    python benchmarks/w4a16_dequant_ab.py --m 256 512 --shapes 4096x14336 14336x4096

(AB_DEVICE=cpu with TRITON_INTERPRET=1 runs the same logic on tiny shapes through Triton's interpreter, timed
with perf_counter: a check of the script, not a measurement.)
"""
import argparse
import os
import statistics
import time

import torch
import triton

import kdsl
from kdsl.ops.w4a16 import DEQUANT_OP, PREPARED_OP
from kdsl.runtime import registry

# (K, N) of Llama-3-8B's linears (qkv, o, gate_up, down) and the bench's 4096x14336.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 14336)]
COPIES = 3
DEVICE = os.environ.get("AB_DEVICE", "cuda")


def median_ms(fn) -> float:
    if DEVICE == "cuda":
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_rate_gbs() -> float:
    """Device-to-device copy rate, GB/s (bytes read + written), on 1 GiB."""
    src = torch.empty(1 << (29 if DEVICE == "cuda" else 20), dtype=torch.float16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    parser.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], metavar="KxN")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    device = torch.device(DEVICE)
    rate = copy_rate_gbs()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter)"
    print(f"{name} (sm_{registry.device_arch(device)}), torch {torch.__version__}, "
          f"triton {triton.__version__}, {args.dtype}; device copy {rate:.0f} GB/s; times in us, CUDA-graph medians")
    # fp16/...: the fp16 product's time over the path's (above 1: faster than fp16)
    print(f"{'K x N':>12} {'M':>5} {'gemm':>8} {'deq+mm':>8} {'dequant':>8} {'(copy%)':>7} {'fp16':>8} "
          f"{'fp16/gemm':>9} {'fp16/deq+mm':>11}  faster")
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        weights = []
        for _ in range(COPIES):
            w = (torch.randn(n, k, device=DEVICE) * 0.02).to(dtype)
            ck = kdsl.ops.gptq_quantize(w, group_size=128)
            prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, group_size=128)
            w16 = kdsl.ops.w4a16_dequant(prepared)  # [N, K]: exactly the quantized weights, in dtype
            weights.append((prepared, w16))
        gemm_entry = registry.dispatch(PREPARED_OP, weights[0][0].scheme, device)
        dequant_entry = registry.dispatch(DEQUANT_OP, weights[0][0].scheme, device)
        dequant_tile = dequant_entry.tile_for(None)
        scratch = torch.empty(n, k, device=DEVICE, dtype=dtype)
        moved = k * n // 2 + 2 * k * n + 4 * weights[0][0].scales.numel()  # words, w, scales and zeros
        dequant = lambda p: dequant_entry.launch(p.qweight, p.zeros, p.scales, p.groups,  # noqa: E731
                                                 p.contiguous_groups, scratch, dequant_tile)
        for m in args.m:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            y = torch.empty(m, n, device=DEVICE, dtype=dtype)
            call = registry.Call(m=m, n=n, dtype=str(dtype).removeprefix("torch."))
            tile = gemm_entry.tile_for(m, n, call)

            def gemm(p):
                gemm_entry.launch(x, None, p.qweight, p.zeros, p.scales, p.groups, p.contiguous_groups, y, tile)
                return y

            def deq_mm(p):
                dequant(p)
                return torch.mm(x, scratch.t(), out=y)

            want = x.float() @ weights[0][1].float().T
            for name, fn in (("gemm", gemm), ("deq+mm", deq_mm)):
                error = ((fn(weights[0][0]).float() - want).norm() / want.norm()).item()
                assert error < 1e-2, f"{shape} M={m} {name}: rel err {error:.3g}"
            us = {
                "gemm": median_ms(lambda: [gemm(p) for p, _ in weights]) * 1e3 / COPIES,
                "deq+mm": median_ms(lambda: [deq_mm(p) for p, _ in weights]) * 1e3 / COPIES,
                "dequant": median_ms(lambda: [dequant(p) for p, _ in weights]) * 1e3 / COPIES,
                "fp16": median_ms(lambda: [torch.mm(x, w16.t(), out=y) for _, w16 in weights]) * 1e3 / COPIES,
            }
            copy_share = moved / (us["dequant"] * 1e3) / rate
            faster = "deq+mm" if us["deq+mm"] < us["gemm"] else "gemm"
            print(f"{shape:>12} {m:>5} {us['gemm']:8.1f} {us['deq+mm']:8.1f} {us['dequant']:8.1f} "
                  f"{copy_share:6.0%} {us['fp16']:8.1f} {us['fp16'] / us['gemm']:9.2f} "
                  f"{us['fp16'] / us['deq+mm']:11.2f}  {faster}  (gemm tile: {tile['impl']} "
                  f"{tile['BLOCK_M']}x{tile['BLOCK_N']})")
        del weights, scratch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
