"""What one kdsl op call puts into a CUDA graph, in whichever tree is on PYTHONPATH: the graph's nodes (kernel
names, grids, block sizes, shared memory; memsets, copies), then CUDA-graph medians of the op over rounds.
Run once per tree to compare two trees' op paths node by node (issue 32's prepared GPTQ cell).

    python benchmarks/graph_nodes.py M N K OUT_PREFIX [ROUNDS]
"""
import re
import statistics
import sys

import torch
import triton.testing as tt

import kdsl
from kdsl.bench.timing import full_fp32_matmul, gptq_gemm_inputs


def nodes(fn, path):
    fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph(keep_graph=True)  # the graph stays for debug_dump after instantiation
    except TypeError:
        g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    with torch.cuda.graph(g):
        fn()
    g.debug_dump(path)
    try:
        text = open(path).read()
    except OSError as exc:
        return [f"no graph dump: {exc}"]
    kinds = re.findall(r"\b(KERNEL|MEMSET|MEMCPY|EMPTY|EVENT_RECORD|WAIT_EVENT|HOST)\b", text)
    out = [f"node kinds: { {k: kinds.count(k) for k in sorted(set(kinds))} }"]
    for label in re.findall(r'label="([^"]*)"', text):
        out.append("  " + re.sub(r"\\n", " | ", label)[:400])
    return out


def kernels(fn, path):
    """The kernels one eager call launches, as the profiler's trace records them (grid, block, registers,
    shared memory)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    out = [f"eager call: {len(events)} GPU events"]
    for e in events:
        a = e.get("args", {})
        out.append(f"  {e['cat']} {e['name'][:90]} grid={a.get('grid')} block={a.get('block')} "
                   f"regs={a.get('registers per thread')} smem={a.get('shared memory')} dur={e.get('dur')}us")
    return out


def main():
    m, n, k, prefix = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    torch.manual_seed(0)
    with full_fp32_matmul():
        inp = gptq_gemm_inputs(m, n, k)
    p = kdsl.ops.gptq_prepare(inp.qweight, inp.qzeros, inp.scales, None, bits=4, group_size=128,
                              checkpoint_format="gptq")
    op = lambda: kdsl.ops.gptq_gemm(inp.x, p)  # noqa: E731
    err = ((op().float() - inp.ref).norm() / inp.ref.norm()).item()
    lines = [f"{torch.cuda.get_device_name()} M={m} N={n} K={k} rel err {err:.2e}"]
    lines += kernels(op, prefix + ".trace.json")
    lines += nodes(op, prefix + ".dot")
    times = []
    for _ in range(rounds):
        times.append(tt.do_bench_cudagraph(op, return_mode="median") * 1e3)
    lines.append(f"graph median us: {statistics.median(times):.2f} [{' '.join(f'{t:.2f}' for t in times)}]")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
