"""`python -m kdsl demo`: dispatch the generated kernels on a small model-shaped example.

On a CUDA GPU the kernels run natively; without one, the CPU tensors go through
Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported,
which the README's command does). Each result is checked against an fp32
dequantize-then-matmul computed here in plain torch.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import kdsl
from kdsl import ops, registry


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _report(label: str, entry_name: str, err: float, limit: float, seconds: float) -> bool:
    ok = err < limit
    print(f"  {'ok  ' if ok else 'FAIL'} {label:<28} rel err {err:.2e} (< {limit:.2g})  {seconds * 1e3:8.1f} ms  via {entry_name}")
    return ok


def run_demo() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU and TRITON_INTERPRET is not 1: the ops would use their torch fallbacks, "
              "not the generated kernels. Run: TRITON_INTERPRET=1 python -m kdsl demo", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    arch = registry.device_arch(device)
    # Small enough for the interpreter, shaped like a slice of a DeepSeek-V3 / Llama layer.
    m, n, k = (64, 2112, 7168) if device.type == "cuda" else (5, 208, 512)
    print(f"kdsl demo on {where} (selecting for sm_{arch}); {len(registry.entries())} generated kernels")
    torch.manual_seed(0)
    all_ok = True

    scheme = kdsl.scheme_from_hf({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"})
    print(f"block FP8 ({scheme.name}), M={m} N={n} K={k}")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    start = time.perf_counter()
    w_q, w_s = ops.weight_quant(w)
    x_q, x_s = ops.act_quant(x)
    y = ops.fp8_gemm(x_q, x_s, w_q, w_s)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # Reference: dequantize both operands in fp32 with plain torch, then one matmul.
    x_deq = (x_q.float().view(m, k // 128, 128) * x_s[..., None]).view(m, k)
    w_deq = (w_q.float() * w_s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    all_ok &= _report("fp8_gemm vs fp32", registry.select("fp8_gemm", scheme, arch=arch).name,
                      _rel_err(y, x_deq @ w_deq.T), 1e-2, seconds)
    all_ok &= _report("fp8 path vs bf16 matmul", "quantization error", _rel_err(y, x.float() @ w.float().T), 6e-2, 0.0)
    w_back = ops.weight_dequant(w_q, w_s)
    all_ok &= _report("weight_dequant vs fp32", registry.select("weight_dequant", scheme, arch=arch).name,
                      _rel_err(w_back, w_deq), 1e-2, 0.0)

    gptq = kdsl.scheme_from_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                "sym": True, "checkpoint_format": "gptq", "damp_percent": 0.01})
    print(f"GPTQ INT4 ({gptq.name}), M={m} N={n} K={k}")
    checkpoint = ops.gptq_quantize(w.half(), group_size=128, sym=True)
    xh = x.half()
    start = time.perf_counter()
    y4 = ops.gptq_gemm(xh, checkpoint["qweight"], checkpoint["qzeros"], checkpoint["scales"], checkpoint["g_idx"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    w4 = ops.gptq_dequant(checkpoint["qweight"], checkpoint["qzeros"], checkpoint["scales"], checkpoint["g_idx"])
    all_ok &= _report("gptq_gemm vs x @ dequant(w).T", registry.select("gptq_gemm", gptq, arch=arch).name,
                      _rel_err(y4, xh.float() @ w4.float().T), 1e-2, seconds)
    all_ok &= _report("int4 path vs fp16 matmul", "quantization error", _rel_err(y4, x.float() @ w.float().T), 0.2, 0.0)
    all_ok &= _model_demo(device, k=512 if device.type == "cpu" else 4096)
    print("all results match their references" if all_ok else "SOME RESULTS ARE WRONG")
    return 0 if all_ok else 1


def _model_demo(device: torch.device, k: int) -> bool:
    """The user path: a float model, kdsl.quantize_, then eager and torch.compile(fullgraph=True) runs."""
    from torch import nn

    ok = True
    # Round-to-nearest int4 keeps about 10% relative error on random weights, fp8 about 5%.
    for scheme, dtype, limit in ((kdsl.GPTQ(group_size=128), torch.float16, 0.15),
                                 (kdsl.BlockFP8(), torch.bfloat16, 0.08)):
        model = nn.Sequential(nn.Linear(k, 2 * k), nn.SiLU(), nn.Linear(2 * k, k)).to(device, dtype)
        x = torch.randn(4, k, device=device, dtype=dtype)
        with torch.no_grad():
            dense = model(x).float()
            kdsl.quantize_(model, scheme)
            print(f"model: quantize_(..., {scheme.name}) -> {model[0]}")
            start = time.perf_counter()
            eager = model(x)
            seconds = time.perf_counter() - start
            ok &= _report("eager model vs float model", type(model[0]).__name__, _rel_err(eager, dense), limit, seconds)
            # On the CPU, aot_eager: inductor's C++ compile would take minutes on a small machine.
            backend = "inductor" if device.type == "cuda" else "aot_eager"
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            start = time.perf_counter()
            traced = compiled(x)
            seconds = time.perf_counter() - start
            # Inductor fuses the SiLU in fp32, so the next layer may quantize a few activations to the
            # neighbouring fp8 code: the compiled model is held to the float model, as the eager one is.
            ok &= _report(f"compiled ({backend}) vs float", "torch.ops.kdsl, no graph break",
                          _rel_err(traced, dense), limit, seconds)
    return ok
