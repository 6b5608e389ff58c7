"""Run kdsl.ops.fp8_bmm four times at B M N K (argv), MLA's transposed activations, so Nsight Compute can profile
one launch:

    ncu --clock-control none -k regex:fp8_bmm --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python benchmarks/ncu_fp8_bmm.py 128 4096 512 128

Prints the relative error against the fp32 reference, so a wrong kernel is not profiled unnoticed.
"""
import sys

import torch

import kdsl.ops as ops
from kdsl.bench.timing import fp8_bmm_inputs

batch, m, n, k = (int(a) for a in sys.argv[1:5])
_, a, a_s, b, b_s, _, ref = fp8_bmm_inputs(batch, m, n, k)
for _ in range(4):
    c = ops.fp8_bmm(a, a_s, b, b_s)
torch.cuda.synchronize()
print(batch, m, n, k, float((c.float() - ref).norm() / ref.norm()))
