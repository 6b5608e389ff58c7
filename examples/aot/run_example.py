"""Write inputs for aot_example, run it, and compare its outputs with kdsl.ops (on the GPU).

    python examples/aot/run_example.py --exe ./aot_example --export DIR [--work /tmp/aot_example_data] [--quick]

DIR is the `python -m kdsl aot` folder the program was built from. Checks, per (M, N, K):
  act_quant q and s from C == kdsl.ops.act_quant, bit for bit (one kernel: the same cubin ran);
  fp8_gemm c from C == the same kernel and tile launched from Python (the generated module's launch(), with
  the tile the export's dispatcher routes the call to: on sm_90 tma_persistent's Triton wgmma tiles, the
  alternatives of the Gluon tiles the export leaves out included), bit for bit;
  against kdsl.ops' default and an fp32 dequantize-then-matmul reference, the relative error is printed;
  kdsl.ops with kdsl.aot.load(DIR) (exported cubins from Python; TMA kernels go to the JIT) == the JIT,
  bit for bit, with the registry routed to the portable kernel (KDSL_DISABLE=*tma_persistent*).
Prints host time per call from Python (JIT and AOT) beside the C program's. Exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CASES = [(m, n, 7168) for m in (1, 16, 4096) for n in (2112, 7168)] + [(64, 2112, 7168), (128, 7168, 7168)]
QUICK = [(1, 2112, 7168), (16, 2112, 7168), (129, 7168, 7168)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def reference(q, s, w, ws):
    """fp32 dequantize-then-matmul: a [M, K] * per-128 scales, w [N, K] * per-128x128 scales."""
    a = q.float() * s.repeat_interleave(128, dim=1)[:, : q.shape[1]]
    b = w.float() * ws.repeat_interleave(128, dim=0)[: w.shape[0]].repeat_interleave(128, dim=1)[:, : w.shape[1]]
    return a @ b.T


def host_us(fn, calls=200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exe", type=Path, required=True)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/aot_example_data"))
    parser.add_argument("--quick", action="store_true", help="three small cases (for compute-sanitizer)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import kdsl
    import kdsl.aot
    from kdsl import ops
    from kdsl.runtime import registry

    cases = QUICK if args.quick else CASES
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    inputs, weights = {}, {}
    for m, n, k in cases:
        if (m, k) not in inputs:
            inputs[m, k] = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            inputs[m, k].cpu().view(torch.uint8).numpy().tofile(work / f"x_{m}_{k}.bin")
        if (n, k) not in weights:
            w, ws = ops.weight_quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05)
            weights[n, k] = (w, ws)
            w.cpu().view(torch.uint8).numpy().tofile(work / f"w_{n}_{k}.bin")
            ws.cpu().numpy().tofile(work / f"ws_{n}_{k}.bin")
    (work / "cases.txt").write_text("".join(f"{m} {n} {k}\n" for m, n, k in cases))

    done = subprocess.run([str(args.exe), str(work), str(args.calls)], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return 1

    def read(name, dtype, shape):
        data = torch.from_file(str(work / name), size=int(torch.tensor(shape).prod()) * dtype.itemsize,
                               dtype=torch.uint8)
        return data.view(dtype).view(*shape).cuda()

    import json

    from kdsl.aot import abi as abis
    from kdsl.aot.plan import route

    # The kernel and tile the export's sm_XY dispatcher gives each call (its entry, else its fallback).
    arch = registry.device_arch()
    exported = {o["arch"]: o for o in json.loads((args.export / "aot_manifest.json").read_text())["ops"]
                if o["op"] == "fp8_gemm"}
    record = exported[f"sm_{arch}"]
    by_name = {e.name: e for e in registry.entries()}

    failures = 0
    expected = {}
    for m, n, k in cases:
        x = inputs[m, k]
        w, ws = weights[n, k]
        q_c = read(f"q_{m}_{k}.out", torch.float8_e4m3fn, (m, k))
        s_c = read(f"s_{m}_{k}.out", torch.float32, (m, k // 128))
        c_c = read(f"c_{m}_{n}_{k}.out", torch.bfloat16, (m, n))
        q, s = ops.act_quant(x)
        call = dict(M=m, N=n, K=k, lda=k, ldb=k, ldc=n, lda_s=k // 128, ldb_s=k // 128, out_dtype="bf16",
                    a=16, b=16, c=16, a_s=16, b_s=16)  # the C program's allocations: aligned
        entry = by_name[record["entry"]]
        bucket = route(abis.OPS["fp8_gemm"], entry, call)
        if bucket is None:
            entry = by_name[record["fallback"]["entry"]]
            bucket = route(abis.OPS["fp8_gemm"], entry, call)
        tile = entry.tiles[bucket].params
        c_same = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        entry.launch(q, s, w, ws, c_same, tile)
        c_default = ops.fp8_gemm(q, s, w, ws)
        default = registry.select("fp8_gemm", arch=arch)
        default_tile = default.tile_for(m, n)
        ref = reference(q, s, w, ws)
        same_q = torch.equal(bits(q_c), bits(q)) and torch.equal(bits(s_c), bits(s))
        same_c = torch.equal(bits(c_c), bits(c_same))
        rel = ((c_c.float() - ref).norm() / ref.norm()).item()
        rel_default = ((c_c.float() - c_default.float()).norm() / c_default.float().norm()).item()
        print(f"M={m} N={n} K={k}: act_quant bit-exact {same_q}; fp8_gemm ran {entry.name} tile {bucket} "
              f"({tile['impl']}, {tile['BLOCK_M']}x{tile['BLOCK_N']}), bit-exact vs the same from Python {same_c}; "
              f"rel err vs fp32 reference {rel:.2e}; vs kdsl.ops default ({default_tile['impl']}) {rel_default:.2e}")
        failures += (not same_q) + (not same_c) + (rel > 1e-2)

    for m, n, k in cases:  # host time of kdsl.ops' default route (compare with the C program's 'case' lines)
        q, s = ops.act_quant(inputs[m, k])
        w, ws = weights[n, k]
        print(f"M={m} N={n} K={k}: host us/call kdsl.ops.fp8_gemm (JIT, default registry) "
              f"{host_us(lambda: ops.fp8_gemm(q, s, w, ws), args.calls):.2f}")

    os.environ["KDSL_DISABLE"] = "*tma_persistent*"
    registry.reset()
    for m, n, k in cases:  # what kdsl.aot.load must reproduce: the portable kernel through the JIT
        q, s = ops.act_quant(inputs[m, k])
        w, ws = weights[n, k]
        expected[m, n, k] = (q, s, ops.fp8_gemm(q, s, w, ws))
    os.environ.pop("KDSL_DISABLE")
    registry.reset()

    # kdsl.ops with the exported cubins (no compilation), the registry routed like the export.
    os.environ["KDSL_DISABLE"] = "*tma_persistent*"
    registry.reset()
    m, n, k = cases[0]
    x = inputs[m, k]
    w, ws = weights[n, k]
    jit_act = host_us(lambda: ops.act_quant(x), args.calls)
    q, s = ops.act_quant(x)
    jit_gemm = host_us(lambda: ops.fp8_gemm(q, s, w, ws), args.calls)
    kdsl.aot.load(args.export)
    before = kdsl.aot.stats()
    for (m, n, k), (q_c, s_c, c_c) in expected.items():
        q, s = ops.act_quant(inputs[m, k])
        w, ws = weights[n, k]
        c = ops.fp8_gemm(q, s, w, ws)
        same = torch.equal(bits(q), bits(q_c)) and torch.equal(bits(s), bits(s_c)) and torch.equal(bits(c), bits(c_c))
        print(f"M={m} N={n} K={k}: kdsl.ops through kdsl.aot.load == the JIT (portable), bit for bit: {same}")
        failures += not same
    after = kdsl.aot.stats()
    print(f"kdsl.ops launches through exported cubins: {after['aot'] - before['aot']}, "
          f"through the JIT: {after['jit'] - before['jit']}")
    m, n, k = cases[0]
    x = inputs[m, k]
    w, ws = weights[n, k]
    aot_act = host_us(lambda: ops.act_quant(x), args.calls)
    q, s = ops.act_quant(x)
    aot_gemm = host_us(lambda: ops.fp8_gemm(q, s, w, ws), args.calls)
    print(f"host us/call at M={m} N={n} K={k} from Python: JIT act_quant {jit_act:.2f} fp8_gemm {jit_gemm:.2f}; "
          f"kdsl.aot.load act_quant {aot_act:.2f} fp8_gemm {aot_gemm:.2f} (C: the 'case' lines above)")
    print("FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
