"""Host time per eager kdsl.ops.fp8_bmm call at MLA decode shapes, with and without launch plans, beside bf16
torch.bmm (GPU idle before each batch of calls; kdsl.bench.timing.host_time_us), and the GPU time of the plan's
launches against the ordinary path's (CUDA graphs; the plan declines inside a capture, so the graph times the
ordinary path: the eager replay is timed with do_bench instead).

    python benchmarks/fp8_bmm_host_time.py [OUT.txt]
"""
import sys

import torch
import triton.testing as tt

import kdsl
from kdsl.bench.timing import fp8_bmm_inputs, host_time_us
from kdsl.ops import _plan


def main() -> None:
    lines = [f"{torch.cuda.get_device_name()}: us per call on the host (median of 3 x 100 calls)",
             "B N K M | plans | no plans | bf16 bmm | eager do_bench us: plans, no plans"]
    for batch, n, k in [(128, 512, 128), (128, 128, 512), (16, 512, 128), (16, 128, 512)]:
        for m in (1, 16, 64):
            x, a, a_s, b, b_s, w, ref = fp8_bmm_inputs(batch, m, n, k)
            w16, x_t = w.to(torch.bfloat16), x.transpose(0, 1)
            op = lambda: kdsl.ops.fp8_bmm(a, a_s, b, b_s)  # noqa: E731
            got = op()
            assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
            with_plans = host_time_us(op)
            eager_plans = tt.do_bench(op, return_mode="median") * 1e3
            _plan.RECORD = False
            kdsl.registry.plans.clear()
            without = host_time_us(op)
            eager_without = tt.do_bench(op, return_mode="median") * 1e3
            _plan.RECORD = True
            bf16 = host_time_us(lambda: torch.bmm(x_t, w16.transpose(1, 2)))
            lines.append(f"{batch} {n} {k} {m} | {with_plans:.1f} | {without:.1f} | {bf16:.1f} | "
                         f"{eager_plans:.1f}, {eager_without:.1f}")
            print(lines[-1], flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
