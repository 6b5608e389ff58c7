"""Which compiled kernels one prepared int4 GEMM call runs, and their fingerprints: run it in two trees and
compare (cubin sha256, registers, spills, shared memory, warps, stages), with the call's CUDA-graph time.
Usage: python benchmarks/kernel_identity.py M N K [PAD_MB ...]  (any kdsl tree on PYTHONPATH that has
gptq_prepare). Each PAD_MB allocates that many MB before the case's tensors, moving them in memory, and times
the call again: a time that follows the padding, not the tree, is placement."""
import hashlib
import sys

import torch
import triton

import kdsl


def main(m: int, n: int, k: int, pad_mb: int = 0, show: bool = True) -> None:
    pad = torch.empty(pad_mb << 20, dtype=torch.uint8, device="cuda")  # noqa: F841 - held while timing
    torch.manual_seed(0)
    ck = kdsl.ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02, group_size=128)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4, group_size=128,
                                     checkpoint_format="gptq")
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    fn = lambda: kdsl.ops.gptq_gemm(x, prepared)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    for name, module in sorted(sys.modules.items()) if show else ():
        if not name.startswith("kdsl_generated") or module is None:
            continue
        for attr, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if not caches or not hasattr(value, "arg_names"):
                continue
            for device, cache in caches.items():
                for key, compiled in cache[0].items():
                    cubin = compiled.asm.get("cubin") or b""
                    meta = compiled.metadata
                    print(f"{attr}: cubin {hashlib.sha256(cubin).hexdigest()[:16]} regs {compiled.n_regs} "
                          f"spills {compiled.n_spills} shared {meta.shared} warps {meta.num_warps} "
                          f"stages {getattr(meta, 'num_stages', '?')}")
    times = [triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3 for _ in range(3)]
    print(f"M={m} N={n} K={k} pad {pad_mb} MB graph us: {' '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    shape = tuple(map(int, sys.argv[1:4]))
    main(*shape)
    for pad in map(int, sys.argv[4:]):
        main(*shape, pad_mb=pad, show=False)
