"""Floors under issue 33's fp8_bmm bar, timed as kdsl bench times fp8_bmm (CUDA graphs of back-to-back calls,
each call writing its own output), beside kdsl.ops.fp8_bmm and bf16 torch.bmm in the same process.

    python benchmarks/fp8_bmm_floor.py [OUT.txt]

For each MLA cell: an empty kernel (one program per output tile, with and without programmatic dependent
launch: what a call costs before it moves a byte), a kernel that only writes the call's bf16 output (the
bytes that dominate at M >= 512), torch's zero_ of that output, and the bar's time (bf16 bmm / 1.5 up to
M = 128; roofline / 0.85 from M = 512, the roofline from a measured 1 GiB copy).
"""
import sys

import torch
import triton
import triton.language as tl
import triton.testing as tt
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import kdsl
from kdsl.bench.timing import cold_copies, fp8_bmm_inputs

SHAPES = [(128, 512, 128), (128, 128, 512), (16, 512, 128), (16, 128, 512)]
MS = [1, 16, 64, 128, 512, 4096]


@triton.jit
def _empty(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _write(c_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(c_ptr + offs, tl.zeros([BLOCK], dtype=tl.bfloat16), mask=offs < numel)


def per_call(fns) -> float:
    """us per call of a CUDA graph replaying fns back to back (kdsl bench's graph timing)."""
    return tt.do_bench_cudagraph(lambda: [f() for f in fns], rep=20, return_mode="median") * 1e3 / len(fns)


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rate = 2 * src.numel() / (tt.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    del src, dst
    lines = [f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s; us per call, CUDA graphs",
             "B N K M | fp8_bmm bf16_bmm | bar | empty empty_pdl | write write_pdl zero_ | roofline"]
    for batch, n, k in SHAPES:
        for m in MS:
            x, a, a_s, b, b_s, w, ref = fp8_bmm_inputs(batch, m, n, k)
            x_t = x.transpose(0, 1)
            copies = cold_copies(m, b)
            weights = [(b, b_s)] + [(b.clone(), b_s.clone()) for _ in range(copies - 1)]
            w16s = [w.to(torch.bfloat16) for _ in range(copies)]
            tiles = batch * -(-m // 64) * -(-n // 128)
            numel = batch * m * n
            block = 8192
            new_out = lambda: torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            got = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, err
            t = {
                "fp8_bmm": per_call([lambda bq=bq, bs=bs: kdsl.ops.fp8_bmm(a, a_s, bq, bs) for bq, bs in weights]),
                "bf16_bmm": per_call([lambda w16=w16: torch.bmm(x_t, w16.transpose(1, 2)) for w16 in w16s]),
                "empty": per_call([lambda: _empty[(tiles,)](PDL=False)] * copies),
                "empty_pdl": per_call([lambda: _empty[(tiles,)](PDL=True, launch_pdl=True)] * copies),
                "write": per_call([lambda: _write[(triton.cdiv(numel, block),)](new_out(), numel, BLOCK=block, PDL=False)]
                                  * copies),
                "write_pdl": per_call([lambda: _write[(triton.cdiv(numel, block),)](new_out(), numel, BLOCK=block,
                                                                                   PDL=True, launch_pdl=True)] * copies),
                "zero_": per_call([lambda: new_out().zero_()] * copies),
            }
            bytes_moved = a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * numel
            roofline = 1e6 * bytes_moved / rate
            bar = t["bf16_bmm"] / 1.5 if m <= 128 else roofline / 0.85
            lines.append(f"{batch} {n} {k} {m} | {t['fp8_bmm']:.1f} {t['bf16_bmm']:.1f} | {bar:.1f} | "
                         f"{t['empty']:.1f} {t['empty_pdl']:.1f} | {t['write']:.1f} {t['write_pdl']:.1f} "
                         f"{t['zero_']:.1f} | {roofline:.1f}")
            print(lines[-1], flush=True)
            del weights, w16s, x, a, a_s, b, b_s, w, ref
            torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
