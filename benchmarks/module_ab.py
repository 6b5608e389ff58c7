"""One process, one prepared int4 GEMM case, two generated modules launched on the same tensors: this tree's
overlap_gluon module and an older tree's module file (OLD_MODULE), interleaved, CUDA-graph medians. Tells a
kernel binary's speed apart from the process around it. Usage: python benchmarks/module_ab.py OLD_MODULE [ROUNDS]"""
import importlib.util
import statistics
import sys

import torch
import triton

import kdsl
from kdsl.runtime import registry


def main(old_path: str, rounds: int) -> None:
    m, n, k = 64, 14336, 4096
    torch.manual_seed(0)
    ck = kdsl.ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02, group_size=128)
    p = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4, group_size=128,
                              checkpoint_format="gptq")
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    entry = registry.dispatch("w4a16_gemm", p.scheme, x.device)
    tile = entry.tile_for(m, n)
    new = entry.modules[tile["impl"]].load()
    spec = importlib.util.spec_from_file_location("old_prepared_module", old_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    old_tile = dict(tile, overlap_dequant=True, mma_gemv=False, persistent=False, tile_order="m_major",
                    swap_ab=False, warp_specialize=False, deferred_rescale=False, edge_tiles=False)
    args = (x, p.perm, p.qweight, p.zeros, p.scales, p.groups, p.contiguous_groups)
    calls = {"new": lambda y: new.launch(*args, y, tile), "old": lambda y: old.launch(*args, y, old_tile),
             # the op: a new output each call, as kdsl bench times it
             "op": lambda y: y.copy_(kdsl.ops.gptq_gemm(x, p)) if y is None else kdsl.ops.gptq_gemm(x, p),
             "new_fresh_y": lambda y: new.launch(*args, torch.empty_like(y), tile)}
    want = x.float() @ kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4,
                                            group_size=128).float().T
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            out = calls[name](y)
            got = out if name == "op" else y
            if name != "new_fresh_y":
                err = ((got.float() - want).norm() / want.norm()).item()
                assert err < 1e-2, (name, err)
            times[name].append(triton.testing.do_bench_cudagraph(lambda: calls[name](y), return_mode="median") * 1e3)
    print(torch.cuda.get_device_name(), tile)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} us [{' '.join(f'{t:.2f}' for t in ts)}]")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6)
