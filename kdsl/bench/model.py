"""`kdsl bench --model PRESET`: whole decoder layers as a user runs them, timed whole.

N layers with distinct weights (so at decode they stream from DRAM, not L2), each: RMSNorm -> qkv -> o (the
attention itself is left out: it is the same for every variant) -> residual add -> RMSNorm -> gate_up ->
SiLU*mul -> down -> residual add. A preset with multi-head latent attention (DeepSeek-V3's MLA, `mla`) runs its
decode path instead of qkv -> o: q_a and kv_a as one projection (qkv), q_b, the absorbed per-head BMMs (q_nope
against W_UK into the latent space, then the latent against W_UV; the attention over the latent cache left out)
and o. The same glue runs for every variant: the norms are kdsl.nn.RMSNorm (one kernel, as serving stacks fuse
them; torch.nn.RMSNorm's took about 4.3 us a call at decode on an H200, kdsl's about 1.5), each residual add runs in
the norm after it (add_rms_norm: the layer carries the residual stream beside its output, as vLLM's decoder layers
do; the last layer's output is added once at the end), SiLU*mul is kdsl.ops.silu_mul. As serving stacks do, the FP8
variant has those kernels write its GEMMs' quantized input (add_rms_norm_quant, rms_norm_quant, silu_mul_quant:
FP8Linear.forward_add_normed, forward_normed and forward_silu_mul) instead of running act_quant after them; its o
projection, after the attention, quantizes its own input.

  fp16 / bf16    nn.Linear (cuBLAS): the baseline
  w4a16          kdsl.quantize_(model, kdsl.GPTQ(group_size=128)), fp16 activations
  fp8            kdsl.quantize_(model, kdsl.BlockFP8()), bf16 activations; MLA's absorbed BMMs as act_quant +
                 kdsl.ops.fp8_bmm on 128x128-block weights (the other variants run them as torch.bmm in their
                 activation dtype)
  torchao-fp8    torchao's Float8DynamicActivationFloat8WeightConfig (per-row), where torchao imports
  torchao-int4   torchao's Int4WeightOnlyConfig(group_size=128), bf16 activations, where torchao and its int4
                 kernels import (the peer of w4a16)

Each is timed as one hand-captured CUDA graph of the forward, eagerly, and under
torch.compile(mode="reduce-overhead", fullgraph=True) (compiled per M, so it is the slowest mode to run: --modes
picks). Every mode is timed the same way: calls back to back, CUDA events around a batch of them, so the time is
the GPU's where the host keeps ahead and the host's pace where it does not; the host's time per call is in the
JSON (host_us) and on the progress lines. All the models are built first; at each M the captured and eager ones
take turns batch by batch, so a host that runs slower for a while slows them alike. Ratios are the float model's
time over the variant's in the same mode and run. The fraction of the roofline is the weight bytes of the layers
over the measured device copy rate (decode) or the linears' FLOPs over the measured dense fp16/fp8 matmul rate
(prefill), taken in the same run. The linears' share of a forward is 1 - glue / variant, where glue is the same
forward with every linear (and MLA's absorbed BMMs) replaced by a stand-in that only allocates its output
(glue-fp16, glue-bf16: timed with the others, same M and mode): what the norms, SiLU * mul and residual adds cost
(for FP8, whose norms and SiLU * mul also quantize, a share slightly too high).
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kdsl.bench import profile
from kdsl.bench.report import kernel_lines


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's decode path (DeepSeek-V3): q_lora and kv_lora ranks, the rope part of q and
    k, heads, and the per-head dims of q/k without rope (nope) and of v."""
    q_lora: int
    kv_lora: int
    rope: int
    heads: int
    nope: int
    v_head: int


DEEPSEEK_V3_MLA = MLA(q_lora=1536, kv_lora=512, rope=64, heads=128, nope=128, v_head=128)

PRESETS = {
    # name: hidden, qkv out, o in, intermediate, layers (distinct weights)[, MLA]
    "llama-3-8b": (4096, 6144, 4096, 14336, 4),
    "llama-3-70b-tp8": (8192, 1280, 1024, 3584, 8),
    "qwen2.5-32b": (5120, 7168, 5120, 27648, 3),
    # MLA: qkv is q_a and kv_a as one projection (1536 + 512 + 64), o's input the heads' v (128 x 128); dense MLP
    "deepseek-v3-dense": (7168, 1536 + 512 + 64, 128 * 128, 18432, 2, DEEPSEEK_V3_MLA),
}
DECODE_M = (1, 4, 16, 64)
PREFILL_M = (512, 2048, 8192)
MODES = ("graph", "eager", "compile")
VARIANTS = ("w4a16", "fp8", "torchao-fp8", "torchao-int4")


@dataclass(frozen=True)
class Shape:
    hidden: int
    qkv: int
    o_in: int
    inter: int
    layers: int
    mla: MLA | None = None

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each layer's linears."""
        q_b = [] if self.mla is None else [(self.mla.q_lora, self.mla.heads * (self.mla.nope + self.mla.rope))]
        return [(self.hidden, self.qkv), *q_b, (self.o_in, self.hidden), (self.hidden, 2 * self.inter),
                (self.inter, self.hidden)]

    def linear_weights(self) -> int:
        return self.layers * sum(k * n for k, n in self.linears())

    def bmm_weights(self) -> int:
        """MLA's absorbed per-head weights, W_UK [heads, kv_lora, nope] and W_UV [heads, v_head, kv_lora]."""
        if self.mla is None:
            return 0
        mla = self.mla
        return self.layers * mla.heads * mla.kv_lora * (mla.nope + mla.v_head)

    def weights(self) -> int:
        return self.linear_weights() + self.bmm_weights()


SHAPE_KEYS = ("hidden", "qkv", "o_in", "inter", "layers")
MLA_KEYS = ("q_lora", "kv_lora", "rope", "heads", "nope", "v_head")


def parse_shape(spec: str) -> tuple[str, Shape]:
    """A preset name, or a JSON file {"hidden":, "qkv":, "o_in":, "inter":, "layers":} with an optional "mla":
    {"q_lora":, "kv_lora":, "rope":, "heads":, "nope":, "v_head":} (then qkv = q_lora + kv_lora + rope and
    o_in = heads * v_head). Keys it does not know are refused."""
    if spec in PRESETS:
        return spec, Shape(*PRESETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--model {spec}: neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        doc = json.loads(path.read_text())
        unknown = set(doc) - set(SHAPE_KEYS) - {"mla"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        mla = None
        if "mla" in doc:
            unknown = set(doc["mla"]) - set(MLA_KEYS)
            if unknown:
                raise ValueError(f"unknown mla keys {sorted(unknown)}")
            mla = MLA(**{key: int(doc["mla"][key]) for key in MLA_KEYS})
        shape = Shape(**{key: int(doc[key]) for key in SHAPE_KEYS}, mla=mla)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--model {spec}: expected JSON with integer hidden, qkv, o_in, inter, layers and an "
                         f"optional mla {{{', '.join(MLA_KEYS)}}} ({error})") from None
    if mla is not None and (shape.qkv != mla.q_lora + mla.kv_lora + mla.rope or shape.o_in != mla.heads * mla.v_head):
        raise ValueError(f"--model {spec}: with mla, qkv must be q_lora + kv_lora + rope "
                         f"({mla.q_lora + mla.kv_lora + mla.rope}) and o_in heads * v_head ({mla.heads * mla.v_head})")
    return path.stem, shape


@functools.cache
def _mla_modules():
    """(AbsorbedMLA, FP8AbsorbedMLA): MLA's absorbed BMMs in the activation dtype, and with block-FP8 weights."""
    import torch
    from torch import nn

    from kdsl.ops import act_quant, fp8_bmm, weight_quant

    class AbsorbedMLA(nn.Module):
        """q [M, heads * (nope + rope)] -> [M, heads * v_head]: q_nope against W_UK [heads, kv_lora, nope] into the
        latent space, then (the attention over the latent cache left out) against W_UV [heads, v_head, kv_lora]."""

        def __init__(self, mla: MLA, dtype, device):
            super().__init__()
            self.mla = mla
            self.w_uk = nn.Parameter(torch.empty(mla.heads, mla.kv_lora, mla.nope, dtype=dtype, device=device))
            self.w_uv = nn.Parameter(torch.empty(mla.heads, mla.v_head, mla.kv_lora, dtype=dtype, device=device))
            nn.init.normal_(self.w_uk, std=mla.nope ** -0.5)
            nn.init.normal_(self.w_uv, std=mla.kv_lora ** -0.5)

        def forward(self, q):
            mla, m = self.mla, q.shape[0]
            q_nope = q.view(m, mla.heads, mla.nope + mla.rope)[..., : mla.nope].transpose(0, 1)
            latent = torch.bmm(q_nope, self.w_uk.transpose(1, 2))
            return torch.bmm(latent, self.w_uv.transpose(1, 2)).transpose(0, 1).reshape(m, mla.heads * mla.v_head)

    class FP8AbsorbedMLA(nn.Module):
        """AbsorbedMLA with its weights in 128x128-block FP8 (weight_quant per head) and its activations quantized
        per 1x128 group (act_quant) before each kdsl.ops.fp8_bmm; the per-head activations go as transposed
        views, and the second BMM writes o's input [M, heads, v_head] in place."""

        def __init__(self, dense: AbsorbedMLA):
            super().__init__()
            self.mla, self.dtype = dense.mla, dense.w_uk.dtype
            for name in ("w_uk", "w_uv"):
                w = getattr(dense, name).detach()
                q, s = weight_quant(w.reshape(-1, w.shape[-1]))
                self.register_buffer(name, q.view(w.shape))
                self.register_buffer(name + "_s", s.view(w.shape[0], -1, s.shape[-1]))

        def forward(self, q):
            mla, m = self.mla, q.shape[0]
            q8, q_s = act_quant(q.view(m, mla.heads, mla.nope + mla.rope)[..., : mla.nope])
            latent = fp8_bmm(q8.transpose(0, 1), q_s.transpose(0, 1), self.w_uk, self.w_uk_s, out_dtype=self.dtype)
            l8, l_s = act_quant(latent)
            out = torch.empty(m, mla.heads, mla.v_head, dtype=self.dtype, device=q.device)
            fp8_bmm(l8, l_s, self.w_uv, self.w_uv_s, out_dtype=self.dtype, out=out.transpose(0, 1))
            return out.view(m, mla.heads * mla.v_head)

    return AbsorbedMLA, FP8AbsorbedMLA


NORM_EPS = 1e-5  # Llama's rms_norm_eps


def _normed(linear, norm, x):
    """linear(norm(x)), fused the way serving stacks fuse it where the linear offers that (FP8Linear: the norm
    quantizes its input, no act_quant launch); every other linear runs after the norm as it is."""
    forward_normed = getattr(linear, "forward_normed", None)
    return forward_normed(x, norm) if forward_normed is not None else linear(norm(x))


def _add_normed(linear, norm, x, residual):
    """(linear(norm(h)), h) for h = x + residual, the add and the norm one kernel (add_rms_norm) for every variant;
    FP8Linear's (add_rms_norm_quant) writes its quantized input as well."""
    from kdsl.nn.modules import add_then_norm

    forward_add_normed = getattr(linear, "forward_add_normed", None)
    if forward_add_normed is not None:
        return forward_add_normed(x, residual, norm)
    normed, h = add_then_norm(norm, x, residual)
    return linear(normed), h


def _silu_mul_into(linear, gate_up):
    """linear(silu(gate) * up) with the activation one kdsl kernel for every variant: silu_mul, or for FP8Linear
    silu_mul_quant (its input quantized, no act_quant launch)."""
    from kdsl import ops

    inter = gate_up.shape[-1] // 2
    silu_mul_serves = getattr(linear, "silu_mul_serves", None)
    if silu_mul_serves is not None and silu_mul_serves(inter):
        return linear.forward_silu_mul(gate_up, gate_up.dtype)
    return linear(ops.silu_mul(gate_up))


def build(shape: Shape, dtype, device: str = "cuda"):
    """The float model of shape: a torch.nn.Module taking x [M, hidden]."""
    import torch
    from torch import nn

    from kdsl.nn import RMSNorm

    mla = shape.mla

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = RMSNorm(shape.hidden, NORM_EPS, dtype=dtype, device=device)
            self.qkv = nn.Linear(shape.hidden, shape.qkv, bias=False, dtype=dtype, device=device)
            if mla is not None:
                self.q_b = nn.Linear(mla.q_lora, mla.heads * (mla.nope + mla.rope), bias=False, dtype=dtype,
                                     device=device)
                self.absorbed = _mla_modules()[0](mla, dtype, device)
            self.o = nn.Linear(shape.o_in, shape.hidden, bias=False, dtype=dtype, device=device)
            self.norm2 = RMSNorm(shape.hidden, NORM_EPS, dtype=dtype, device=device)
            self.gate_up = nn.Linear(shape.hidden, 2 * shape.inter, bias=False, dtype=dtype, device=device)
            self.down = nn.Linear(shape.inter, shape.hidden, bias=False, dtype=dtype, device=device)

        def forward(self, x, residual):
            """x + residual is the layer's input (residual None: x alone); returns its output as (the down
            projection's delta, the residual stream), which the next layer's first norm adds, as serving stacks
            carry them."""
            if residual is None:
                q, residual = _normed(self.qkv, self.norm1, x), x
            else:
                q, residual = _add_normed(self.qkv, self.norm1, x, residual)
            if mla is not None:  # q_a's part of qkv through q_b (q_a's RMSNorm and the rope left out)
                attn = self.absorbed(self.q_b(q[:, : mla.q_lora]))
            else:  # attention left out: o reads a slice of qkv's output as wide as its input (tiled when narrower)
                attn = (q[:, : shape.o_in] if shape.qkv >= shape.o_in
                        else q.repeat(1, -(-shape.o_in // shape.qkv))[:, : shape.o_in])
            gate_up, residual = _add_normed(self.gate_up, self.norm2, self.o(attn), residual)
            return _silu_mul_into(self.down, gate_up), residual

    class Decoder(nn.Sequential):
        def forward(self, x):
            residual = None
            for layer in self:
                x, residual = layer(x, residual)
            return x + residual

    torch.manual_seed(0)
    model = Decoder(*[Layer() for _ in range(shape.layers)]).eval()
    for layer in model:
        for linear in (layer.qkv, getattr(layer, "q_b", None), layer.o, layer.gate_up, layer.down):
            if linear is not None:
                nn.init.normal_(linear.weight, std=0.02)
    return model.requires_grad_(False)


@functools.cache
def _output_only():
    from torch import nn

    class OutputOnly(nn.Module):
        """A linear's (or the absorbed BMMs') stand-in in the glue model: allocates [..., out_features], computes
        nothing (no kernel: its contents are whatever the allocator hands out, which the glue's timing ignores)."""

        def __init__(self, out_features: int):
            super().__init__()
            self.out_features = out_features

        def forward(self, x):
            return x.new_empty((*x.shape[:-1], self.out_features))

    return OutputOnly


def glue(shape: Shape, dtype, device: str = "cuda"):
    """The float model of shape with its matmuls left out: every linear, and MLA's absorbed BMMs, replaced by a
    stand-in that only allocates its output. Its time is what the rest of the forward costs."""
    output_only = _output_only()
    model = build(shape, dtype, device)
    for layer in model:
        for name in ("qkv", "q_b", "o", "gate_up", "down"):
            linear = getattr(layer, name, None)
            if linear is not None:
                setattr(layer, name, output_only(linear.out_features))
        if shape.mla is not None:
            layer.absorbed = output_only(shape.mla.heads * shape.mla.v_head)
    return model


BASES = {"w4a16": "fp16", "fp8": "bf16", "torchao-fp8": "bf16", "torchao-int4": "bf16"}  # each variant's float model
GLUE = {"fp16": "glue-fp16", "bf16": "glue-bf16"}  # the glue model of each float model's dtype


def variant(name: str, shape: Shape, device: str = "cuda"):
    """The model of a variant (fp16, bf16 or one of VARIANTS); ImportError where its package is missing."""
    import torch

    from kdsl.nn import quantize_ as kdsl_quantize_
    from kdsl.schema import GPTQ, BlockFP8

    dtype = torch.float16 if name in ("fp16", "w4a16", GLUE["fp16"]) else torch.bfloat16
    if name in GLUE.values():
        return glue(shape, dtype, device), dtype
    model = build(shape, dtype, device)
    if name == "w4a16":
        kdsl_quantize_(model, GPTQ(group_size=128))
    elif name == "fp8":
        kdsl_quantize_(model, BlockFP8())
        if shape.mla is not None:
            fp8_mla = _mla_modules()[1]
            for layer in model:
                layer.absorbed = fp8_mla(layer.absorbed)
    elif name == "torchao-fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    elif name == "torchao-int4":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model, Int4WeightOnlyConfig(group_size=128))
    return model, dtype


def _runner(model, x, mode: str):
    """A callable that runs one forward of model on x in `mode`: the captured graph's replay, the eager model, or
    the model compiled with torch.compile(mode="reduce-overhead", fullgraph=True)."""
    import torch

    if mode == "graph":
        return profile.captured(lambda: model(x)).replay
    if mode == "eager":
        return lambda: model(x)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    return lambda: compiled(x.clone())  # a fresh input: cudagraph trees reuse their outputs


def _time_steady(runners: dict, reps: int = 7) -> dict:
    """{name: (GPU us per call, host us per call)} with calls issued back to back, as a serving loop issues them:
    CUDA events around a batch of one runner's calls (enough for ~5 ms), the median of `reps` batches, the runners
    taking turns batch by batch so that they share the host's state (between processes, and over one, the same
    eager call here took up to twice as long on the host). The host time is the Python side of one call,
    unsynchronized; where it exceeds the GPU's the first is the host's pace, which is what such a loop gets. One
    call timed alone from an idle GPU would add the host's time to the GPU's in every mode but the graph's
    (torch.compile's cudagraph trees spend 120-190 us of Python per call on an H200's host), which made
    compiled models look slower than captured ones."""
    import time

    import torch

    calls = {}
    for name, fn in runners.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        calls[name] = max(3, min(50, int(5e-3 / max(time.perf_counter() - start, 1e-6))))
    times = {name: [] for name in runners}
    hosts = {name: [] for name in runners}
    for _ in range(reps):
        for name, fn in runners.items():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            host = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            hosts[name].append((time.perf_counter() - host) / calls[name] * 1e6)
            end.record()
            end.synchronize()
            times[name].append(begin.elapsed_time(end) * 1e3 / calls[name])
    return {name: (statistics.median(times[name]), statistics.median(hosts[name])) for name in runners}


def time_models(models: dict, mode: str) -> dict:
    """{name: (microseconds per forward, host microseconds per forward)} of models {name: (model, x)} in `mode`,
    calls back to back. Captured and eager models take turns (_time_steady); compiled ones are timed one after
    the other, each compiled afresh (torch._dynamo.reset), so no model's guards or cudagraph tree meets another's."""
    import torch

    with torch.inference_mode():
        if mode != "compile":
            return _time_steady({name: _runner(model, x, mode) for name, (model, x) in models.items()})
        timed = {}
        for name, (model, x) in models.items():
            torch._dynamo.reset()
            timed.update(_time_steady({name: _runner(model, x, mode)}))
        return timed


def ceilings() -> tuple[float, float, float]:
    """Measured copy rate (bytes/s), fp16 and fp8 dense matmul rates (FLOP/s) of this GPU."""
    import torch
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    half = 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a, return_mode="median") * 1e-3)
    a8 = a.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8 = 2 * 8192**3 / (triton.testing.do_bench(
        lambda: torch._scaled_mm(a8, a8.T, one, one, out_dtype=torch.bfloat16), return_mode="median") * 1e-3)
    return copy, half, fp8


def run_model_bench(spec: str, ms: list[int], modes: list[str], variants: list[str], json_path: str | None,
                    plot_path: str | None, layers: int | None = None, kernels: bool = False) -> int:
    import torch

    name, shape = parse_shape(spec)
    if layers is not None:
        shape = replace(shape, layers=layers)
    copy_rate, fp16_rate, fp8_rate = ceilings()
    print(f"kdsl bench --model {name}: {shape.layers} layers, weights {shape.weights() / 1e9:.2f} G params; "
          f"copy {copy_rate / 1e12:.2f} TB/s, fp16 {fp16_rate / 1e12:.0f} TFLOP/s, fp8 {fp8_rate / 1e12:.0f} "
          f"TFLOP/s measured", file=sys.stderr)
    rows = []
    needed = list(dict.fromkeys(BASES[v] for v in variants))  # the float models the variants are compared with
    bytes_per_weight = {"fp16": 2, "bf16": 2, "w4a16": 0.5 + 4 / 128, "fp8": 1 + 4 / 128**2, "torchao-fp8": 1,
                        "torchao-int4": 0.5 + 4 / 128}
    bytes_per_bmm_weight = {"fp8": 1 + 4 / 128**2}  # MLA's absorbed weights: the others keep them in 16 bits
    models = {}
    for model_name in needed + [GLUE[base] for base in needed] + variants:
        try:
            models[model_name] = variant(model_name, shape)
        except ImportError as error:
            print(f"  {model_name}: not available ({error})", file=sys.stderr)
        except Exception as error:  # noqa: BLE001 - a peer's API that moved: its rows are left out, said so
            if model_name in ("fp16", "bf16", "w4a16", "fp8"):
                raise
            print(f"  {model_name}: not available ({type(error).__name__}: {error})", file=sys.stderr)
    flops_per_row = 2 * shape.weights()
    for m in ms:
        inputs = {dtype: torch.randn(m, shape.hidden, device="cuda", dtype=dtype)
                  for dtype in dict.fromkeys(dtype for _, dtype in models.values())}
        for mode in modes:
            # Every model of this M and mode is timed in one go (eager and graph taking turns); a failure times
            # the others on their own, and the failing one gets its row with the error.
            group = {name: (model, inputs[dtype]) for name, (model, dtype) in models.items()}
            try:
                timed = time_models(group, mode)
            except Exception:  # noqa: BLE001 - one cell fails, the table goes on
                timed = {}
                for name, one in group.items():
                    try:
                        timed.update(time_models({name: one}, mode))
                    except Exception as error:  # noqa: BLE001
                        timed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            for model_name in models:
                result = timed[model_name]
                us, host_us, note = (None, None, result) if isinstance(result, str) else (*result, None)
                has_matmuls = model_name not in GLUE.values()
                moved = (shape.linear_weights() * bytes_per_weight[model_name]
                         + shape.bmm_weights() * bytes_per_bmm_weight.get(model_name, 2)) if has_matmuls else 0
                rows.append({"model": model_name, "m": m, "mode": mode, "us": us, "host_us": host_us,
                             "error": note,
                             "tokens_per_s": None if not us or not has_matmuls else m / us * 1e6,
                             "roofline": None if not us or not has_matmuls else (
                                 moved / copy_rate * 1e6 / us if m <= max(DECODE_M)
                                 else m * flops_per_row / (fp8_rate if "fp8" in model_name else fp16_rate)
                                 * 1e6 / us)})
                print(f"  {model_name:12s} M={m:5d} {mode:8s} "
                      + (f"{us:10.1f} us (host {host_us:.1f} us)" if us else f"failed: {note}"),
                      file=sys.stderr, flush=True)
                if kernels and mode == "graph" and us:
                    rows[-1]["kernels_us"] = forward_kernels(model_name, *group[model_name])
    del models
    torch.cuda.empty_cache()
    add_ratios(rows)
    print(format_model_table(rows, name))
    if kernels:
        print(format_model_kernels(rows))
    if json_path:
        doc = {"tool": "kdsl bench --model", "preset": name, "shape": asdict(shape),
               "ceilings": {"copy_bytes_per_s": copy_rate, "fp16_flops": fp16_rate, "fp8_flops": fp8_rate},
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        Path(json_path).write_text(json.dumps(doc, indent=1))
    if plot_path:
        plot_speedups(rows, name, plot_path)
    return 0


def add_ratios(rows: list[dict]) -> None:
    """Sets each row's speedup (its float model's time over its own, same M and mode) and linears_share
    (1 - the glue model's time over its own, the glue of its float model's dtype); None where a time is missing,
    and for the glue rows."""
    time_of = {(r["model"], r["m"], r["mode"]): r["us"] for r in rows}
    for r in rows:
        if r["model"] in GLUE.values():
            r["speedup"] = r["linears_share"] = None
            continue
        base_name = BASES.get(r["model"], r["model"])
        base = time_of.get((base_name, r["m"], r["mode"]))
        rest = time_of.get((GLUE[base_name], r["m"], r["mode"]))
        r["speedup"] = base / r["us"] if base and r["us"] else None
        r["linears_share"] = 1 - rest / r["us"] if rest and r["us"] else None


def format_model_table(rows: list[dict], name: str) -> str:
    lines = [f"== {name}: time per forward (us), speedup = float model / variant, same mode and run; roofline = "
             "weight bytes at the copy rate (decode) or FLOPs at the matmul rate (prefill) over the time; lin = the "
             "linears' share of the forward (1 - glue / time; glue: the forward without its matmuls)"]
    lines.append(f"{'model':12s} {'M':>5s} " + " ".join(f"{mode + ' us':>11s} {'x':>6s} {'roof':>5s} {'lin':>4s}"
                                                       for mode in MODES))
    keys = list(dict.fromkeys((r["model"], r["m"]) for r in rows))
    by = {(r["model"], r["m"], r["mode"]): r for r in rows}
    for model, m in keys:
        cells = []
        for mode in MODES:
            r = by.get((model, m, mode))
            if r is None or r["us"] is None:
                cells.append(f"{'-' if r is None else 'failed':>11s} {'':>6s} {'':>5s} {'':>4s}")
                continue
            speed = f"{r['speedup']:.2f}" if r.get("speedup") else "-"
            roof = f"{r['roofline']:.2f}" if r.get("roofline") is not None else "-"
            share = f"{r['linears_share']:.0%}" if r.get("linears_share") is not None else "-"
            cells.append(f"{r['us']:11.1f} {speed:>6s} {roof:>5s} {share:>4s}")
        lines.append(f"{model:12s} {m:5d} " + " ".join(cells))
    return "\n".join(lines)


def forward_kernels(name: str, model, x) -> dict[str, float] | None:
    """kdsl bench --model --kernels: the device µs of each GPU kernel in one captured forward of model
    (kdsl.bench.profile), or None (said on stderr) where the profiler fails."""
    times, why = profile.kernel_times_or_why(lambda: model(x))
    if why:
        print(f"  {name}: no kernel breakdown ({why})", file=sys.stderr)
    return times


def format_model_kernels(rows: list[dict]) -> str:
    """Each captured forward's device time by kernel (rows with kernels_us), against the forward's graph time."""
    lines = ["== per-kernel device time of each captured forward (--kernels) =="]
    for r in rows:
        if r.get("kernels_us"):
            lines += kernel_lines(f"{r['model']} M={r['m']}", r["kernels_us"], r["us"], "forward", most=8)
    return "\n".join(lines)


def plot_speedups(rows: list[dict], name: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model in dict.fromkeys(r["model"] for r in rows if r["model"] not in ("fp16", "bf16", *GLUE.values())):
        for mode, style in zip(MODES, ("-", "--", ":")):
            pts = [(r["m"], r["speedup"]) for r in rows if r["model"] == model and r["mode"] == mode and r.get("speedup")]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{model} {mode}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("float model time / variant time")
    ax.set_title(f"{name}: whole-layer speedup (>1: faster than fp16/bf16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
