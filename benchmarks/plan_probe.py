"""Does a launch plan's replay change a prepared int4 GEMM's GPU time? One process, CUDA-graph medians,
interleaved rounds of: the ordinary path (plans off), plans on, and plans on through CompiledKernel.run
instead of Triton's C launcher (_plan._direct_launcher off). Usage: python benchmarks/plan_probe.py [ROUNDS]"""
import statistics
import sys

import torch
import triton

import kdsl
from kdsl.ops import _plan
from kdsl.runtime import registry

CELLS = [(16, 14336, 4096), (64, 14336, 4096), (256, 14336, 4096), (64, 4096, 4096)]  # (M, N, K)
DIRECT = _plan._direct_launcher


def mode(name: str) -> None:
    _plan.RECORD = name != "off"
    _plan._direct_launcher = DIRECT if name != "run" else (lambda compiled: None)
    registry.reset()  # empties the plans


def main(rounds: int) -> None:
    torch.manual_seed(0)
    times: dict = {}
    cases = []
    for m, n, k in CELLS:
        ck = kdsl.ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02, group_size=128)
        prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4, group_size=128,
                                         checkpoint_format="gptq")
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        cases.append(((m, n, k), x, prepared))
    for r in range(rounds):
        for name in (("off", "on", "run") if r % 2 == 0 else ("run", "on", "off")):
            mode(name)
            for shape, x, prepared in cases:
                fn = lambda: kdsl.ops.w4a16_gemm(x, prepared)  # noqa: E731
                fn()
                key = (shape, name)
                times.setdefault(key, []).append(triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3)
                if r == 0:
                    plans = sum(1 for p in registry.plans.values() if p)
                    print(f"{shape} {name}: plans kept {plans}", flush=True)
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for shape, *_ in cases:
        row = "  ".join(f"{name} {statistics.median(times[(shape, name)]):6.2f} "
                        f"[{' '.join(f'{t:.1f}' for t in times[(shape, name)])}]" for name in ("off", "on", "run"))
        print(f"M={shape[0]:4d} N={shape[1]:6d} K={shape[2]:5d} us: {row}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
