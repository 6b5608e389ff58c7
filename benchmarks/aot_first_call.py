"""First call on a new shape, Triton's JIT against exported cubins (kdsl aot), each in a fresh process with an
empty Triton cache (on the GPU).

    python benchmarks/aot_first_call.py --export DIR [--repeat 3]

Per process: weights are prepared first (weight_quant, not timed), then timed with the GPU synchronized
around each: act_quant + fp8_gemm at M=16 (the process's first call), then at M=4096 (another tile bucket:
a new shape), then the same M=4096 call again (warm). Modes:
  jit          KDSL_DISABLE=*tma_persistent*: the kernels the export has, compiled by Triton's JIT
  jit-default  the registry's own choice on this GPU (on sm_90 the TMA kernel), compiled by the JIT
  aot          KDSL_AOT=DIR with the same routing as jit: the exported cubins, nothing compiled
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time, torch
import kdsl
from kdsl import ops
N, K = 7168, 7168
torch.manual_seed(0)
w, ws = ops.weight_quant(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05)
xs = {m: torch.randn(m, K, device="cuda", dtype=torch.bfloat16) for m in (16, 4096)}
torch.cuda.synchronize()
def call(m):
    torch.cuda.synchronize()
    start = time.perf_counter()
    q, s = ops.act_quant(xs[m])
    ops.fp8_gemm(q, s, w, ws)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3
result = {"first_m16_ms": call(16), "new_shape_m4096_ms": call(4096), "warm_m4096_ms": call(4096)}
try:
    import kdsl.aot
    result["launches"] = kdsl.aot.stats()
except ImportError:
    pass
print("RESULT " + json.dumps(result))
"""


def run(mode: str, export: str) -> dict:
    env = dict(os.environ)
    env.pop("KDSL_AOT", None)
    env.pop("KDSL_DISABLE", None)
    if mode in ("jit", "aot"):
        env["KDSL_DISABLE"] = "*tma_persistent*"
    if mode == "aot":
        env["KDSL_AOT"] = export
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr}")
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", required=True, help="folder written by `python -m kdsl aot`")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch
    import triton

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"N = K = 7168, bf16 activations; ms, median of {args.repeat} fresh processes (min..max)")
    for mode in ("jit", "jit-default", "aot"):
        runs = [run(mode, os.path.abspath(args.export)) for _ in range(args.repeat)]
        parts = []
        for key in ("first_m16_ms", "new_shape_m4096_ms", "warm_m4096_ms"):
            values = [r[key] for r in runs]
            parts.append(f"{key} {statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})")
        launches = runs[-1].get("launches")
        print(f"{mode:12s} " + "; ".join(parts) + (f"; launches {launches}" if mode == "aot" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
