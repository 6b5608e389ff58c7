"""Quantize a small float model with kdsl.quantize_ and compare it with the float model.

    python examples/quantize_and_run.py                      # on a CUDA GPU: the generated kernels run natively
    TRITON_INTERPRET=1 python examples/quantize_and_run.py   # on a CPU: they run through Triton's interpreter

For each scheme (block FP8, GPTQ-style int4) it builds nn.Sequential(Linear, SiLU, Linear), runs it in float,
replaces its linears with kdsl's quantized ones (kdsl.quantize_), runs it again and prints the relative error
and the kernel the registry picked. Exit status 1 if an error is larger than the scheme's quantization allows.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

import kdsl


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Without it the ops fall back to torch code: the example would not run kdsl's kernels.
        print("no CUDA GPU: run with TRITON_INTERPRET=1 so the generated kernels run in Triton's interpreter",
              file=sys.stderr)
        return 2
    # The interpreter is slow: CPU sizes stay small. Feature sizes must be multiples of 128 (the FP8 block and
    # the int4 group).
    hidden = 256 if device.type == "cpu" else 4096
    tokens = 4
    torch.manual_seed(0)
    ok = True
    # Round-to-nearest int4 keeps about 10% relative error on random weights, block FP8 about 5%.
    for scheme, dtype, limit in ((kdsl.BlockFP8(), torch.bfloat16, 0.08),
                                 (kdsl.GPTQ(group_size=128), torch.float16, 0.15)):
        model = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        model = model.to(device, dtype)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        with torch.no_grad():  # inference only: the quantized ops have no backward
            reference = model(x)
            kdsl.quantize_(model, scheme)
            y = model(x)
        error = relative_error(y, reference)
        verdict = "ok" if error < limit else "TOO LARGE"
        print(f"{scheme.name}: {model[0]}")
        print(f"  relative error vs the float model: {error:.3f} (< {limit}: {verdict})")
        ok &= error < limit
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
