"""Write MoE inputs for moe_example, run it, and compare its outputs with kdsl.ops (on the GPU).

    python examples/aot/run_moe_example.py --exe ./moe_example [--export DIR] [--work /tmp/aot_moe_data] [--quick]

Cases: DeepSeek-V3's routed experts (256, top-8) at its TP-8 slice's projections (gate-up N x K = 512 x 7168,
down 7168 x 256), tokens routed at random. Contiguous layout (kdsl_fp8_grouped_gemm): each expert's rows padded to
128 with -1 ids, T = 1, 64 and 4096 (every tile bucket of rows per expert), and one unpadded (the slots sorted by
expert: tiles holding rows of several experts). Masked layout (kdsl_fp8_grouped_gemm_masked): a [E, T, K],
T = 1, 64 and 128, masked_m the routing's rows per expert, expected_m = ceil(8 T / E) and 0 (max_m). Checks:
c from C == kdsl.ops.fp8_grouped_gemm[_masked] bit for bit on the rows the op defines (routed rows; rows below
masked_m[e]) where the call is shaped like the export's representative problems (padded rows; the unpadded case
runs a specialization that assumes less: its bits are printed, not required), and the relative error against an
fp32 per-expert reference below 1e-2; masked cases also run from a CUDA graph captured by the C program, replayed
with a second routing copied into masked_m: == kdsl.ops with that routing. With --export (the folder the program
was built from): kdsl.ops with kdsl.aot.load(DIR) == the JIT, bit for bit, and the padded and masked cases served
from the exported cubins (kdsl.aot.stats()). Prints host time per call of kdsl.ops beside the C program's. Exit 1
on any mismatch.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

TOPK = 8
DEVICE = "cuda"
# (layout, E, T tokens, N, K, expected_m for masked: None = ceil(TOPK * T / E), 0 = max_m; padded for contiguous)
CASES = [("c", 256, t, n, k, True) for t in (1, 64, 4096) for n, k in ((512, 7168), (7168, 256))] + \
        [("c", 256, 5, 512, 7168, False)] + \
        [("m", 256, t, n, k, None) for t in (1, 64, 128) for n, k in ((512, 7168), (7168, 256))] + \
        [("m", 256, 64, 512, 7168, 0)]
QUICK = [("c", 16, 4, 256, 512, True), ("c", 16, 5, 256, 512, False), ("m", 16, 8, 256, 512, None)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def host_us(fn, calls=200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def save(t: torch.Tensor, path: Path) -> None:
    t.contiguous().cpu().view(torch.uint8).numpy().tofile(path)


def routing(tokens: int, experts: int) -> torch.Tensor:
    """topk_ids [T, TOPK]: distinct experts per token, at random."""
    return torch.rand(tokens, experts, device=DEVICE).topk(TOPK, dim=1).indices.to(torch.int32)


def contiguous_ids(topk_ids: torch.Tensor, experts: int, padded: bool) -> torch.Tensor:
    """group_ids of the slots sorted by expert, each expert's rows padded to 128 with -1 (DeepGEMM's contiguous
    layout) or not."""
    if not padded:
        return topk_ids.view(-1).sort().values
    counts = torch.bincount(topk_ids.view(-1).long(), minlength=experts).tolist()
    ids = []
    for expert, count in enumerate(counts):
        ids += [expert] * count + [-1] * (-count % 128)
    return torch.tensor(ids, dtype=torch.int32, device=DEVICE)


def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rows of e4m3 activations times their per-128 scales, in fp32."""
    return q.float() * s.repeat_interleave(128, dim=-1)[..., : q.shape[-1]]


def expert_weight(b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """One expert's [N, K] e4m3 weight times its 128x128 block scales, in fp32."""
    n, k = b.shape
    return b.float() * b_s.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]


def grouped_call(layout: str, a, a_s, b, b_s, routed, expected_m: int) -> torch.Tensor:
    """kdsl.ops' grouped GEMM for this layout (check_ids as by default: the ids were made valid)."""
    from kdsl import ops

    if layout == "c":
        return ops.fp8_grouped_gemm(a, a_s, b, b_s, routed)
    return ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, routed, expected_m=expected_m or None)


def per_expert_reference(layout: str, a, a_s, b, b_s, routed, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference, one expert at a time, and where the op defines its output (routed rows; rows below
    masked_m[e])."""
    reference = torch.zeros(*shape, device=DEVICE)
    defined = torch.zeros(shape[:-1], dtype=torch.bool, device=DEVICE)
    for expert in range(b.shape[0]):
        weight = expert_weight(b[expert], b_s[expert])
        if layout == "c":
            mine = (routed == expert).nonzero().squeeze(1)
            reference[mine] = dequantized(a[mine], a_s[mine]) @ weight.T
            defined[mine] = True
        else:
            count = int(routed[expert])
            reference[expert, :count] = dequantized(a[expert, :count], a_s[expert, :count]) @ weight.T
            defined[expert, :count] = True
    return reference, defined


def served_from_export(folder: Path, cases, inputs, weights, jit_outputs) -> int:
    """kdsl.ops again with the exported cubins loaded: the same bits as the JIT on the rows the op defines; the calls shaped like the export's
    representative problems (padded contiguous rows, masked) run from cubins. Returns the failures."""
    import kdsl.aot

    kdsl.aot.load(folder)
    failures = 0
    try:
        for index, ((layout, experts, tokens, n, k, option), (a, a_s, ids, _, expected_m), (jit, defined)) in enumerate(
                zip(cases, inputs, jit_outputs)):
            b, b_s = weights[experts, n, k]
            before = kdsl.aot.stats()
            out = grouped_call(layout, a, a_s, b, b_s, ids, expected_m)
            after = kdsl.aot.stats()
            served = after["aot"] - before["aot"]
            # Padding rows (contiguous) and rows past masked_m are unspecified: only the rows the op defines.
            same = torch.equal(bits(out[defined]), bits(jit[defined]))
            exported_shape = option if layout == "c" else True
            print(f"case {index}: kdsl.ops through kdsl.aot.load == the JIT, bit for bit: {same}; launches from "
                  f"cubins {served}, through the JIT {after['jit'] - before['jit']}")
            failures += (not same) + (exported_shape and served == 0)
    finally:
        kdsl.aot.unload()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exe", type=Path, required=True)
    parser.add_argument("--export", type=Path, help="the kdsl aot folder: also check kdsl.ops under kdsl.aot.load")
    parser.add_argument("--work", type=Path, default=Path("/tmp/aot_moe_data"))
    parser.add_argument("--quick", action="store_true", help="three small cases (for compute-sanitizer)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    from kdsl import ops
    from kdsl.runtime import registry

    cases = QUICK if args.quick else CASES
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    weights, inputs, lines = {}, [], []
    for index, (layout, experts, tokens, n, k, option) in enumerate(cases):
        if (experts, n, k) not in weights:
            w = torch.randn(experts, n, k, device=DEVICE, dtype=torch.bfloat16) * 0.05
            b, b_s = zip(*(ops.weight_quant(w[e]) for e in range(experts)))
            b, b_s = torch.stack(b), torch.stack(b_s)
            save(b, work / f"b_{experts}_{n}_{k}.bin")
            save(b_s, work / f"bs_{experts}_{n}_{k}.bin")
            weights[experts, n, k] = b, b_s
        if layout == "c":
            ids = contiguous_ids(routing(tokens, experts), experts, padded=option)
            a, a_s = ops.act_quant(torch.randn(ids.numel(), k, device=DEVICE, dtype=torch.bfloat16))
            second = None
            rows, expected_m = ids.numel(), 0
        else:
            counts = [torch.bincount(routing(tokens, experts).view(-1).long(), minlength=experts).to(torch.int32)
                      for _ in range(2)]
            ids, second = counts
            a, a_s = ops.act_quant(torch.randn(experts * tokens, k, device=DEVICE, dtype=torch.bfloat16))
            a, a_s = a.view(experts, tokens, k), a_s.view(experts, tokens, k // 128)
            rows, expected_m = tokens, -(-TOPK * tokens // experts) if option is None else option
            save(second, work / f"case{index}_ids2.bin")
        save(a, work / f"case{index}_a.bin")
        save(a_s, work / f"case{index}_as.bin")
        save(ids, work / f"case{index}_ids.bin")
        inputs.append((a, a_s, ids, second, expected_m))
        lines.append(f"{layout} {experts} {rows} {n} {k} {expected_m}\n")
    (work / "moe_cases.txt").write_text("".join(lines))

    done = subprocess.run([str(args.exe), str(work), str(args.calls)], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return 1

    failures, jit_outputs = 0, []
    arch = registry.device_arch()
    for index, ((layout, experts, tokens, n, k, option), (a, a_s, ids, second, expected_m)) in enumerate(
            zip(cases, inputs)):
        b, b_s = weights[experts, n, k]
        op = "fp8_grouped_gemm" if layout == "c" else "fp8_grouped_gemm_masked"
        entry = registry.select(op, arch=arch)
        # The tile kdsl.ops picks: by rows per expert (contiguous) or by expected_m, else max_m (masked).
        tile = entry.tile_for(max(1, -(-ids.numel() // experts)) if layout == "c" else expected_m or tokens, n)
        shape = (ids.numel(), n) if layout == "c" else (experts, tokens, n)
        exact_required = option if layout == "c" else True  # contiguous: padded rows, the representative shapes
        for suffix, routed in [("", ids)] + ([("2", second)] if second is not None else []):
            raw = torch.from_file(str(work / f"case{index}_c{suffix}.out"), size=2 * math.prod(shape),
                                  dtype=torch.uint8)
            from_c = raw.view(torch.bfloat16).view(*shape).to(DEVICE)
            from_ops = grouped_call(layout, a, a_s, b, b_s, routed, expected_m)
            reference, defined = per_expert_reference(layout, a, a_s, b, b_s, routed, shape)
            if not suffix:
                jit_outputs.append((from_ops, defined))
            same = torch.equal(bits(from_c[defined]), bits(from_ops[defined]))
            rel = ((from_c[defined].float() - reference[defined]).norm() / reference[defined].norm()).item()
            what = "contiguous" if layout == "c" else "masked" + (" (graph replay, second routing)" if suffix else "")
            print(f"case {index} {what} E={experts} T={tokens} rows={shape[0] if layout == 'c' else tokens} N={n} "
                  f"K={k}: {entry.name} tile {tile['BLOCK_M']}x{tile['BLOCK_N']}; bit-exact vs kdsl.ops {same}"
                  f"{'' if exact_required else ' (not required: unpadded rows)'}; rel err vs fp32 reference {rel:.2e}")
            failures += (exact_required and not same) + (rel > 1e-2)
        python_us = host_us(lambda: grouped_call(layout, a, a_s, b, b_s, ids, expected_m), args.calls)
        print(f"case {index}: host us/call kdsl.ops.{op} {python_us:.2f}")
    if args.export:
        failures += served_from_export(args.export, cases, inputs, weights, jit_outputs)
    print("FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
