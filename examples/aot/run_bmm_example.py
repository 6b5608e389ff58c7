"""Write MLA inputs for bmm_example, run it, and compare its outputs with kdsl.ops.fp8_bmm (on the GPU).

    python examples/aot/run_bmm_example.py --exe ./bmm_example [--work /tmp/aot_bmm_data] [--quick]

Per (B, M, N, K, offset): activations [M, B, K] quantized by kdsl.ops.act_quant, read as the transposed [B, M, K]
view by both; c from C == kdsl.ops.fp8_bmm(out=c stored `offset` bytes past a 16-byte boundary), bit for bit (the
registry's tile for the operands: on sm_90 the TMA kernel for aligned ones, its portable alternative for an
8-byte offset, which TMA refuses), and the relative error against an fp32 reference. Prints the host time
per call of kdsl.ops.fp8_bmm beside the C program's. Exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

CASES = [(16, m, n, k, 0) for m in (1, 64, 4096) for n, k in ((512, 128), (128, 512))] + \
        [(128, m, n, k, 0) for m in (1, 64) for n, k in ((512, 128), (128, 512))] + \
        [(16, m, 512, 128, 8) for m in (1, 64)]
QUICK = [(16, 5, 512, 128, 0), (16, 64, 128, 512, 0), (16, 5, 512, 128, 8)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def host_us(fn, calls=200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def save(t: torch.Tensor, path: Path) -> None:
    t.contiguous().cpu().view(torch.uint8).numpy().tofile(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exe", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/aot_bmm_data"))
    parser.add_argument("--quick", action="store_true", help="two small cases (for compute-sanitizer)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    from kdsl import ops
    from kdsl.runtime import registry

    cases = QUICK if args.quick else CASES
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    inputs, weights = {}, {}  # one file per (B, M, K) and per (B, N, K): cases share them
    for heads, m, n, k, _ in cases:
        if (heads, m, k) not in inputs:
            a, a_s = ops.act_quant(torch.randn(m, heads, k, device="cuda", dtype=torch.bfloat16))  # [M, B, K]
            save(a, work / f"a_{heads}_{m}_{k}.bin")
            save(a_s, work / f"as_{heads}_{m}_{k}.bin")
            inputs[heads, m, k] = a, a_s
        if (heads, n, k) not in weights:
            w = torch.randn(heads, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
            b, b_s = zip(*(ops.weight_quant(w[h]) for h in range(heads)))
            b, b_s = torch.stack(b), torch.stack(b_s)
            save(b, work / f"b_{heads}_{n}_{k}.bin")
            save(b_s, work / f"bs_{heads}_{n}_{k}.bin")
            weights[heads, n, k] = b, b_s
    (work / "bmm_cases.txt").write_text("".join(f"{h} {m} {n} {k} {o}\n" for h, m, n, k, o in cases))

    done = subprocess.run([str(args.exe), str(work), str(args.calls)], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return 1

    from kdsl.ops import _checks as check

    entry = registry.select("fp8_bmm", arch=registry.device_arch())
    failures = 0
    for heads, m, n, k, offset in cases:
        a, a_s = inputs[heads, m, k]
        b, b_s = weights[heads, n, k]
        raw = torch.from_file(str(work / f"c_{heads}_{m}_{n}_{k}_{offset}.out"), size=heads * m * n * 2,
                              dtype=torch.uint8)
        c_c = raw.view(torch.bfloat16).view(heads, m, n).cuda()
        at, ast = a.transpose(0, 1), a_s.transpose(0, 1)
        buffer = torch.empty(heads * m * n + 8, device="cuda", dtype=torch.bfloat16)
        out = buffer[offset // 2:offset // 2 + heads * m * n].view(heads, m, n)
        c = ops.fp8_bmm(at, ast, b, b_s, out=out)
        facts = registry.Call(m=m, n=n, device_type="cuda", dtype="float8_e4m3fn", align=check.alignment(at, b, out))
        tile = entry.tile_for(m, n, facts)
        ref = torch.einsum("bmk,bnk->bmn", at.float() * ast.repeat_interleave(128, dim=2),
                           b.float() * b_s.repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2))
        same = torch.equal(bits(c_c), bits(c))
        rel = ((c_c.float() - ref).norm() / ref.norm()).item()
        python_us = host_us(lambda: ops.fp8_bmm(at, ast, b, b_s, out=out), args.calls)
        print(f"B={heads} M={m} N={n} K={k} offset={offset}: {entry.name} tile {tile['impl']} "
              f"{tile['BLOCK_M']}x{tile['BLOCK_N']}; bit-exact vs kdsl.ops.fp8_bmm {same}; rel err vs fp32 reference "
              f"{rel:.2e}; host us/call kdsl.ops.fp8_bmm {python_us:.2f}")
        failures += (not same) + (rel > 1e-2)
    print("FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
