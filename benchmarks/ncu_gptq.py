"""Run the prepared GPTQ GEMM four times at M N K (argv) so Nsight Compute can profile one launch:

    ncu --clock-control none -k regex:w4a16_gemm --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/ncu_gptq.py 16 28672 8192

Prints the relative error against the fp32 reference, so a wrong kernel is not profiled unnoticed.
"""
import sys

import torch

import kdsl.ops as ops
from kdsl.bench.timing import GROUP, gptq_gemm_inputs

m, n, k = (int(a) for a in sys.argv[1:4])
inputs = gptq_gemm_inputs(m, n, k)
prepared = ops.gptq_prepare(inputs.qweight, inputs.qzeros, inputs.scales, None, bits=4, group_size=GROUP,
                            checkpoint_format="gptq")
for _ in range(4):
    y = ops.gptq_gemm(inputs.x, prepared)
torch.cuda.synchronize()
print(m, n, k, float((y.float() - inputs.ref).norm() / inputs.ref.norm()))
