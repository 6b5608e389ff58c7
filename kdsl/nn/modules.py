"""Quantized drop-ins for nn.Linear: y = x W^T + bias, with W held the way kdsl's kernels read it.

FP8Linear keeps DeepSeek-V3 block-FP8 weights (weight float8_e4m3fn [N, K] and weight_scale_inv float32
per block) and quantizes activations per token on every call. W4A16Linear keeps int4 weights prepared for
the w4a16 kernels (kdsl.ops.gptq_prepare / awq_prepare), which depend on the device's arch: build or load
the module on the device it will run on.

A module is built only for a scheme whose ops it calls are served by generated kernels (docs/definitions.md,
"What the modules run"): an unserved one is refused at construction with kdsl.SchemeNotServedError naming the
op. Inference only: an input that requires grad while grad mode is on is refused (kdsl.ops' checks).
"""
from __future__ import annotations

import operator

import torch
from torch import nn

from kdsl import ops, registry
from kdsl.ops.block_fp8 import act_quant_fp8_gemm, linear_scheme
from kdsl.ops.w4a16 import PREPARED_OP, W4A16Prepared
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
# FP8Linear runs the fused fp8_linear (one launch) for up to this many rows outside torch.compile, where the
# host's cost per launch sets the pace of eager decode; otherwise act_quant + fp8_gemm, whose kernels take less
# GPU time (on an H100 the fused kernel took 0.87-1.34x their GPU time at M = 1, 1.19-1.79x at M = 16, 2.4-4.6x
# at M = 64: benchmarks/results/host_h100/fp8_linear/). Under torch.compile (its CUDA graphs included) the host
# cost is gone and GPU time decides, so compiled code takes the two kernels: its outputs may differ from eager
# ones by a rounding (the fused kernel adds the bias in fp32, and the GEMM tiles differ). A CUDA graph captured
# by hand has no host cost either, so capture takes the two kernels too (whole-model graphs of FP8Linear at
# M = 1 ran at bf16's speed with the fused kernel in them: issue 47).
FUSED_MAX_ROWS = 16


def _kernel_name(op: str, scheme: str, device: torch.device) -> str:
    """The kernel the registry picks for op on device, or why there is none (for repr)."""
    try:
        return registry.dispatch(op, scheme, device).name
    except (LookupError, RuntimeError) as error:
        return f"none ({str(error).splitlines()[0]})"


def _path_repr(device: torch.device, kernels: str) -> str:
    """repr's account of what runs: the path (kdsl.registry.run_path) and the kernels; on the torch fallback the
    kernels are only what TRITON_INTERPRET=1 would run, so they are not named as running."""
    path = registry.run_path(device)
    if path == registry.TORCH_FALLBACK:
        return f"path={path} (no generated kernel runs; under TRITON_INTERPRET=1: {kernels})"
    return f"path={path}, {kernels}"


def _not_served(module: str, op: str, scheme: str, served, wanted: str = "") -> registry.SchemeNotServedError:
    return registry.SchemeNotServedError(
        op, scheme, f"{module}: scheme {scheme} needs {op}{wanted}, which no generated kernel serves; {op} serves: "
                    f"{', '.join(sorted(served)) or 'none'} (add a variant of {op} to the scheme's definition and "
                    f"run `kdsl generate`)")


def _fp8_fused(scheme: BlockFP8, n: int, k: int, blocks: tuple[int, int]) -> bool:
    """Refuse a scheme whose act_quant or fp8_gemm no generated kernel serves (SchemeNotServedError naming the
    op); return whether fp8_linear serves it for this weight, fp8_linear being optional (act_quant + fp8_gemm
    compute the same). act_quant picks its kernel by act_group alone, fp8_gemm and fp8_linear by the scale
    shapes, fp8_linear without an act_group: it serves only where its pick for these shapes is this scheme."""
    groups = registry.scheme_fields("act_quant")
    if not any(f["act_group"] == scheme.act_group and f["fmt"] == scheme.fmt for f in groups.values()):
        raise _not_served("FP8Linear", "act_quant", scheme.name, groups, f" (act_group = {scheme.act_group})")
    if scheme.name not in registry.served_schemes("fp8_gemm"):
        raise _not_served("FP8Linear", "fp8_gemm", scheme.name, registry.served_schemes("fp8_gemm"))
    return linear_scheme(k, n, blocks) == scheme.name


def _static_address(tensor: torch.Tensor | None) -> None:
    """Tell torch.compile that a CUDA buffer stays at its address between calls, as it assumes of nn.Parameters.
    Otherwise mode="reduce-overhead" copies the quantized modules' buffers into its CUDA graph's memory before
    every replay (H200, four Llama-3-8B layers at M = 1: 16 copies per forward launched from the host, and the
    compiled W4A16 model ran at 672 us per forward against 238 us for a graph captured by hand)."""
    if tensor is not None and tensor.is_cuda:
        import torch._dynamo  # what torch.compile imports anyway; seconds on a slow host, so only for CUDA buffers

        torch._dynamo.mark_static_address(tensor)


def add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h), h) for h = x + residual: one launch where the norm offers forward_add (kdsl.nn.RMSNorm), else
    torch's add, then the norm."""
    forward_add = getattr(norm, "forward_add", None)
    if forward_add is not None:
        return forward_add(x, residual)
    h = x + residual
    return norm(h), h


def _gemm_out_dtype(x: torch.Tensor) -> torch.dtype:
    """What FP8Linear's GEMM writes for input x: x's dtype where fp8_gemm writes it, else bf16."""
    return x.dtype if x.dtype in FLOAT_OUT else torch.bfloat16


class KeepsQuantizedDtypes(nn.Module):
    """Keeps its quantized buffers' dtypes through .to(dtype) / .half() / .bfloat16(): those move them to another
    device at most (a cast would silently change what the kernels read); buffers named in FOLLOWS_CAST follow it.
    Its CUDA buffers are marked static for torch.compile's CUDA graphs (_static_address), again after a move."""

    FOLLOWS_CAST: tuple[str, ...] = ()

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        _static_address(tensor)

    def _apply(self, fn, recurse=True):
        before = {name: t for name, t in self._buffers.items() if t is not None and name not in self.FOLLOWS_CAST}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        for tensor in self._buffers.values():
            _static_address(tensor)
        return self


class _QuantizedLinear(KeepsQuantizedDtypes):
    """What kdsl.parallel asks of a quantized linear it shards, so it holds no per-scheme branch: partial() (a
    row shard's output before the reduce), and a gated MLP's SiLU * up fused into the module's input
    (SILU_MUL_OP, silu_mul_serves, forward_silu_mul)."""

    FOLLOWS_CAST = ("bias",)
    SILU_MUL_OP: str  # the kernel writing silu(gate) * up as this module takes its input

    def partial(self, x: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """self(x) as a tensor-parallel partial to be summed in reduce_dtype (the caller converts it)."""
        return self(x)

    def silu_mul_serves(self, features: int) -> bool:
        """Whether SILU_MUL_OP can write this module's input of `features` columns from [..., 2 * features]."""
        raise NotImplementedError

    def forward_silu_mul(self, h: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """self(silu(h[..., :I]) * h[..., I:]) with SILU_MUL_OP computing the input; out_dtype: what the GEMM
        writes where it can (a float32 partial), else the activation dtype."""
        raise NotImplementedError

    def forward_normed(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """self(norm(x)), with the norm writing this module's input as its GEMM reads it where a kernel does that
        (model code that runs a norm straight into a linear calls this: kdsl's model bench does)."""
        return self(norm(x))

    def forward_add_normed(self, x: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h)), h) for h = x + residual: a decoder layer's residual add, the norm after it and this
        linear, with the add and the norm in one launch where the norm offers it (kdsl.nn.RMSNorm.forward_add)."""
        normed, h = add_then_norm(norm, x, residual)
        return self(normed), h


class FP8Linear(_QuantizedLinear):
    """Block-FP8 linear layer: per-token activation quantization (act_quant), then fp8_gemm; eager calls of few
    rows run the two in one launch (kdsl.ops.fp8_linear, bias added in its fp32 accumulator; FUSED_MAX_ROWS)
    where an fp8_linear kernel serves the scheme (`fused`, decided at construction), else the two ops."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 scheme: BlockFP8 | None = None):
        super().__init__()
        self.scheme = scheme or BlockFP8()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise TypeError(f"weight: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        block_n, block_k = self.scheme.weight_block
        blocks = (-(-n // block_n), -(-k // block_k))
        if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != blocks:
            raise ValueError(f"weight_scale_inv: expected float32 {blocks} (one scale per {block_n}x{block_k} block "
                             f"of weight {tuple(weight.shape)}), got {weight_scale_inv.dtype} "
                             f"{tuple(weight_scale_inv.shape)}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        self.fused = _fp8_fused(self.scheme, n, k, blocks)
        # whether a norm can quantize this module's input (forward_normed)
        self.norm_quant = self._quantizes_input(self.NORM_QUANT_OP, k)
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: BlockFP8 | None = None) -> "FP8Linear":
        """Quantize a float nn.Linear's weight in the scheme's blocks (kdsl.ops.weight_quant)."""
        scheme = scheme or BlockFP8()
        q, s = ops.weight_quant(linear.weight.detach(), block_size=scheme.weight_block)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, s, bias, scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = _gemm_out_dtype(x)
        few = x.dim() > 0 and x.numel() <= FUSED_MAX_ROWS * x.shape[-1]
        if self.fused and few and not torch.compiler.is_compiling() and not (
                x.is_cuda and torch.cuda.is_current_stream_capturing()):
            rows = x.numel() // x.shape[-1]
            if x.is_cuda and rows not in self._unfused_warm_rows:
                # A CUDA graph captured later records the two ops below, not this launch: run them once now, outside
                # the capture, so their kernels are compiled and fp8_gemm's split-K scratch exists (scratch first
                # allocated inside a capture adds a memset to every replay: 12 per forward of 4 Llama layers).
                self._unfused_warm_rows = self._unfused_warm_rows | {rows}
                self._unfused(x, out_dtype)
            return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, out_dtype=out_dtype)
        return self._unfused(x, out_dtype)

    _unfused_warm_rows: frozenset = frozenset()  # row counts whose unfused path ran once eagerly (see forward)

    def _unfused(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # act_quant + fp8_gemm, one launch plan for the two (one op's host time per eager call)
        y = act_quant_fp8_gemm(x, self.weight, self.weight_scale_inv, self.scheme.act_group, out_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    SILU_MUL_OP = "silu_mul_quant"  # h quantized in the act_group this module's GEMM reads: no act_quant of its own

    def forward_quantized(self, q: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The output for an input already quantized as act_quant writes it (q e4m3, s float32 per act_group):
        one fp8_gemm writing out_dtype, then the bias."""
        y = ops.fp8_gemm(q, s, self.weight, self.weight_scale_inv, out_dtype=out_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def partial(self, x: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """A float32 reduction takes float32 partials straight from the GEMM's accumulator: act_quant reads x in its
        own dtype, so x is not converted (a float32 x would quantize to the same codes at twice the bytes)."""
        if reduce_dtype == torch.float32 and x.dtype != torch.float32:
            a, a_s = ops.act_quant(x, group_size=self.scheme.act_group)
            return self.forward_quantized(a, a_s, torch.float32)
        return self(x)

    def _quantizes_input(self, op: str, features: int) -> bool:
        """Whether a kernel of op writes this module's input of `features` columns quantized in its act_group."""
        group = self.scheme.act_group
        return features % group == 0 and any(
            fields.get("act_group") == group for fields in registry.scheme_fields(op).values())

    def silu_mul_serves(self, features: int) -> bool:
        return self._quantizes_input(self.SILU_MUL_OP, features)

    def forward_silu_mul(self, h: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        q, s = ops.silu_mul_quant(h, self.scheme.act_group)
        return self.forward_quantized(q, s, out_dtype)

    NORM_QUANT_OP = "rms_norm_quant"  # a norm's rows quantized in this module's act_group: no act_quant of its own
    norm_quant: bool = False  # set at construction: whether a kernel of NORM_QUANT_OP serves this module's input

    def forward_normed(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """A norm with forward_quantized(x, group_size) (kdsl.nn.RMSNorm) quantizes its output for the GEMM itself
        (rms_norm_quant: one launch, not a norm and an act_quant); any other norm, or a group no kernel serves,
        runs as self(norm(x)). The codes come from the norm's fp32 rows, not rounded to x's dtype first."""
        quantized = getattr(norm, "forward_quantized", None)
        if quantized is None or not self.norm_quant:
            return self(norm(x))
        q, s = quantized(x, self.scheme.act_group)
        return self.forward_quantized(q, s, _gemm_out_dtype(x))

    def forward_add_normed(self, x: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_normed of h = x + residual, and h: a norm with forward_add_quantized (kdsl.nn.RMSNorm) adds,
        normalizes and quantizes for the GEMM in one add_rms_norm_quant launch; any other norm as the base class
        runs it."""
        quantized = getattr(norm, "forward_add_quantized", None)
        if quantized is None or not self.norm_quant:
            return super().forward_add_normed(x, residual, norm)
        q, s, h = quantized(x, residual, self.scheme.act_group)
        return self.forward_quantized(q, s, _gemm_out_dtype(x)), h

    def extra_repr(self) -> str:
        device = self.weight.device
        kernels = f"kernel={_kernel_name('fp8_gemm', self.scheme.name, device)}, " + (
            f"fused={_kernel_name('fp8_linear', self.scheme.name, device)} (uncompiled, M <= {FUSED_MAX_ROWS})"
            if self.fused else "fused=none (no fp8_linear kernel serves the scheme: act_quant + fp8_gemm at every M)")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.name}, {_path_repr(device, kernels)}")


class W4A16Linear(_QuantizedLinear):
    """Int4-weight linear layer on prepared weights (GPTQ v1/v2 with or without act-order, AWQ): w4a16_gemm.
    Activations must come in the dtype the weights were prepared with (the scales' dtype)."""

    def __init__(self, prepared: W4A16Prepared, bias: torch.Tensor | None = None,
                 scheme: GPTQ | AWQ | None = None):
        super().__init__()
        if not isinstance(prepared, W4A16Prepared):
            raise TypeError(f"prepared: expected kdsl.ops.gptq_prepare/awq_prepare output, got {type(prepared).__name__}")
        if bias is not None and tuple(bias.shape) != (prepared.n,):
            raise ValueError(f"bias: expected shape ({prepared.n},), got {tuple(bias.shape)}")
        if prepared.scheme not in registry.served_schemes(PREPARED_OP):
            raise _not_served("W4A16Linear", PREPARED_OP, prepared.scheme, registry.served_schemes(PREPARED_OP))
        self.scheme = scheme
        self.in_features, self.out_features = prepared.k, prepared.n
        self._fields = {name: getattr(prepared, name) for name in (
            "scheme", "source", "bits", "group_size", "layout", "dtype", "k", "n", "contiguous_groups", "zero_bias")}
        self.register_buffer("qweight", prepared.qweight)
        if prepared.layout["zeros"] == "paired":
            # One buffer of (scale, zero) pairs [G, N, 2], the views taken from it when used: the zeros view starts
            # 2 bytes in, and torch.compile's CUDA graphs copy an input that is not 16-byte aligned before every
            # replay; .to() would also turn the two views into two unrelated contiguous tensors.
            self.register_buffer("pairs", torch.stack((prepared.scales, prepared.zeros), dim=-1))
        else:
            self.register_buffer("zeros", prepared.zeros)
            self.register_buffer("scales", prepared.scales)
        self.register_buffer("groups", prepared.groups)
        self.register_buffer("perm", prepared.perm)
        self.register_buffer("bias", bias)

    def _weights(self) -> tuple:
        buffers = self._buffers
        zeros = buffers["pairs"] if "pairs" in buffers else buffers["zeros"]
        return buffers["qweight"], zeros, buffers.get("scales"), buffers["groups"], buffers["perm"]

    def _prepare(self, tensors: tuple) -> W4A16Prepared:
        qweight, zeros, scales, groups, perm = tensors
        if scales is None:  # the paired layout: zeros holds the pairs
            scales, zeros = zeros[..., 0], zeros[..., 1]
        return W4A16Prepared(qweight=qweight, zeros=zeros, scales=scales, groups=groups, perm=perm, **self._fields)

    @property
    def prepared(self) -> W4A16Prepared:
        """The weights as kdsl.ops.w4a16_gemm takes them (the module's buffers, wherever .to() moved them).
        Built again only when a buffer was replaced: building it took 13 us of host time per call. Under
        torch.compile it is built in the traced code, so the pairs' views are taken inside the graph."""
        tensors = self._weights()
        if torch.compiler.is_compiling():
            return self._prepare(tensors)
        cached = self.__dict__.get("_prepared_cache")
        if cached is None or any(map(operator.is_not, cached[0], tensors)):
            cached = (tensors, self._prepare(tensors))
            self.__dict__["_prepared_cache"] = cached
        return cached[1]

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: GPTQ | AWQ | None = None) -> "W4A16Linear":
        """Round-to-nearest int4 quantization of a float nn.Linear (kdsl.ops.gptq_quantize: GPTQ's storage
        format, not its error-compensating algorithm), prepared for the weight's device. AWQ schemes get the
        same round-to-nearest weights: prepared, the two are one layout."""
        scheme = scheme or GPTQ()
        weight = linear.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
        sym = getattr(scheme, "sym", False)
        ck = ops.gptq_quantize(weight.to(dtype), bits=scheme.bits, group_size=scheme.group_size, sym=sym)
        prepared = ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, bits=scheme.bits,
                                    group_size=scheme.group_size, checkpoint_format="gptq")
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(prepared, bias, scheme)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, scheme: GPTQ | None = None) -> "W4A16Linear":
        """From a GPTQ checkpoint's tensors (layout: kdsl.ops.gptq_checkpoint), prepared on their device."""
        scheme = scheme or GPTQ()
        prepared = ops.gptq_prepare(qweight, qzeros, scales, g_idx, bits=scheme.bits, group_size=scheme.group_size,
                                    checkpoint_format=scheme.checkpoint_format)
        return cls(prepared, None if bias is None else bias.to(scales.dtype), scheme)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, scheme: AWQ | None = None) -> "W4A16Linear":
        """From an AutoAWQ "gemm" checkpoint's tensors, prepared on their device."""
        scheme = scheme or AWQ()
        prepared = ops.awq_prepare(qweight, qzeros, scales, group_size=scheme.group_size)
        return cls(prepared, None if bias is None else bias.to(scales.dtype), scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.w4a16_gemm(x, self.prepared)
        return y if self.bias is None else y + self.bias

    SILU_MUL_OP = "silu_mul"  # h in the activation dtype, which the w4a16 kernels read

    def silu_mul_serves(self, features: int) -> bool:
        return bool(registry.served_schemes(self.SILU_MUL_OP))

    def forward_silu_mul(self, h: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self(ops.silu_mul(h).contiguous())  # the kernels write the activation dtype whatever out_dtype

    def extra_repr(self) -> str:
        scheme = self.scheme.name if self.scheme is not None else self._fields["source"]
        kernel = _kernel_name(PREPARED_OP, self._fields["scheme"], self.qweight.device)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={scheme}, weights={self._fields['scheme']} {self._fields['layout']}, "
                f"{_path_repr(self.qweight.device, f'kernel={kernel}')}")
