"""KDSL_AOT from Python with TMA descriptor launches, on the GPU (sm_90).

    python benchmarks/aot_py_tma.py [--export DIR] [--repeat 2]

1. Exports act_quant + fp8_gemm + fp8_bmm for sm_90, bf16 (unless --export names a finished export).
2. One process with Triton's JIT and one with KDSL_AOT=DIR run kdsl.ops.fp8_gemm (the default registry: its
   tma_persistent tiles, and deferred_gluon's Gluon tiles, which are not exported and JIT) and kdsl.ops.fp8_bmm
   (MLA shapes, transposed activations) on the same inputs; outputs compared bit for bit, and per call the
   launches kdsl.aot.stats() counts from cubins and through the JIT.
3. First call on a new shape, fp8_gemm at M = 16 (tma_persistent), N = K = 7168, each in a fresh process with an
   empty TRITON_CACHE_DIR (inputs prepared first, not timed), JIT against KDSL_AOT.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHECK = r"""
import json, sys, torch
import kdsl
from kdsl import ops
from kdsl.runtime import registry
aot = sys.argv[1] == "aot"
import kdsl.aot
torch.manual_seed(0)
K = 7168
weights = {n: ops.weight_quant(torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.05) for n in (2112, 7168)}
acts = {m: ops.act_quant(torch.randn(m, K, device="cuda", dtype=torch.bfloat16)) for m in (1, 16, 64, 128, 4096)}
bmm_w, bmm_a = {}, {}
for heads in (16, 128):
    for n, k in ((512, 128), (128, 512)):
        w = torch.randn(heads, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        b, b_s = zip(*(ops.weight_quant(w[h]) for h in range(heads)))
        bmm_w[heads, n, k] = torch.stack(b), torch.stack(b_s)
        for m in (1, 16, 64, 1024):
            bmm_a[heads, m, k] = ops.act_quant(torch.randn(m, heads, k, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
gemm = registry.select("fp8_gemm")
results, counts = {}, {}
def counted(key, fn):
    before = kdsl.aot.stats()
    results[key] = fn()
    torch.cuda.synchronize()
    after = kdsl.aot.stats()
    counts[key] = (after["aot"] - before["aot"], after["jit"] - before["jit"])
for m in (1, 16, 64, 128, 4096):
    for n in (2112, 7168):
        counted(f"gemm M={m} N={n} ({gemm.tile_for(m, n)['impl']} tile)", lambda: ops.fp8_gemm(*acts[m], *weights[n]))
for heads in (16, 128):
    for n, k in ((512, 128), (128, 512)):
        for m in (1, 16, 64, 1024):
            a, a_s = bmm_a[heads, m, k]
            b, b_s = bmm_w[heads, n, k]
            counted(f"bmm B={heads} M={m} N={n} K={k}", lambda: ops.fp8_bmm(a.transpose(0, 1), a_s.transpose(0, 1), b, b_s))
torch.save({k: v.cpu() for k, v in results.items()}, sys.argv[2])
print("RESULT " + json.dumps({"counts": counts, "loaded": kdsl.aot.loaded() is not None}))
"""

FIRST = r"""
import json, time, torch
import kdsl
from kdsl import ops
import kdsl.aot
N = K = 7168
torch.manual_seed(0)
w, ws = ops.weight_quant(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05)
q, s = ops.act_quant(torch.randn(16, K, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
def timed():
    before = kdsl.aot.stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    ops.fp8_gemm(q, s, w, ws)
    torch.cuda.synchronize()
    after = kdsl.aot.stats()
    return (time.perf_counter() - start) * 1e3, (after["aot"] - before["aot"], after["jit"] - before["jit"])
first, second = timed(), timed()
print("RESULT " + json.dumps({"first_ms": first[0], "first_launches": first[1], "second_ms": second[0]}))
"""


def child(code: str, args: list, export: str | None, fresh_cache: bool) -> dict:
    env = dict(os.environ)
    env.pop("KDSL_AOT", None)
    env.pop("KDSL_DISABLE", None)
    if export:
        env["KDSL_AOT"] = export
    with tempfile.TemporaryDirectory() as cache:
        if fresh_cache:
            env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child failed:\n{done.stderr[-4000:]}")
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", help="a finished export (default: export to a temporary folder)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    import torch
    import triton

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    export = args.export
    if export is None:
        export = tempfile.mkdtemp(prefix="kdsl_aot_")
        start = time.time()
        done = subprocess.run([sys.executable, "-m", "kdsl", "aot", "--arch", "sm_90", "--op", "act_quant", "--op",
                               "fp8_gemm", "--op", "fp8_bmm", "--dtype", "bf16", "--out", export],
                              capture_output=True, text=True)
        print(f"export: exit {done.returncode} after {time.time() - start:.0f} s; "
              + " | ".join(l for l in done.stdout.splitlines() if not l.startswith("[")), flush=True)
        if done.returncode:
            print(done.stderr[-3000:])
            return 1
    export = os.path.abspath(export)

    with tempfile.TemporaryDirectory() as work:
        jit = child(CHECK, ["jit", f"{work}/jit.pt"], None, False)
        aot = child(CHECK, ["aot", f"{work}/aot.pt"], export, False)
        assert aot["loaded"] and not jit["loaded"]
        a, b = torch.load(f"{work}/jit.pt"), torch.load(f"{work}/aot.pt")
    failures = 0
    for key in a:
        same = a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and torch.equal(
            a[key].view(torch.int16), b[key].view(torch.int16))
        failures += not same
        served, jitted = aot["counts"][key]
        print(f"{key}: {'bit-exact' if same else 'DIFFERS'}; KDSL_AOT launches: {served} from cubins, {jitted} JIT",
              flush=True)
    print(f"{len(a) - failures} of {len(a)} calls bit-exact", flush=True)

    runs = {"jit": [], "aot": []}
    for _ in range(args.repeat):
        for mode in runs:
            runs[mode].append(child(FIRST, [], export if mode == "aot" else None, True))
    print(f"first fp8_gemm call, M = 16, N = K = 7168 (tma_persistent), empty Triton cache, fresh process; ms, "
          f"median of {args.repeat} (min..max):")
    for mode, results in runs.items():
        first = [r["first_ms"] for r in results]
        second = [r["second_ms"] for r in results]
        print(f"  {mode}: first {statistics.median(first):.1f} ({min(first):.1f}..{max(first):.1f}); second "
              f"{statistics.median(second):.2f}; first call's launches (from cubins, JIT) "
              f"{[r['first_launches'] for r in results]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
