"""Host-side Python cost of the ops up to the kernel launch, on the CPU, with the launch itself faked.

    python benchmarks/host_profile.py [--calls 20000] [--profile]

No GPU and no interpreter: CPU tensors take the GPU's path (check.use_kernels is forced on, the sm_90
modules are selected, the modules think they are compiled), and Triton's JIT call and launcher are
stand-ins that do nothing but report the launch to Triton's launch hook, as the real launcher does. So
the figures are kdsl's own Python per call: argument checks, scheme lookup, registry dispatch and tile
choice, the module's launch() (grid, split, descriptors), the launch cache, the output allocation (CPU
allocation, cheaper than CUDA's) -- on the ordinary path and on a launch plan's replay (kdsl/ops/_plan.py).
Triton's own launcher cost is not in them (benchmarks/host_time.py measures the whole on a GPU).
--profile prints cProfile's top functions of the ordinary path.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["KDSL_ARCH"] = "sm_90"

import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton import knobs  # noqa: E402

import kdsl  # noqa: E402
from kdsl.ops import _checks, _plan, block_fp8  # noqa: E402


class FakeCompiled:
    """A compiled kernel whose launch only calls Triton's launch hook (as Triton's launcher does)."""

    function, packed_metadata = 0, (4, 1, 0)

    def run(self, *args):
        pass

    def __getitem__(self, grid):
        def runner(*args):
            knobs.runtime.launch_enter_hook(None)
        return runner


def fake_jit(self, grid):
    def call(*args, **kwargs):
        knobs.runtime.launch_enter_hook(None)
        return FakeCompiled()
    return call


def setup() -> None:
    jit.JITFunction.__getitem__ = fake_jit
    _checks.use_kernels = lambda device: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    _plan._triton_stream = lambda: (lambda device: 0)
    block_fp8._fp8_gemm_lost_nan = lambda a, b, c: None  # the interpreter's NaN fix-up, not a GPU cost
    for entry in kdsl.registry.entries():
        if entry.min_arch == 90 or entry.op == "act_quant":
            for kernel_module in entry.modules.values():
                module = kernel_module.load()
                if hasattr(module, "_INTERPRETING"):
                    module._INTERPRETING = False


def cases():
    ops = kdsl.ops
    x = torch.randn(1, 7168, dtype=torch.bfloat16)
    w = torch.randn(2112, 7168, dtype=torch.bfloat16)
    a, a_s = ops.act_quant(x)
    b, b_s = ops.weight_quant(w)
    wh = torch.randn(4096, 4096, dtype=torch.float16)
    ck = ops.gptq_quantize(wh)
    prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None)
    xh = torch.randn(1, 4096, dtype=torch.float16)
    yield "act_quant M=1 K=7168", lambda: ops.act_quant(x)
    yield "fp8_gemm M=1 N=2112 K=7168", lambda: ops.fp8_gemm(a, a_s, b, b_s)
    yield "act_quant+fp8_gemm M=1", lambda: ops.fp8_gemm(*ops.act_quant(x), b, b_s)
    yield "gptq_gemm[prepared] M=1 4096x4096", lambda: ops.gptq_gemm(xh, prepared)


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    setup()
    print(f"{'case':36s} {'ordinary us':>12s} {'plan us':>9s}")
    for name, fn in cases():
        rounds = []
        for _ in range(3):  # interleaved, median of three
            kdsl.registry.reset()
            _plan.RECORD = False
            ordinary = per_call_us(fn, args.calls)
            _plan.RECORD = True
            planned = per_call_us(fn, args.calls)
            rounds.append((ordinary, planned))
        ordinary, planned = (sorted(r[i] for r in rounds)[1] for i in (0, 1))
        print(f"{name:36s} {ordinary:12.2f} {planned:9.2f}")
        if args.profile:
            kdsl.registry.reset()
            _plan.RECORD = False
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [fn() for _ in range(2000)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
            _plan.RECORD = True


if __name__ == "__main__":
    main()
