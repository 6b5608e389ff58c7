"""Write prepared GPTQ weights for gptq_example, run it, and compare its outputs with kdsl.ops (on the GPU).

    python examples/aot/run_gptq_example.py --exe ./gptq_example [--work /tmp/aot_gptq_data] [--calls 200]

A random GPTQ (v2) checkpoint, K = N = 4096, group size 128, without and with act-order, goes through
kdsl.ops.gptq_prepare; the prepared tensors (W4A16Prepared's fields) are written as raw files for the C
program (a deployment could save the same fields with safetensors). Checks, per (M, act-order), M = 1 .. 8
(on sm_90 the Gluon GEMV, gemv_mma_gluon, exported for K = 4096), 16, 64:
  y from C == the same kernel launched from Python: the entry's launch() with the tile the C dispatcher
  takes (kdsl.aot.plan.route: the registry's choice for the call, with the Gluon GEMV refusing a K it was not
  exported for and any tile left out of the export passed over), bit for bit;
  the relative error against an fp32 dequantize-then-matmul reference of the checkpoint (< 1e-2);
  against kdsl.ops.w4a16_gemm as the registry picks by default (Gluon tiles where they serve), printed.
Prints host time per call of kdsl.ops.w4a16_gemm from Python beside the C program's. Exit 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

K = N = 4096
GROUP = 128
MS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def host_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / max(calls, 1) * 1e6


def write(t: torch.Tensor, path: Path) -> int:
    data = t.contiguous().cpu().view(torch.uint8).numpy()
    data.tofile(path)
    return data.size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exe", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/aot_gptq_data"))
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    from kdsl import ops
    from kdsl.aot import abi as abis
    from kdsl.aot.plan import route
    from kdsl.ops.gptq_checkpoint import pack_rows
    from kdsl.runtime import registry

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    groups = K // GROUP
    checkpoints, prepared_sets = [], []
    for index, act_order in enumerate((False, True)):
        q = torch.randint(0, 16, (K, N), device="cuda")
        zeros = torch.randint(0, 16, (groups, N), device="cuda")
        scales = (torch.rand(groups, N, device="cuda") * 0.02 + 0.002).half()
        g_idx = (torch.arange(K, device="cuda") // GROUP).int()
        if act_order:
            g_idx = g_idx[torch.randperm(K, device="cuda")]
        qweight = pack_rows(q, 4)
        qzeros = pack_rows(zeros.T.contiguous(), 4).T.contiguous()
        p = ops.gptq_prepare(qweight, qzeros, scales, g_idx if act_order else None, bits=4, group_size=GROUP,
                             checkpoint_format="gptq_v2")
        checkpoints.append((q, zeros, scales, g_idx))
        prepared_sets.append(p)
        planes = p.layout.get("weights") == "k_planes"
        if p.layout["zeros"] == "paired":  # scales and zeros are views of one [G, N, 2] tensor: write it whole
            zs, zeros_offset, scales_offset, ld = torch.stack((p.scales, p.zeros), -1), 2, 0, 2 * N
        else:
            zs = torch.cat((p.zeros.flatten(), p.scales.flatten()))
            zeros_offset, scales_offset, ld = 0, p.zeros.numel() * 2, N
        qweight_bytes = write(p.qweight, work / f"w{index}_qweight.bin")
        zs_bytes = write(zs, work / f"w{index}_zs.bin")
        write(p.groups, work / f"w{index}_groups.bin")
        if p.perm is not None:
            write(p.perm, work / f"w{index}_perm.bin")
        ldqw = N if planes else p.qweight.stride(0)
        (work / f"w{index}.txt").write_text(
            f"{K} {N} {int(planes)} {int(p.contiguous_groups)} {int(p.perm is not None)} {qweight_bytes} {zs_bytes} "
            f"{zeros_offset} {scales_offset} {ld} {ld} {ldqw}\n")
        print(f"w{index}: {p}")
    inputs = {m: torch.randn(m, K, device="cuda", dtype=torch.float16) for m in MS}
    for m, x in inputs.items():
        write(x, work / f"x_{m}_{K}.bin")
    cases = [(m, index) for index in range(2) for m in MS]
    (work / "cases.txt").write_text("".join(f"{m} {N} {K} {index}\n" for m, index in cases))

    done = subprocess.run([str(args.exe), str(work), str(args.calls)], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return 1

    failures = 0
    for m, index in cases:
        p, x = prepared_sets[index], inputs[m]
        q, zeros, scales, g_idx = checkpoints[index]
        y_c = torch.from_file(str(work / f"y_{m}_{N}_{K}_{index}.out"), size=m * N * 2,
                              dtype=torch.uint8).view(torch.float16).view(m, N).cuda()
        entry = registry.dispatch("w4a16_gemm", p.scheme, x.device)
        facts = dict(m=m, n=N, dtype="float16", act_order=p.perm is not None, contiguous_groups=p.contiguous_groups)
        # The tile the C dispatcher takes (the export's rule, with the op's default representative problems,
        # which the export gptq_example runs used): the registry's, with tiles left out of the export passed over
        # as the registry passes over a tile whose module refuses the call; the Gluon GEMV serves M <= 8.
        lds = 2 * N if p.layout["zeros"] == "paired" else N
        index = route(abis.OPS["w4a16_gemm"], entry, dict(
            M=m, N=N, K=K, ldx=K, ldqw=N, ldz=lds, lds=lds, ldy=N, perm=int(p.perm is not None),
            contiguous_groups=int(p.contiguous_groups), x_dtype="f16"))
        tile = entry.tiles[index].params
        default_tile = entry.tile_for(m, N, registry.Call(**facts))
        y_same = torch.empty(m, N, device="cuda", dtype=torch.float16)
        entry.launch(x, p.perm, p.qweight, p.zeros, p.scales, p.groups, p.contiguous_groups, y_same, tile)
        y_default = ops.w4a16_gemm(x, p)
        w = (q.float() - zeros[g_idx.long()].float()) * scales[g_idx.long()].float()  # [K, N], checkpoint order
        ref = x.float() @ w
        same = torch.equal(bits(y_c), bits(y_same))
        rel = ((y_c.float() - ref).norm() / ref.norm()).item()
        rel_default = ((y_c.float() - y_default.float()).norm() / y_default.float().norm()).item()
        us = host_us(lambda: ops.w4a16_gemm(x, p), args.calls)
        print(f"M={m} N={N} K={K} act_order={p.perm is not None}: C tile {tile['impl']} "
              f"{tile['BLOCK_M']}x{tile['BLOCK_N']}x{tile['BLOCK_K']}; bit-exact vs the same kernel from Python "
              f"{same}; rel err vs fp32 reference {rel:.2e}; vs kdsl.ops default ({default_tile['impl']}) "
              f"{rel_default:.2e}; kdsl.ops host us/call {us:.2f}")
        failures += (not same) + (rel > 1e-2)
    print("FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
