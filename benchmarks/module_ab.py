"""One process, one case, two generated modules launched on the same tensors: the module this tree's registry
picks for the case and the module an older tree's manifest picks (its file and tile), interleaved, CUDA-graph
medians. Tells a kernel binary's speed apart from the process and harness around it.

    python benchmarks/module_ab.py OLD_TREE gptq M N K [ROUNDS]    # prepared int4 GEMM (w4a16_gemm)
    python benchmarks/module_ab.py OLD_TREE fp8 M N K [ROUNDS]     # block-FP8 GEMM (fp8_gemm)

Both modules read the same prepared weights (this tree's layout, which the older prepared modules read too).
"""
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

import kdsl
from kdsl.runtime import registry


def old_module_and_tile(old_tree: Path, op: str, m: int, n: int):
    """The older tree's module (file) and tile params serving (M, N) for sm_90, from its manifest."""
    manifest = json.loads((old_tree / "generated" / "manifest.json").read_text())
    named = {"gptq_gemm_prepared": "int4_g128_gptq__", "fp8_gemm": ""}[op]  # prepared: one checkpoint format
    kernels = [kern for kern in manifest["kernels"] if kern["op"] == op and named in kern["name"]
               and kern["min_arch"] <= 90 and (kern["max_arch"] or 90) >= 90]
    for kernel in sorted(kernels, key=lambda kern: -kern["min_arch"]):  # the most specific, as the registry
        for t in kernel["tiles"]:
            if (t["m_max"] is None or m <= t["m_max"]) and (t["n_min"] is None or n >= t["n_min"]):
                tile = {key: v for key, v in t.items() if key not in ("m_max", "n_min")}
                path = old_tree / "generated" / f"{kernel['name']}.py"
                spec = importlib.util.spec_from_file_location("old_" + kernel["name"], path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module, tile, kernel["name"]
    raise SystemExit(f"{old_tree}: no sm_90 {op} kernel serves M = {m}, N = {n}")


def gptq_case(old_tree: Path, m: int, n: int, k: int):
    ck = kdsl.ops.gptq_quantize(torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02, group_size=128)
    p = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4, group_size=128,
                              checkpoint_format="gptq")
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    entry = registry.dispatch("w4a16_gemm", p.scheme, x.device)
    tile = entry.tile_for(m, n)
    new = entry.modules[tile["impl"]].load()
    old, old_tile, old_name = old_module_and_tile(old_tree, "gptq_gemm_prepared", m, n)
    args = (x, p.perm, p.qweight, p.zeros, p.scales, p.groups, p.contiguous_groups)
    want = x.float() @ kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=4,
                                            group_size=128).float().T
    out = lambda: torch.empty(m, n, device="cuda", dtype=torch.float16)  # noqa: E731
    return (lambda y: new.launch(*args, y, tile)), (lambda y: old.launch(*args, y, old_tile)), out, want, \
        (new.__name__, tile), (old_name, old_tile)


def fp8_case(old_tree: Path, m: int, n: int, k: int):
    q, s = kdsl.ops.act_quant(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    wq, ws = kdsl.ops.weight_quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    entry = registry.dispatch("fp8_gemm", kdsl.BlockFP8().name, q.device)
    tile = entry.tile_for(m, n)
    new = entry.modules[tile["impl"]].load()
    old, old_tile, old_name = old_module_and_tile(old_tree, "fp8_gemm", m, n)
    want = (q.float() * s.repeat_interleave(128, 1)) @ kdsl.ops.weight_dequant(wq, ws).float().T
    out = lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return (lambda c: new.launch(q, s, wq, ws, c, tile)), (lambda c: old.launch(q, s, wq, ws, c, old_tile)), out, \
        want, (new.__name__, tile), (old_name, old_tile)


def main(old_tree: str, kind: str, m: int, n: int, k: int, rounds: int) -> None:
    torch.manual_seed(0)
    new, old, out, want, new_desc, old_desc = {"gptq": gptq_case, "fp8": fp8_case}[kind](Path(old_tree), m, n, k)
    calls = {"new": new, "old": old}
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            y = out()
            calls[name](y)
            err = ((y.float() - want).norm() / want.norm()).item()
            assert err < 2e-2, (name, err)
            times[name].append(triton.testing.do_bench_cudagraph(lambda: calls[name](y), return_mode="median") * 1e3)
    print(torch.cuda.get_device_name(), kind, f"M={m} N={n} K={k}")
    print("new:", *new_desc)
    print("old:", *old_desc)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} us [{' '.join(f'{t:.2f}' for t in ts)}]")


if __name__ == "__main__":
    if len(sys.argv) < 6:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), int(sys.argv[6]) if len(sys.argv) > 6 else 6)
