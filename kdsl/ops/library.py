"""kdsl's ops as PyTorch custom operators, torch.ops.kdsl.*, so torch.compile(fullgraph=True) traces a
model that calls them without a graph break.

    kdsl::act_quant(Tensor x, int group_size) -> (Tensor, Tensor)            # q, s
    kdsl::weight_quant(Tensor w, int block_n, int block_k) -> (Tensor, Tensor)  # q, s
    kdsl::weight_dequant(Tensor q, Tensor s, int block_n, int block_k, ScalarType out_dtype) -> Tensor
    kdsl::fp8_gemm(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor
    kdsl::fp8_bmm(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor
    kdsl::fp8_linear(Tensor x, Tensor w, Tensor w_s, Tensor? bias, ScalarType? out_dtype) -> Tensor
    kdsl::gptq_gemm(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits,
                    int group_size, str checkpoint_format) -> Tensor
    kdsl::gptq_dequant(Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits,
                       int group_size, str checkpoint_format) -> Tensor
    kdsl::w4a16_gemm(Tensor x, Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm,
                     str scheme, str source, int bits, int group_size, str layout_zeros,
                     str layout_weights, int k, int n, bool contiguous_groups, int zero_bias) -> Tensor
    kdsl::w4a16_dequant(Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm, str scheme,
                        str source, int bits, int group_size, str layout_zeros, str layout_weights, int k, int n,
                        bool contiguous_groups, int zero_bias) -> Tensor
    kdsl::awq_gemm(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor
    kdsl::awq_dequant(Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor
    kdsl::fp8_grouped_gemm(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor group_ids, ScalarType out_dtype,
                           bool check_ids) -> Tensor
    kdsl::fp8_grouped_gemm_masked(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor masked_m,
                                  ScalarType out_dtype, int? expected_m) -> Tensor
    kdsl::moe_fp8(Tensor x, Tensor w13, Tensor w13_s, Tensor w2, Tensor w2_s, Tensor topk_weights,
                  Tensor topk_ids, bool check_ids) -> Tensor
    kdsl::moe_w4a16(Tensor x, Tensor w13_qweight, Tensor w13_zeros, Tensor w13_scales, Tensor? w13_perm,
                    Tensor w2_qweight, Tensor w2_zeros, Tensor w2_scales, Tensor? w2_perm, str scheme, str source,
                    int bits, int group_size, str layout_zeros, str layout_weights, int zero_bias,
                    Tensor topk_weights, Tensor topk_ids, bool check_ids) -> Tensor
    kdsl::silu_mul(Tensor gate_up) -> Tensor
    kdsl::silu_mul_quant(Tensor gate_up, int group_size) -> (Tensor, Tensor)        # q, s

None mutates its inputs; every output is a new contiguous tensor. kdsl.ops.fp8_bmm's `out=` is therefore not
part of kdsl::fp8_bmm: eagerly the Python function writes into out directly (no copy, no dispatcher); under
torch.compile it calls the functional op and copies the result into out (out.copy_, which Dynamo traces as an
ordinary in-place op). A mutating op (`Tensor(a!)? out`) could not return out (a custom op may not return an
alias of an input), so it would need a second schema or a wrapper anyway, and auto_functionalize copies too. Block sizes, group sizes and bits
are `int`, not `SymInt`: they pick a kernel, so a symbolic one is specialized (guarded) by Dynamo
before the op sees it. Tensor sizes stay symbolic: under torch.compile(dynamic=True) one graph serves
every M, because the Python that looks at M (tile choice, empty-M shortcuts, the 2-D fast path) runs
inside the op, at run time, not in traced code; the fake kernels' checks on K and N become guards
(K % 128 == 0), not specializations. (Dynamo's own 0/1 specialization still gives M = 1 a graph of
its own, unless M is marked with torch._dynamo.mark_unbacked.)

Routing. The public functions (kdsl.ops.fp8_gemm, ...) call their implementation (`_<op>_impl`)
directly in eager mode: going through the dispatcher costs host microseconds per call, and eager
decode is launch-bound. Under torch.compile (torch.compiler.is_compiling()), they call
torch.ops.kdsl.<op> instead, which Dynamo records as one opaque node; its fake kernel below gives the
outputs' shapes, dtypes and strides, and the compiled graph runs the same implementation.

Argument checks. Each op's checks live in one function, `_<op>_outputs`, that checks the arguments
and allocates the empty outputs; the implementation and the fake kernel both call it, so the outputs
the fake kernel describes are the ones the implementation returns, and a bad argument raises the same
exception with the same message on both paths. Eagerly it raises before any launch, as it always did.
Under torch.compile it raises while Dynamo traces (the fake kernel runs then), and Dynamo reports it
as torch._dynamo.exc.TorchRuntimeError whose message holds the original one ("got ValueError('b: N =
20 must be a multiple of 8')"). One check needs data, not only metadata: gptq_gemm's and gptq_dequant's range check of
g_idx's values; the fake kernel leaves it out and the op raises it when it runs (ValueError, as
eagerly). Checks of Python-only arguments made before the op is called (qzeros/scales missing in
gptq_gemm, `prepared` not a W4A16Prepared, block_size not a pair) are plain Python raises in traced
code: with fullgraph=True Dynamo stops with Unsupported ("Observed exception"); without it, Dynamo
falls back to eager for that frame, which raises the original exception.
"""
from __future__ import annotations

import functools

import torch

from kdsl.ops import _checks as check
from kdsl.ops import _plan, activation, awq, block_fp8, gptq, moe, w4a16, w4a16_moe

SCHEMAS = {
    "act_quant": "(Tensor x, int group_size) -> (Tensor, Tensor)",
    "weight_quant": "(Tensor w, int block_n, int block_k) -> (Tensor, Tensor)",
    "weight_dequant": "(Tensor q, Tensor s, int block_n, int block_k, ScalarType out_dtype) -> Tensor",
    "fp8_gemm": "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor",
    "fp8_bmm": "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor",
    "fp8_linear": "(Tensor x, Tensor w, Tensor w_s, Tensor? bias, ScalarType? out_dtype) -> Tensor",
    "gptq_gemm": "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits, "
                 "int group_size, str checkpoint_format) -> Tensor",
    "gptq_dequant": "(Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits, int group_size, "
                    "str checkpoint_format) -> Tensor",
    # W4A16Prepared crosses the boundary as its tensors and plain fields (kdsl.ops.w4a16.prepared_args);
    # the implementation rebuilds it (prepared_from_args). layout_weights "" means the layout has no "weights".
    "w4a16_gemm": "(Tensor x, Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm, "
                  "str scheme, str source, int bits, int group_size, str layout_zeros, str layout_weights, "
                  "int k, int n, bool contiguous_groups, int zero_bias) -> Tensor",
    # The same fields without x (kdsl.ops.w4a16.prepared_args): the prepared weights as w [N, K].
    "w4a16_dequant": "(Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm, str scheme, "
                     "str source, int bits, int group_size, str layout_zeros, str layout_weights, int k, int n, "
                     "bool contiguous_groups, int zero_bias) -> Tensor",
    "awq_gemm": "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor",
    "awq_dequant": "(Tensor qweight, Tensor qzeros, Tensor scales, int group_size) -> Tensor",
    # The MoE ops (kdsl.ops.moe). check_ids reads ids on the host unless a CUDA graph is being captured, so they
    # stay capturable (not tagged cudagraph_unsafe): captured calls skip the check.
    "fp8_grouped_gemm": "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor group_ids, ScalarType out_dtype, "
                        "bool check_ids) -> Tensor",
    "fp8_grouped_gemm_masked": "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor masked_m, ScalarType out_dtype, "
                               "int? expected_m) -> Tensor",
    "moe_fp8": "(Tensor x, Tensor w13, Tensor w13_s, Tensor w2, Tensor w2_s, Tensor topk_weights, Tensor topk_ids, "
               "bool check_ids) -> Tensor",
    # Two W4A16ExpertsPrepared cross as their tensors and the fields they share (kdsl.ops.w4a16_moe.prepared_args).
    "moe_w4a16": "(Tensor x, Tensor w13_qweight, Tensor w13_zeros, Tensor w13_scales, Tensor? w13_perm, "
                 "Tensor w2_qweight, Tensor w2_zeros, Tensor w2_scales, Tensor? w2_perm, str scheme, str source, "
                 "int bits, int group_size, str layout_zeros, str layout_weights, int zero_bias, "
                 "Tensor topk_weights, Tensor topk_ids, bool check_ids) -> Tensor",
    # The gated MLP's activation (kdsl.ops.activation).
    "silu_mul": "(Tensor gate_up) -> Tensor",
    "silu_mul_quant": "(Tensor gate_up, int group_size) -> (Tensor, Tensor)",
}


# Ops whose implementation waits on the GPU or copies from the host (a check of g_idx's values, awq_gemm
# preparing its weights on every call, awq_dequant's nibble order): a CUDA graph cannot capture them, so
# torch.compile(mode="reduce-overhead") must leave them out.
# The tag is missing from older torch, which then has no way to be told.
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)
HOST_SYNCING = ("gptq_gemm", "gptq_dequant", "awq_gemm", "awq_dequant")


def _recording_no_plans(impl):
    """impl, recording no launch plan (kdsl/ops/_plan.py) while it runs: compiled graphs call the op, and under
    mode="reduce-overhead" Inductor's CUDA graph trees own the memory of what it allocates then; a plan recorded
    there would keep its output templates alive in their pool, which they refuse. Plans recorded by eager calls
    still replay (their templates live outside any pool)."""
    @functools.wraps(impl)
    def run(*args):
        if not _plan.RECORD:
            return impl(*args)
        _plan.RECORD = False
        try:
            return impl(*args)
        finally:
            _plan.RECORD = True
    return run


def _no_backward(name: str):
    """An autograd formula for kdsl::name that refuses, in forward, an input that requires grad with the message
    the ops' eager checks give (kdsl.ops._checks.inference_only). The checks cannot say it under torch.compile:
    the fake kernel runs below autograd, where torch's own "no autograd formula" error would come first."""
    arguments = [argument.name for argument in torch._C.parse_schema(f"kdsl::{name}{SCHEMAS[name]}").arguments]

    def setup_context(ctx, inputs, output):
        for argument, value in zip(arguments, inputs):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                check.inference_only(argument)

    def backward(ctx, *grads):  # never reached: setup_context refused the inputs that would need it
        raise AssertionError(f"kdsl::{name} has no backward")
    return backward, setup_context


def _op(name: str, impl, fake):
    """Register kdsl::name with the implementation impl (every device), the fake kernel fake and an autograd
    formula that refuses inputs requiring grad (_no_backward)."""
    tags = (_CUDAGRAPH_UNSAFE,) if name in HOST_SYNCING and _CUDAGRAPH_UNSAFE is not None else ()
    op = torch.library.custom_op(f"kdsl::{name}", _recording_no_plans(impl), mutates_args=(),
                                 schema=SCHEMAS[name], tags=tags)
    op.register_fake(fake)
    backward, setup_context = _no_backward(name)
    op.register_autograd(backward, setup_context=setup_context)
    return op


# --- implementations that take the op's arguments where the public function takes others --------

def _w4a16_gemm(x, *fields):
    return w4a16._w4a16_gemm_impl(x, _prepared(*fields))


def _w4a16_dequant(*fields):
    return w4a16._w4a16_dequant_impl(_prepared(*fields))


def _prepared(qweight, zeros, scales, groups, perm, scheme, source, bits, group_size, layout_zeros,
              layout_weights, k, n, contiguous_groups, zero_bias):
    """The W4A16Prepared the implementations take, from the op's arguments."""
    if layout_zeros == "paired" and not _paired(scales, zeros):
        # The "paired" kernels read each (scale, zero) through scales' pointer: the two must be the views of one
        # [G, N, 2] tensor that prepare() made. An op's result may depend only on its inputs' values, not on how
        # they alias (torch.compile or opcheck may pass copies), so copies are paired again here.
        pairs = torch.stack((scales, zeros), dim=-1)
        scales, zeros = pairs[..., 0], pairs[..., 1]
    return w4a16.prepared_from_args(qweight, zeros, scales, groups, perm, scheme, source, bits, group_size,
                                    layout_zeros, layout_weights, k, n, contiguous_groups, zero_bias)


def _paired(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    return (scales.dim() == 2 and scales.stride(1) == 2 and zeros.stride() == scales.stride()
            and zeros.data_ptr() == scales.data_ptr() + scales.element_size())


# --- fake kernels: the same checks and empty outputs as the implementations ----------------------

def _act_quant_fake(x, group_size):
    _, q, s = block_fp8._act_quant_outputs(x, group_size)
    return q, s


def _weight_quant_fake(w, block_n, block_k):
    _, q, s = block_fp8._weight_quant_outputs(w, block_n, block_k)
    return q, s


def _weight_dequant_fake(q, s, block_n, block_k, out_dtype):
    return block_fp8._weight_dequant_outputs(q, s, block_n, block_k, out_dtype)[1]


def _fp8_gemm_fake(a, a_s, b, b_s, out_dtype):
    return block_fp8._fp8_gemm_outputs(a, a_s, b, b_s, out_dtype, symbolic=True)[-1]


def _fp8_bmm(a, a_s, b, b_s, out_dtype):
    return block_fp8._fp8_bmm_impl(a, a_s, b, b_s, out_dtype)


def _fp8_bmm_fake(a, a_s, b, b_s, out_dtype):
    return block_fp8._fp8_bmm_outputs(a, a_s, b, b_s, out_dtype, symbolic=True)[-1]


def _fp8_linear_fake(x, w, w_s, bias, out_dtype):
    return block_fp8._fp8_linear_outputs(x, w, w_s, bias, out_dtype, symbolic=True)[-1]


def _gptq_gemm_fake(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format):
    return gptq._gptq_gemm_outputs(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format,
                                   values=False)[1]


def _gptq_dequant_fake(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format):
    return gptq._gptq_dequant_outputs(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format,
                                      values=False)[1]


def _w4a16_gemm_fake(x, *fields):
    return w4a16._w4a16_gemm_outputs(x, w4a16.prepared_from_args(*fields))


def _w4a16_dequant_fake(*fields):
    return w4a16._w4a16_dequant_outputs(w4a16.prepared_from_args(*fields))


def _fp8_grouped_gemm_fake(a, a_s, b, b_s, group_ids, out_dtype, check_ids):
    return moe._fp8_grouped_gemm_outputs(a, a_s, b, b_s, group_ids, out_dtype, symbolic=True)[-1]


def _fp8_grouped_gemm_masked_fake(a, a_s, b, b_s, masked_m, out_dtype, expected_m):
    return moe._fp8_grouped_gemm_masked_outputs(a, a_s, b, b_s, masked_m, out_dtype, symbolic=True)[-1]


def _moe_fp8_fake(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids):
    return moe._moe_fp8_outputs(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, symbolic=True)[-1]


def _moe_w4a16_experts(w13_qweight, w13_zeros, w13_scales, w13_perm, w2_qweight, w2_zeros, w2_scales, w2_perm,
                       *shared):
    """(w13, w2) as kdsl.ops.moe_w4a16 takes them, from the op's arguments."""
    return (w4a16_moe.prepared_from_args(w13_qweight, w13_zeros, w13_scales, w13_perm, *shared),
            w4a16_moe.prepared_from_args(w2_qweight, w2_zeros, w2_scales, w2_perm, *shared))


def _moe_w4a16(x, *args):
    *fields, topk_weights, topk_ids, check_ids = args
    return w4a16_moe._moe_w4a16_impl(x, *_moe_w4a16_experts(*fields), topk_weights, topk_ids, check_ids)


def _moe_w4a16_fake(x, *args):
    *fields, topk_weights, topk_ids, check_ids = args
    return w4a16_moe._moe_w4a16_outputs(x, *_moe_w4a16_experts(*fields), topk_weights, topk_ids)


def _silu_mul_fake(gate_up):
    return activation._silu_mul_outputs(gate_up)[1]


def _silu_mul_quant_fake(gate_up, group_size):
    _, q, s = activation._silu_mul_quant_outputs(gate_up, group_size)
    return q, s


act_quant = _op("act_quant", block_fp8._act_quant_impl, _act_quant_fake)
weight_quant = _op("weight_quant", block_fp8._weight_quant_impl, _weight_quant_fake)
weight_dequant = _op("weight_dequant", block_fp8._weight_dequant_impl, _weight_dequant_fake)
fp8_gemm = _op("fp8_gemm", block_fp8._fp8_gemm_impl, _fp8_gemm_fake)
fp8_bmm = _op("fp8_bmm", _fp8_bmm, _fp8_bmm_fake)
fp8_linear = _op("fp8_linear", block_fp8._fp8_linear_impl, _fp8_linear_fake)
gptq_gemm = _op("gptq_gemm", gptq._gptq_gemm_impl, _gptq_gemm_fake)
gptq_dequant = _op("gptq_dequant", gptq._gptq_dequant_impl, _gptq_dequant_fake)
w4a16_gemm = _op("w4a16_gemm", _w4a16_gemm, _w4a16_gemm_fake)
w4a16_dequant = _op("w4a16_dequant", _w4a16_dequant, _w4a16_dequant_fake)
awq_gemm = _op("awq_gemm", awq._awq_gemm_impl, awq._awq_gemm_outputs)
awq_dequant = _op("awq_dequant", awq._awq_dequant_impl, awq._awq_dequant_outputs)
fp8_grouped_gemm = _op("fp8_grouped_gemm", moe._fp8_grouped_gemm_impl, _fp8_grouped_gemm_fake)
fp8_grouped_gemm_masked = _op("fp8_grouped_gemm_masked", moe._fp8_grouped_gemm_masked_impl,
                              _fp8_grouped_gemm_masked_fake)
moe_fp8 = _op("moe_fp8", moe._moe_fp8_impl, _moe_fp8_fake)
moe_w4a16_op = _op("moe_w4a16", _moe_w4a16, _moe_w4a16_fake)
silu_mul = _op("silu_mul", activation._silu_mul_impl, _silu_mul_fake)
silu_mul_quant = _op("silu_mul_quant", activation._silu_mul_quant_impl, _silu_mul_quant_fake)

OPS = {op._name.removeprefix("kdsl::"): op for op in (act_quant, weight_quant, weight_dequant, fp8_gemm, fp8_bmm,
                                                     fp8_linear, gptq_gemm, gptq_dequant, w4a16_gemm, awq_gemm, awq_dequant,
                                                     w4a16_dequant,
                                                     fp8_grouped_gemm, fp8_grouped_gemm_masked, moe_fp8,
                                                     silu_mul, silu_mul_quant, moe_w4a16_op)}
