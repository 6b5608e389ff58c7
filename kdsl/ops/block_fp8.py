"""Block-FP8 tensor ops (DeepSeek-V3 layout): check arguments, then launch the registry's kernel.

Block sizes, group sizes and the fp8 format come from the schemes the manifest lists for each op
(kdsl.registry.scheme_fields), not from this file: an argument or a tensor's shape picks the served
scheme it matches, and what matches none is refused the same way on every path."""
from __future__ import annotations

import sys

import torch

from kdsl.kernels.c_abi import DTYPES, CArg, Check, OpAbi, fits_in_32_bits, not_null
from kdsl.ops import _checks as check
from kdsl.ops import _plan, fallback
from kdsl.ops._examples import empty, fp8_operands, gemm_shape
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

_PLANS = _plan.PLANS
_device = _plan.current_device

FP8 = torch.float8_e4m3fn  # "e4m3", the one fp8 format BlockFP8 schemes declare today
FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_BLOCK = (128, 128)


def _scheme(op: str, argument: str, value, field: str, wanted) -> str:
    """The served scheme of op whose manifest `field` equals `wanted` (the first by name); the call's
    `argument = value` chose it. None served: SchemeNotServedError naming the argument, on every path. The
    choice is memoized per (op, field, wanted): no formatting on the per-call path."""
    def find():
        return next((name for name, fields in registry.scheme_fields(op).items() if fields.get(field) == wanted),
                    None)
    found = registry.memo((op, field, tuple(wanted) if isinstance(wanted, list) else wanted), find)
    if found is None:  # raises, listing what is served
        registry.require_scheme(op, f"block_fp8 with {field} = {wanted}", f"{argument} = {value}")
    return found


def act_quant(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token in groups along K: s = amax(|group|) / 448, q = e4m3(x / s).

    x [..., K] bf16/fp16/fp32 with K % group_size == 0. Returns q float8_e4m3fn [..., K]
    and s float32 [..., K // group_size]. An all-zero group gets a tiny finite scale and zeros.

    NaN and inf (the same on the GPU, in Triton's interpreter and in the torch fallback): amax
    leaves NaN elements out, so a NaN element's code is NaN (byte 0x7F) and the rest of its group
    is quantized as if it were absent. A group holding +-inf gets amax = inf and s = +inf: the inf
    elements' codes are NaN (inf / inf) and the finite ones 0, so every dequantized value of that
    group (code * s) is NaN, and so is every fp8_gemm output that reads it.
    """
    # Under torch.compile Dynamo must see one opaque op, torch.ops.kdsl.act_quant (kdsl.ops.spec),
    # whose fake kernel gives the outputs' shapes, so no Python of ours (%, tile choice by M) is traced.
    # Eagerly the implementation is called directly: the dispatcher costs host microseconds per call,
    # and eager decode is launch-bound (the host, not the GPU, sets the pace).
    if torch.compiler.is_compiling():
        return torch.ops.kdsl.act_quant(x, group_size)
    return _act_quant_impl(x, group_size)


def _act_quant_outputs(x: torch.Tensor, group_size: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """act_quant's argument checks and its empty outputs (the fake kernel under torch.compile too)."""
    check.tensor("x", x, FLOAT_INPUTS, min_ndim=1)
    check.positive_power_of_two("group_size", group_size)
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"x: last dimension K = {k} must be a multiple of group_size = {group_size}")
    return _group_quant_outputs("act_quant", x, group_size)


def _group_quant_outputs(op: str, x: torch.Tensor, group_size: int,
                         width: int | None = None) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The scheme of op that quantizes in groups of group_size (checked by the caller) and op's empty outputs in
    act_quant's layout for rows of x's leading shape and `width` columns (x's last dimension by default): codes
    e4m3 [..., width] and scales float32 [..., width / group_size]."""
    scheme = _scheme(op, "group_size", group_size, "act_group", group_size)
    width = x.shape[-1] if width is None else width
    # new_empty, and no views where x is already [M, K] rows: on a slow host each torch call costs
    # microseconds, and a launch this short waits for them (docs/kernels.md, host time).
    q = x.new_empty((*x.shape[:-1], width), dtype=FP8)
    s = x.new_empty((*x.shape[:-1], width // group_size), dtype=torch.float32)
    return scheme, q, s


def _act_quant_impl(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A repeat call signature replays its launch plan (kdsl/ops/_plan.py: what the key holds and why).
    try:
        key = ("act_quant", type(group_size), group_size, _device(),
               type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad)
        plan = _PLANS.get(key)
    except Exception:  # not a tensor, say: the checks below word the error
        key = plan = None
    if plan:
        outputs = plan(x)
        if outputs is not None:
            return outputs
    scheme, q, s = _act_quant_outputs(x, group_size)
    k = x.shape[-1]
    if x.numel() == 0:
        return q, s
    if not check.use_kernels(x.device):
        q, s = fallback.act_quant(x, group_size)
        return q.contiguous(), s.contiguous()  # contiguous as the kernels' (and the fake kernel's) outputs
    entry = registry.dispatch("act_quant", scheme, x.device)
    with _plan.Recorder(entry.load() if plan is None else None) as rec:
        if x.dim() == 2 and x.stride(1) == 1:
            entry.launch(x, q, s, entry.tile_for(x.shape[0]))
        else:
            x2 = check.rows(x, k)
            entry.launch(x2, q.view(-1, k), s.view(-1, k // group_size), entry.tile_for(x2.shape[0]))
    _plan.store(key, rec, (x,), (q, s))
    return q, s


def weight_quant(w: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight [N, K] in (n, k) blocks: one float32 scale per block = block amax / 448.

    Returns q float8_e4m3fn [N, K] and s float32 [ceil(N / n), ceil(K / k)]; N and K need not
    be multiples of the block.

    NaN and inf, per block as act_quant per group: NaN elements are left out of the amax and get
    the NaN code (byte 0x7F), the rest of the block is quantized normally; a block holding +-inf
    gets s = +inf, NaN codes for the inf elements and 0 for the finite ones, so the whole block
    dequantizes to NaN, and every fp8_gemm output column that reads it is NaN.
    """
    block_n, block_k = _pair("block_size", block_size)
    if torch.compiler.is_compiling():  # see act_quant
        return torch.ops.kdsl.weight_quant(w, block_n, block_k)
    return _weight_quant_impl(w, block_n, block_k)


def _weight_quant_outputs(w: torch.Tensor, block_n: int, block_k: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    check.tensor("w", w, FLOAT_INPUTS, ndim=2)
    block_n, block_k = _block("block_size", (block_n, block_k))
    scheme = _scheme("weight_quant", "block_size", (block_n, block_k), "weight_block", [block_n, block_k])
    n, k = w.shape
    q = torch.empty((n, k), dtype=FP8, device=w.device)
    s = torch.empty((-(-n // block_n), -(-k // block_k)), dtype=torch.float32, device=w.device)
    return scheme, q, s


def _weight_quant_impl(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scheme, q, s = _weight_quant_outputs(w, block_n, block_k)
    n, k = w.shape
    if w.numel() == 0:
        return q, s
    if not check.use_kernels(w.device):
        q, s = fallback.weight_quant(w, block_n, block_k)
        return q.contiguous(), s.contiguous()
    entry = registry.dispatch("weight_quant", scheme, w.device)
    entry.launch(check.rows(w, k), q, s, entry.tile_for(n))
    return q, s


def weight_dequant(
    q: torch.Tensor, s: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """w [N, K] = q * s expanded over (n, k) blocks, in out_dtype (bf16, fp16 or fp32)."""
    block_n, block_k = _pair("block_size", block_size)
    if torch.compiler.is_compiling():  # see act_quant
        return torch.ops.kdsl.weight_dequant(q, s, block_n, block_k, out_dtype)
    return _weight_dequant_impl(q, s, block_n, block_k, out_dtype)


def _weight_dequant_outputs(q: torch.Tensor, s: torch.Tensor, block_n: int, block_k: int,
                            out_dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    check.tensor("q", q, (FP8,), ndim=2)
    check.tensor("s", s, (torch.float32,), ndim=2)
    block_n, block_k = _block("block_size", (block_n, block_k))
    check.out_dtype("out_dtype", out_dtype, FLOAT_INPUTS)
    scheme = _scheme("weight_dequant", "block_size", (block_n, block_k), "weight_block", [block_n, block_k])
    n, k = q.shape
    check.shape("s", s, (-(-n // block_n), -(-k // block_k)), f"one scale per {block_n}x{block_k} block of q")
    check.same_device(q=q, s=s)
    return scheme, torch.empty((n, k), dtype=out_dtype, device=q.device)


def _weight_dequant_impl(q: torch.Tensor, s: torch.Tensor, block_n: int, block_k: int,
                         out_dtype: torch.dtype) -> torch.Tensor:
    scheme, w = _weight_dequant_outputs(q, s, block_n, block_k, out_dtype)
    n, k = q.shape
    if q.numel() == 0:
        return w
    if not check.use_kernels(q.device):
        return fallback.weight_dequant(q, s, block_n, block_k, out_dtype).contiguous()
    entry = registry.dispatch("weight_dequant", scheme, q.device)
    entry.launch(check.rows(q, k), s, w, entry.tile_for(n))
    if q.device.type == "cpu":
        w[_interpreter_lost_nan(q)] = float("nan")
    return w


def fp8_gemm(
    a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C [..., N] = (a * a_s) @ (b * b_s)^T with DeepSeek-V3 block scaling, accumulated in fp32.

    a [..., K] float8_e4m3fn with a_s float32 [..., K / 128] (per token, per 128 along K);
    b [N, K] float8_e4m3fn with b_s float32 [ceil(N / 128), K / 128] (per 128x128 block, e.g. a
    checkpoint's weight_scale_inv). K must be a multiple of 128 and N of 8 (2112, 576, 72);
    any M, including 0.
    """
    if torch.compiler.is_compiling():  # see act_quant
        return torch.ops.kdsl.fp8_gemm(a, a_s, b, b_s, out_dtype)
    return _fp8_gemm_impl(a, a_s, b, b_s, out_dtype)


def _fp8_gemm_outputs(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                      out_dtype: torch.dtype, symbolic: bool = False) -> tuple[str, int, int, int, torch.Tensor]:
    """fp8_gemm's checks and empty output: (scheme, act_group, block_n, block_k, c). symbolic: sizes may be
    SymInts (the fake kernel under torch.compile), so the scheme is looked up without the memo's hashing."""
    check.tensor("a", a, (FP8,), min_ndim=1)
    check.tensor("a_s", a_s, (torch.float32,), min_ndim=1)
    check.tensor("b", b, (FP8,), ndim=2)
    check.tensor("b_s", b_s, (torch.float32,), ndim=2)
    check.out_dtype("out_dtype", out_dtype, FLOAT_INPUTS)
    k = a.shape[-1]
    n = b.shape[0]
    scheme, group, (block_n, block_k) = _gemm_scheme(k, n, a_s.shape[-1], tuple(b_s.shape), symbolic)
    if k % group:
        raise ValueError(f"a: last dimension K = {k} must be a multiple of {group}")
    if b.shape[1] != k:
        raise ValueError(f"b: expected shape (N, {k}) to match a's K = {k}, got {tuple(b.shape)}")
    if n % 8:
        # TMA stores need 16-byte rows: N * 2 bytes of bf16 output.
        raise ValueError(f"b: N = {n} must be a multiple of 8")
    check.shape("a_s", a_s, (*a.shape[:-1], k // group), f"one scale per token per {group} of K")
    check.shape("b_s", b_s, (-(-n // block_n), -(-k // block_k)), f"one scale per {block_n}x{block_k} block of b")
    check.same_device(a=a, a_s=a_s, b=b, b_s=b_s)
    c = a.new_empty((*a.shape[:-1], n), dtype=out_dtype)  # new_empty: see act_quant
    return scheme, group, block_n, block_k, c


def _gemm_plan_key(op: str, out_dtype: torch.dtype, a, a_s, b, b_s) -> tuple:
    """The launch plan's key of an fp8_gemm or fp8_bmm call (kdsl/ops/_plan.py): the op, out_dtype, the CUDA
    device, and each operand's type, shape, strides, dtype, device, 16-byte alignment and requires_grad (written
    out: host time; requires_grad, so a call the checks refuse never meets a plan, which skips them)."""
    return (op, out_dtype, _device(),
            type(a), a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15, a.requires_grad,
            type(a_s), a_s.shape, a_s.stride(), a_s.dtype, a_s.device, a_s.data_ptr() & 15, a_s.requires_grad,
            type(b), b.shape, b.stride(), b.dtype, b.device, b.data_ptr() & 15, b.requires_grad,
            type(b_s), b_s.shape, b_s.stride(), b_s.dtype, b_s.device, b_s.data_ptr() & 15, b_s.requires_grad)


def _replay(op: str, out_dtype: torch.dtype, a, a_s, b, b_s, lost_nan) -> tuple:
    """(key, plan, c) of an fp8_gemm or fp8_bmm call: its plan key (None where the arguments are not tensors:
    the op's checks word the error) and plan, and c, the output of the plan's replay, or None where no plan
    ran (a miss, NO_PLAN, or a plan declining). On the CPU lost_nan(a, b, c) restores the interpreter's NaNs."""
    try:
        key = _gemm_plan_key(op, out_dtype, a, a_s, b, b_s)
        plan = _PLANS.get(key)
    except Exception:  # not tensors, say
        return None, None, None
    c = plan(a, a_s, b, b_s) if plan else None
    if c is not None and not c.is_cuda:
        lost_nan(a, b, c)
    return key, plan, c


def _fp8_gemm_impl(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    # A repeat call signature replays its launch plan (kdsl/ops/_plan.py: what the key holds and why).
    key, plan, c = _replay("fp8_gemm", out_dtype, a, a_s, b, b_s, _fp8_gemm_lost_nan)
    if c is not None:
        return c
    scheme, group, block_n, block_k, c = _fp8_gemm_outputs(a, a_s, b, b_s, out_dtype)
    device = a.device
    k = a.shape[-1]
    n = b.shape[0]
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    flat = a.dim() == 2  # already [M, K]: no views (host time, as in act_quant)
    a2, a_s2 = (a, a_s) if flat else (a.reshape(-1, k), a_s.reshape(-1, k // group))
    if not check.use_kernels(device):
        return fallback.fp8_gemm(a2, a_s2, b, b_s, group, block_n, block_k, out_dtype).view(c.shape)
    # TMA wants contiguous, 16-byte aligned operands; the portable kernel is happy with them too.
    inputs = a, a_s, b, b_s
    a2, a_s2, b, b_s = (_aligned(t) for t in (a2, a_s2, b, b_s))
    entry = registry.dispatch("fp8_gemm", scheme, device)
    tile = entry.tile_for(a2.shape[0], n, _call(entry, a2.shape[0], n, device, a2, b))
    with _plan.Recorder(entry.modules[tile["impl"]].load() if plan is None else None) as rec:
        entry.launch(a2, a_s2, b, b_s, c if flat else c.view(-1, n), tile)
    _plan.store(key, rec, inputs, (c,))
    if device.type == "cpu":
        _fp8_gemm_lost_nan(a2, b, c)
    return c


def act_quant_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_size: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_gemm(*act_quant(x, group_size), w, w_s, out_dtype): the two ops, on the GPU with one launch plan for both
    (kdsl/ops/_plan.py), so an eager call pays one op's host time, not two (kdsl.nn.FP8Linear above the rows it
    fuses). The plan allocates the codes and scales beside the output; a miss, or a plan that declines, calls the
    two ops, which check and launch as ever."""
    if torch.compiler.is_compiling() or not (isinstance(x, torch.Tensor) and x.is_cuda):
        return fp8_gemm(*act_quant(x, group_size), w, w_s, out_dtype)  # the ops' checks word any error
    try:
        key = ("act_quant+fp8_gemm", type(group_size), group_size, out_dtype, _device(),
               type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad,
               type(w), w.shape, w.stride(), w.dtype, w.device, w.data_ptr() & 15, w.requires_grad,
               type(w_s), w_s.shape, w_s.stride(), w_s.dtype, w_s.device, w_s.data_ptr() & 15, w_s.requires_grad)
        plan = _PLANS.get(key)
    except Exception:  # not tensors, say: the ops' checks word the error
        key = plan = None
    if plan:
        outputs = plan(x, w, w_s)
        if outputs is not None:
            return outputs[0]
    # Inside the recording the two ops record nothing of their own and their plans decline (the recorder's launch
    # hook is set), so both launches go through the launcher and land in this one plan.
    with _plan.Recorder(sys.modules[__name__] if plan is None else None) as rec:
        q, s = act_quant(x, group_size)
        y = fp8_gemm(q, s, w, w_s, out_dtype)
    _plan.store(key, rec, (x, w, w_s), (y, q, s))
    return y


def _fp8_gemm_lost_nan(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """On the CPU, NaN where a row of a or a row of b holds the NaN code (see _interpreter_lost_nan)."""
    n = b.shape[0]
    c2 = c.view(-1, n)
    c2[_interpreter_lost_nan(a.reshape(-1, a.shape[-1])).any(dim=1)] = float("nan")
    c2[:, _interpreter_lost_nan(b).any(dim=1)] = float("nan")


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [..., N] = fp8_gemm(*act_quant(x), w, w_s) (+ bias) in one kernel launch and one output allocation.

    x [..., K] bf16/fp16/fp32 with K a multiple of the activation group (128); w [N, K] float8_e4m3fn with w_s
    float32 [ceil(N / 128), K / 128] (fp8_gemm's b and b_s); bias [N] bf16/fp16/fp32 or None; out_dtype
    bf16/fp16/fp32, None for x's dtype. The kernel quantizes each row's groups of x in registers with
    act_quant's code (same codes, scales, NaN and inf rules), so without bias the result is act_quant +
    fp8_gemm's bit for bit wherever the two run the same tile. bias is added in fp32 to the accumulator,
    before the one rounding to out_dtype (not to the rounded product, as `fp8_gemm(...) + bias` would).
    """
    if torch.compiler.is_compiling():  # see act_quant
        return torch.ops.kdsl.fp8_linear(x, w, w_s, bias, out_dtype)
    return _fp8_linear_impl(x, w, w_s, bias, out_dtype)


def _fp8_linear_outputs(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype | None, symbolic: bool = False) -> tuple[str, int, int, int, torch.Tensor]:
    """fp8_linear's checks and empty output: (scheme, act_group, block_n, block_k, y); symbolic as _fp8_gemm_outputs."""
    check.tensor("x", x, FLOAT_INPUTS, min_ndim=1)
    check.tensor("w", w, (FP8,), ndim=2)
    check.tensor("w_s", w_s, (torch.float32,), ndim=2)
    if bias is not None:
        check.tensor("bias", bias, FLOAT_INPUTS, ndim=1)
    out_dtype = x.dtype if out_dtype is None else check.out_dtype("out_dtype", out_dtype, FLOAT_INPUTS)
    k = x.shape[-1]
    n = w.shape[0]
    scheme, group, (block_n, block_k) = _linear_scheme(k, n, tuple(w_s.shape), symbolic)
    if k % group:
        raise ValueError(f"x: last dimension K = {k} must be a multiple of {group}")
    if w.shape[1] != k:
        raise ValueError(f"w: expected shape (N, {k}) to match x's K = {k}, got {tuple(w.shape)}")
    check.shape("w_s", w_s, (-(-n // block_n), -(-k // block_k)), f"one scale per {block_n}x{block_k} block of w")
    if bias is not None:
        check.shape("bias", bias, (n,), "one per output column, w's N")
    check.same_device(x=x, w=w, w_s=w_s, bias=bias)
    return scheme, group, block_n, block_k, x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


def _linear_scheme(k: int, n: int, w_blocks: tuple, symbolic: bool = False) -> tuple[str, int, tuple[int, int]]:
    """(scheme, act_group, (block_n, block_k)) of the served fp8_linear scheme whose weight scales w_s has, as
    _gemm_scheme does for fp8_gemm (the activations' scales are the kernel's own here)."""
    def find():
        served = registry.scheme_fields("fp8_linear")
        if not served:
            registry.require_scheme("fp8_linear", "block_fp8", "any block-FP8 scheme")  # raises
        found = _matching(served, k, n, w_blocks)
        if found is None:
            _refuse_unserved("fp8_linear", k, n, w_blocks, None, f"w_s shape {tuple(w_blocks)} for w ({n}, {k})")
            name, fields = next(iter(served.items()))
            found = name, fields["act_group"], tuple(fields["weight_block"])
        return found
    if symbolic:
        return find()
    return registry.memo(("fp8_linear", k, n, w_blocks), find)


def linear_scheme(k: int, n: int, w_blocks: tuple) -> str | None:
    """The served scheme fp8_linear runs for a weight [N, K] whose scales have shape w_blocks, None where no
    fp8_linear kernel serves those shapes. fp8_linear has no act_group argument: where two served schemes share
    weight blocks, it runs the first by name, so a caller with a scheme of its own (kdsl.nn.FP8Linear) compares."""
    found = _matching(registry.scheme_fields("fp8_linear"), k, n, tuple(w_blocks))
    return None if found is None else found[0]


# The block-FP8 ops: a scheme any of their definitions declares has every block-FP8 field (for _refuse_unserved).
BLOCK_FP8_OPS = ("act_quant", "weight_quant", "weight_dequant", "fp8_gemm", "fp8_bmm", "fp8_linear")


def _matching(served: dict[str, dict], k: int, n: int, b_blocks: tuple,
              a_groups: int | None = None) -> tuple[str, int, tuple[int, int]] | None:
    """(scheme, act_group, (block_n, block_k)) of the first scheme of served (by name) whose act_group divides K
    (and gives a_groups scales per token, where a_s is an argument) and whose weight blocks give b_blocks scales
    for [N, K]; None where none does."""
    for name, fields in served.items():
        group, (block_n, block_k) = fields["act_group"], fields["weight_block"]
        if (k % group == 0 and (a_groups is None or a_groups == k // group)
                and b_blocks == (-(-n // block_n), -(-k // block_k))):
            return name, group, (block_n, block_k)
    return None


def _refuse_unserved(op: str, k: int, n: int, b_blocks: tuple, a_groups: int | None, asked: str) -> None:
    """Shapes no served scheme of op has, but a block-FP8 scheme of another op's kernels has: raise
    SchemeNotServedError naming op and that scheme, rather than a shape error worded in another scheme's blocks."""
    known: dict[str, dict] = {}
    for other in BLOCK_FP8_OPS:
        known.update(registry.scheme_fields(other))
    found = _matching(dict(sorted(known.items())), k, n, b_blocks, a_groups)
    if found is not None:
        registry.require_scheme(op, found[0], asked)  # raises: found is not among op's served schemes


def _fp8_linear_impl(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype | None) -> torch.Tensor:
    # A repeat call signature replays its launch plan (kdsl/ops/_plan.py: what the key holds and why).
    try:
        key = ("fp8_linear", out_dtype, _device(),
               type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad,
               type(w), w.shape, w.stride(), w.dtype, w.device, w.data_ptr() & 15, w.requires_grad,
               type(w_s), w_s.shape, w_s.stride(), w_s.dtype, w_s.device, w_s.data_ptr() & 15, w_s.requires_grad,
               None if bias is None else (type(bias), bias.shape, bias.stride(), bias.dtype, bias.device,
                                          bias.data_ptr() & 15, bias.requires_grad))
        plan = _PLANS.get(key)
    except Exception:  # not tensors, say: the checks below word the error
        key = plan = None
    if plan:
        y = plan(x, w, w_s, bias)
        if y is not None:
            if not y.is_cuda:
                _fp8_linear_lost_nan(x, w, y)
            return y
    scheme, group, block_n, block_k, y = _fp8_linear_outputs(x, w, w_s, bias, out_dtype)
    k = x.shape[-1]
    n = w.shape[0]
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(y.shape))
    x2 = check.rows(x, k)
    y2 = y if y.dim() == 2 else y.view(-1, n)
    if not check.use_kernels(x.device):
        return y2.copy_(fallback.fp8_linear(x2, w, w_s, bias, group, block_n, block_k, y.dtype)).view(y.shape)
    inputs = x, w, w_s, bias
    # Unit stride along K (w, w_s) and N (bias) is what the kernel indexes by; copies only if not.
    w, w_s = (t if t.stride(1) == 1 else t.contiguous() for t in (w, w_s))
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    entry = registry.dispatch("fp8_linear", scheme, x.device)
    tile = entry.tile_for(x2.shape[0], n, _call(entry, x2.shape[0], n, x.device, x2, w))
    with _plan.Recorder(entry.modules[tile["impl"]].load() if plan is None else None) as rec:
        entry.launch(x2, w, w_s, bias, y2, tile)
    _plan.store(key, rec, inputs, (y,))
    if x.device.type == "cpu":
        _fp8_linear_lost_nan(x2, w, y)
    return y


def _fp8_linear_lost_nan(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """On the CPU, NaN where act_quant would give a row NaN codes (a NaN or +-inf in the row: a NaN element's code
    and inf / inf are NaN) and where a row of w holds the NaN code: what the GPU computes (_interpreter_lost_nan)."""
    n = w.shape[0]
    y2 = y.view(-1, n)
    y2[~torch.isfinite(x.reshape(-1, x.shape[-1])).all(dim=1)] = float("nan")
    y2[:, _interpreter_lost_nan(w).any(dim=1)] = float("nan")


def fp8_bmm(
    a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C [B, M, N] = (a[g] * a_s[g]) @ (b[g] * b_s[g])^T for each batch g, block scaling as fp8_gemm.

    a [B, M, K] float8_e4m3fn, any strides with unit stride along K (MLA's `x.transpose(0, 1)` of
    [M, B, K] runs without a copy); a_s float32 [B, M, K / 128], any strides; b [B, N, K] float8_e4m3fn
    (unit stride along K; contiguous as checkpoints ship it); b_s float32 [B, ceil(N / 128), K / 128].
    K must be a multiple of 128 and N of 16; any M, including 0. out: an optional [B, M, N] tensor of
    out_dtype with unit stride along N (a transposed view of a [M, B, N] buffer, say), written in place
    and returned; else a new contiguous tensor. NaN codes in a or b give NaN outputs, as fp8_gemm's.
    """
    if torch.compiler.is_compiling():  # see act_quant
        # The custom op is functional (kdsl.ops.spec): it returns a new tensor, copied into out here.
        c = torch.ops.kdsl.fp8_bmm(a, a_s, b, b_s, out_dtype)
        if out is None:
            return c
        _fp8_bmm_check_out(out, out_dtype, tuple(c.shape), a)
        return out.copy_(c)
    return _fp8_bmm_impl(a, a_s, b, b_s, out_dtype, out)


def _fp8_bmm_outputs(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                     out_dtype: torch.dtype, out: torch.Tensor | None = None,
                     symbolic: bool = False) -> tuple[str, int, int, int, torch.Tensor]:
    """fp8_bmm's checks and its output: (scheme, act_group, block_n, block_k, c), c being out when given
    (checked) or a new contiguous [B, M, N] tensor. symbolic: as _fp8_gemm_outputs."""
    check.tensor("a", a, (FP8,), ndim=3)
    check.tensor("a_s", a_s, (torch.float32,), ndim=3)
    check.tensor("b", b, (FP8,), ndim=3)
    check.tensor("b_s", b_s, (torch.float32,), ndim=3)
    check.out_dtype("out_dtype", out_dtype, FLOAT_INPUTS)
    batch, m, k = a.shape
    n = b.shape[1]
    scheme, group, (block_n, block_k) = _gemm_scheme(k, n, a_s.shape[-1], tuple(b_s.shape[1:]), symbolic,
                                                     op="fp8_bmm")
    if k % group:
        raise ValueError(f"a: last dimension K = {k} must be a multiple of {group}")
    if b.shape[0] != batch:
        raise ValueError(f"b: expected batch size {batch} (a's) in dimension 0, got shape {tuple(b.shape)}")
    if b.shape[2] != k:
        raise ValueError(f"b: expected shape ({batch}, N, {k}) to match a's K = {k}, got {tuple(b.shape)}")
    if n % 16:
        raise ValueError(f"b: N = {n} must be a multiple of 16")
    check.shape("a_s", a_s, (batch, m, k // group), f"one scale per token per {group} of K")
    check.shape("b_s", b_s, (batch, -(-n // block_n), -(-k // block_k)),
                f"one scale per {block_n}x{block_k} block of each batch of b")
    check.same_device(a=a, a_s=a_s, b=b, b_s=b_s)
    if out is None:
        return scheme, group, block_n, block_k, a.new_empty((batch, m, n), dtype=out_dtype)
    _fp8_bmm_check_out(out, out_dtype, (batch, m, n), a)
    return scheme, group, block_n, block_k, out


def _fp8_bmm_check_out(out: torch.Tensor, dtype: torch.dtype, shape: tuple, like: torch.Tensor) -> None:
    """out's checks: eagerly against the arguments, under torch.compile against the op's result."""
    check.tensor("out", out, (dtype,), ndim=3)
    check.shape("out", out, shape, "a's B and M, b's N")
    if out.stride(2) != 1 and out.numel() > 0:
        raise ValueError(f"out: expected unit stride along N (dimension 2), got strides {tuple(out.stride())}")
    check.same_device(a=like, out=out)


def _fp8_bmm_impl(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                  out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    # A repeat call signature replays its launch plan (kdsl/ops/_plan.py: what the key holds and why); with out=
    # the plan takes out as a fifth input, its key out's signature too, and allocates nothing.
    if out is None:
        key, plan, c = _replay("fp8_bmm", out_dtype, a, a_s, b, b_s, _fp8_bmm_lost_nan)
        if c is not None:
            return c
    else:
        key, plan, done = _replay_into(out_dtype, a, a_s, b, b_s, out)
        if done:
            return out
    scheme, group, block_n, block_k, c = _fp8_bmm_outputs(a, a_s, b, b_s, out_dtype, out)
    device = a.device
    if c.numel() == 0:
        return c
    if a.shape[2] == 0:
        return c.zero_()
    if not check.use_kernels(device):
        return c.copy_(fallback.fp8_bmm(a, a_s, b, b_s, group, block_n, block_k, out_dtype))
    # Strides go to the kernel as they are; only a K stride other than 1 costs a copy (and leaves no plan:
    # the launch reads a tensor that is not the call's).
    inputs = a, a_s, b, b_s
    a, b = (t if t.stride(2) == 1 else t.contiguous() for t in (a, b))
    entry = registry.dispatch("fp8_bmm", scheme, device)
    m, n = a.shape[1], b.shape[1]
    tile = entry.tile_for(m, n, _call(entry, m, n, device, a, b, c, batch=a.shape[0]))
    with _plan.Recorder(entry.modules[tile["impl"]].load() if plan is None else None) as rec:
        entry.launch(a, a_s, b, b_s, c, tile)
    if out is None:
        _plan.store(key, rec, inputs, (c,))
    else:
        _plan.store(key, rec, (*inputs, out), ())
    if device.type == "cpu":
        _fp8_bmm_lost_nan(a, b, c)
    return c


def _replay_into(out_dtype: torch.dtype, a, a_s, b, b_s, out) -> tuple:
    """(key, plan, done) of an fp8_bmm call writing into out: as _replay's key and plan, done where the plan's
    replay wrote out."""
    try:
        key = (*_gemm_plan_key("fp8_bmm", out_dtype, a, a_s, b, b_s), "out",
               type(out), out.shape, out.stride(), out.dtype, out.device, out.data_ptr() & 15, out.requires_grad)
        plan = _PLANS.get(key)
    except Exception:  # not tensors, say: the checks word the error
        return None, None, False
    if not plan or plan(a, a_s, b, b_s, out) is None:
        return key, plan, False
    if not out.is_cuda:
        _fp8_bmm_lost_nan(a, b, out)
    return key, plan, True


def _fp8_bmm_lost_nan(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """On the CPU: NaN where a row of a or a column of b holds a NaN code (see _interpreter_lost_nan)."""
    c[_interpreter_lost_nan(a).any(dim=2)] = float("nan")  # [B, M] rows
    c.transpose(1, 2)[_interpreter_lost_nan(b).any(dim=2)] = float("nan")  # [B, N] columns


def _call(entry, m: int, n: int, device: torch.device, *operands: torch.Tensor, batch: int = 1):
    """The call's facts for the modules' run-time refusals (kdsl.runtime Call: TMA reads the operands, so
    their alignment; a batched op's batch count), or None where no module of the entry refuses any call."""
    if not entry.refuses_calls:
        return None
    return registry.Call(m=m, n=n, device_type=device.type, dtype=check.dtype_name(operands[0].dtype),
                         align=check.alignment(*operands), batch=batch)


def _gemm_scheme(k: int, n: int, a_groups: int, b_blocks: tuple,
                 symbolic: bool = False, op: str = "fp8_gemm") -> tuple[str, int, tuple[int, int]]:
    """(scheme, act_group, (block_n, block_k)) of the served `op` scheme whose scale shapes a_s and b_s
    have; where none has them, the first served one, whose numbers then word the shape errors.
    symbolic (SymInt sizes, which do not hash): no memo; the comparisons become guards, not specializations."""
    def find():
        served = registry.scheme_fields(op)
        if not served:
            registry.require_scheme(op, "block_fp8", "any block-FP8 scheme")  # raises
        found = _matching(served, k, n, b_blocks, a_groups)
        if found is None:
            scales = "b_s" if op == "fp8_gemm" else "b_s[g]"
            _refuse_unserved(op, k, n, b_blocks, a_groups,
                             f"a_s with {a_groups} scales per token and {scales} shape {tuple(b_blocks)} for K = {k}, "
                             f"N = {n}")
            name, fields = next(iter(served.items()))
            found = name, fields["act_group"], tuple(fields["weight_block"])
        return found
    if symbolic:
        return find()
    return registry.memo((op, k, n, a_groups, b_blocks), find)


def _interpreter_lost_nan(codes: torch.Tensor) -> torch.Tensor:
    """Where e4m3 codes are NaN. Triton's CPU interpreter decodes the NaN code 0x7F as 480 (in tl.dot and
    casts), so on the CPU the ops mark what read a NaN code, as the GPU's kernels compute it."""
    return torch.isnan(codes.float())


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and starting on a 16-byte boundary (TMA descriptors need both); copies only if not."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _pair(name: str, block) -> tuple:
    """block as (n, k), unchecked beyond being two things (the op checks them: its spec's fake kernel and implementation)."""
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"{name}: expected (n, k), got {block!r}")
    return block[0], block[1]


def _block(name: str, block) -> tuple[int, int]:
    block = _pair(name, block)
    return check.positive_power_of_two(f"{name}[0]", block[0]), check.positive_power_of_two(f"{name}[1]", block[1])


# --- torch.ops.kdsl.* (kdsl.ops.spec): the fake kernels make the checks and empty outputs the implementations make

def _act_quant_fake(x, group_size):
    _, q, s = _act_quant_outputs(x, group_size)
    return q, s


def _weight_quant_fake(w, block_n, block_k):
    _, q, s = _weight_quant_outputs(w, block_n, block_k)
    return q, s


def _weight_dequant_fake(q, s, block_n, block_k, out_dtype):
    return _weight_dequant_outputs(q, s, block_n, block_k, out_dtype)[1]


def _fp8_gemm_fake(a, a_s, b, b_s, out_dtype):
    return _fp8_gemm_outputs(a, a_s, b, b_s, out_dtype, symbolic=True)[-1]


def _fp8_bmm_op(a, a_s, b, b_s, out_dtype):
    """fp8_bmm's implementation without `out` (not part of the op: see kdsl.ops.spec)."""
    return _fp8_bmm_impl(a, a_s, b, b_s, out_dtype)


def _fp8_bmm_fake(a, a_s, b, b_s, out_dtype):
    return _fp8_bmm_outputs(a, a_s, b, b_s, out_dtype, symbolic=True)[-1]


def _fp8_linear_fake(x, w, w_s, bias, out_dtype):
    return _fp8_linear_outputs(x, w, w_s, bias, out_dtype, symbolic=True)[-1]


# Example calls (kdsl.ops.spec): the quantizers over 512 x 512 (4 groups, 4 x 4 weight blocks), the GEMMs as
# kdsl.ops._examples.gemm_shape, fp8_bmm over MLA's 16 heads, fp8_linear with x in the output's dtype and a bias.
def _act_quant_example(tile, dtype, device):
    yield (empty(device, 64, 512, dtype=dtype), empty(device, 64, 512, dtype=FP8),
           empty(device, 64, 4, dtype=torch.float32))


def _weight_quant_example(tile, dtype, device):
    yield (empty(device, 512, 512, dtype=dtype), empty(device, 512, 512, dtype=FP8),
           empty(device, 4, 4, dtype=torch.float32))


def _weight_dequant_example(tile, dtype, device):
    yield (empty(device, 512, 512, dtype=FP8), empty(device, 4, 4, dtype=torch.float32),
           empty(device, 512, 512, dtype=dtype))


def _fp8_gemm_example(tile, dtype, device):
    yield fp8_operands(device, (), *gemm_shape(tile), dtype)


def _fp8_bmm_example(tile, dtype, device):
    yield fp8_operands(device, (16,), *gemm_shape(tile), dtype)


def _fp8_linear_example(tile, dtype, device):
    m, n, k = gemm_shape(tile)
    _, _, b, b_s, c = fp8_operands(device, (), m, n, k, dtype)
    yield empty(device, m, k, dtype=dtype), b, b_s, empty(device, n, dtype=dtype), c


# ---- the C ABI of `kdsl aot` (kdsl.kernels.c_abi): what the exported C function takes and checks, which calls the
# export compiles for (representative problems: M over every tile bucket, the layers' N and K), and each kernel
# unit's C_LAUNCH says how it is launched from there.

# The representative problems of each op: its M values (the shipped definitions' tile buckets, each reached at
# least once, and their edges) times the sizes given. The full export uses the sizes of DeepSeek-V3 and Llama
# layers below; `kdsl aot --model` passes one model's (kdsl.aot.model).
ACT_QUANT_MS = (1, 2, 7, 16, 17, 32, 100, 128, 4096, 4097)
FP8_GEMM_MS = (1, 2, 7, 16, 17, 32, 100, 128, 129, 1024, 4096, 4097)
FP8_BMM_MS = (1, 4, 16, 17, 64, 128, 1024, 4096)


def act_quant_problems(ks, ms=ACT_QUANT_MS, dtypes=tuple(DTYPES)):
    for m in ms:
        for k in ks:
            for dtype in dtypes:
                yield dict(M=m, K=k, ldx=k, x_dtype=dtype)


def _act_quant_problems():
    return act_quant_problems((512, 1536, 2048, 7168))


def fp8_gemm_problems(nks, ms=FP8_GEMM_MS, dtypes=tuple(DTYPES)):
    """nks: the (N, K) of the weights."""
    for m in ms:
        for n, k in nks:
            for dtype in dtypes:
                yield dict(M=m, N=n, K=k, lda=k, ldb=k, ldc=n, lda_s=k // 128, ldb_s=k // 128, out_dtype=dtype)


def _fp8_gemm_problems():
    return fp8_gemm_problems([(n, k) for n in (2112, 7168, 576, 24) for k in (2048, 7168)])


ACT_QUANT_ABI = OpAbi(
    op="act_quant",
    function="kdsl_act_quant",
    summary="Per-token, per-group activation quantization to e4m3: s = amax(|group|) / 448, q = e4m3(x / s).",
    args=(
        CArg("x", "ptr", "x [M, K] of x_dtype, row stride ldx elements, unit stride along K"),
        CArg("x_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("ldx", "i64", "row stride of x in elements (>= K)"),
        CArg("q", "ptr", "q [M, K] float8_e4m3fn, contiguous (output)", const=False),
        CArg("s", "ptr", "s [M, K / act_group] float32, contiguous (output)", const=False),
        CArg("M", "i64", "rows (tokens), >= 0"),
        CArg("K", "i64", "columns, a multiple of act_group"),
    ),
    dtype_choices={"x_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || K < 0", "act_quant: M = %lld and K = %lld must be >= 0", ("M", "K")),
        Check("K % {act_group} != 0", "act_quant: K = %lld must be a multiple of the group size {act_group}", ("K",)),
        Check("ldx < K", "act_quant: ldx = %lld must be >= K = %lld", ("ldx", "K")),
        Check("M > 2147483647 || K > 2147483647 || ldx > 2147483647",
              "act_quant: M, K and ldx must fit in 32 bits (M = %lld, K = %lld, ldx = %lld)", ("M", "K", "ldx")),
        not_null("act_quant", ("M", "K"), ("x", "q", "s")),
    ),
    nothing_to_do="M == 0 || K == 0",
    m="M",
    n=None,
    problems=_act_quant_problems,
    bench_problems={"act_quant": lambda case: {"act_quant": act_quant_problems([case.k], ms=(case.m,))}},
)

# What the block-FP8 GEMMs' C ABIs share (fp8_gemm, fp8_bmm and kdsl.ops.moe's grouped pair).
FP8_ROW_SCALES = (  # a's row stride, then its per-token scales, as act_quant writes them
    CArg("lda", "i64", "row stride of a in elements (>= K)"),
    CArg("a_s", "ptr", "a_s [M, K / act_group] float32, row stride lda_s, unit stride along K"),
    CArg("lda_s", "i64", "row stride of a_s in elements (>= K / act_group)"),
)
FP8_OUT_DTYPE = CArg("out_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32")
FP8_K = CArg("K", "i64", "a multiple of act_group, > 0")


def k_in_act_groups(op: str) -> Check:
    """The refusal of a K that is not whole activation groups."""
    return Check("K % {act_group} != 0", f"{op}: K = %lld must be a multiple of {{act_group}}", ("K",))


FP8_GEMM_ABI = OpAbi(
    op="fp8_gemm",
    function="kdsl_fp8_gemm",
    summary="C = (a * a_s) @ (b * b_s)^T with DeepSeek-V3 block scaling, fp32 accumulation.",
    args=(
        CArg("a", "ptr", "a [M, K] float8_e4m3fn, row stride lda, unit stride along K"),
        *FP8_ROW_SCALES,
        CArg("b", "ptr", "b [N, K] float8_e4m3fn, row stride ldb, unit stride along K (the weight)"),
        CArg("ldb", "i64", "row stride of b in elements (>= K)"),
        CArg("b_s", "ptr", "b_s [ceil(N / block_n), K / block_k] float32, row stride ldb_s, unit stride along K"),
        CArg("ldb_s", "i64", "row stride of b_s in elements (>= K / block_k)"),
        CArg("c", "ptr", "c [M, N] of out_dtype, row stride ldc, unit stride along N (output)", const=False),
        CArg("ldc", "i64", "row stride of c in elements (>= N)"),
        FP8_OUT_DTYPE,
        CArg("M", "i64", "rows of a and c, >= 0"),
        CArg("N", "i64", "rows of b, columns of c: a multiple of 8"),
        FP8_K,
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "fp8_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        k_in_act_groups("fp8_gemm"),
        Check("N % 8 != 0", "fp8_gemm: N = %lld must be a multiple of 8", ("N",)),
        Check("lda < K || ldb < K", "fp8_gemm: lda = %lld and ldb = %lld must be >= K = %lld", ("lda", "ldb", "K")),
        Check("ldc < N", "fp8_gemm: ldc = %lld must be >= N = %lld", ("ldc", "N")),
        Check("lda_s < K / {act_group} || ldb_s < K / {block_k}",
              "fp8_gemm: lda_s = %lld must be >= K / {act_group} and ldb_s = %lld >= K / {block_k}",
              ("lda_s", "ldb_s")),
        fits_in_32_bits("fp8_gemm", ("M", "N", "K", "lda", "ldb", "ldc", "lda_s", "ldb_s")),
        not_null("fp8_gemm", ("M", "N"), ("a", "a_s", "b", "b_s", "c")),
    ),
    nothing_to_do="M == 0 || N == 0",
    m="M",
    n="N",
    problems=_fp8_gemm_problems,
    # A model quantizes its activations before each such GEMM: act_quant's (M, K) too.
    bench_problems={"fp8_gemm": lambda case: {
        "fp8_gemm": fp8_gemm_problems([(case.n, case.k)], ms=(case.m,)),
        "act_quant": act_quant_problems([case.k], ms=(case.m,))}},
)

# ---- fp8_bmm: the batched block-FP8 GEMM (MLA), strided views passed as they are -------------------------

def fp8_bmm_problems(batches, nks, ms=FP8_BMM_MS, dtypes=tuple(DTYPES)):
    """batches: the batch counts (MLA's heads per GPU); nks: the per-head (N, K). Activations arrive as
    [tokens, heads, K], so a is the transposed view (strides K, heads * K, 1), and so are its scales."""
    for heads in batches:
        for m in ms:
            for n, k in nks:
                for dtype in dtypes:
                    yield dict(B=heads, M=m, N=n, K=k, stride_ab=k, stride_am=heads * k, stride_bb=n * k, stride_bn=k,
                               stride_cb=m * n, stride_cm=n, stride_asb=k // 128, stride_asm=heads * k // 128,
                               stride_ask=1, stride_bsb=-(-n // 128) * (k // 128), stride_bsn=k // 128, stride_bsk=1,
                               out_dtype=dtype)


def _fp8_bmm_problems():
    # DeepSeek-V3's MLA: heads 128 (TP 1) or 16 (TP 8); (N, K) = (512, 128) or (128, 512).
    return fp8_bmm_problems((16, 128), ((512, 128), (128, 512)))


_BMM_STRIDE_NAMES = ("stride_ab", "stride_am", "stride_bb", "stride_bn", "stride_cb", "stride_cm", "stride_asb",
                     "stride_asm", "stride_ask", "stride_bsb", "stride_bsn", "stride_bsk")

FP8_BMM_ABI = OpAbi(
    op="fp8_bmm",
    function="kdsl_fp8_bmm",
    summary="c[g] = (a[g] * a_s[g]) @ (b[g] * b_s[g])^T for each batch g, block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [B, M, K] float8_e4m3fn, strides (stride_ab, stride_am, 1): MLA's [tokens, heads, K] "
                         "activations are (K, heads * K, 1)"),
        CArg("stride_ab", "i64", "a's batch stride in elements"),
        CArg("stride_am", "i64", "a's row stride in elements"),
        CArg("a_s", "ptr", "a_s [B, M, K / act_group] float32, strides (stride_asb, stride_asm, stride_ask)"),
        CArg("stride_asb", "i64", "a_s's batch stride"),
        CArg("stride_asm", "i64", "a_s's row stride"),
        CArg("stride_ask", "i64", "a_s's stride along K"),
        CArg("b", "ptr", "b [B, N, K] float8_e4m3fn, strides (stride_bb, stride_bn, 1) (the weights)"),
        CArg("stride_bb", "i64", "b's batch stride"),
        CArg("stride_bn", "i64", "b's row stride"),
        CArg("b_s", "ptr", "b_s [B, ceil(N / block_n), K / block_k] float32, strides (stride_bsb, stride_bsn, stride_bsk)"),
        CArg("stride_bsb", "i64", "b_s's batch stride"),
        CArg("stride_bsn", "i64", "b_s's row stride"),
        CArg("stride_bsk", "i64", "b_s's stride along K"),
        CArg("c", "ptr", "c [B, M, N] of out_dtype, strides (stride_cb, stride_cm, 1) (output)", const=False),
        CArg("stride_cb", "i64", "c's batch stride"),
        CArg("stride_cm", "i64", "c's row stride"),
        FP8_OUT_DTYPE,
        CArg("B", "i64", "batches (heads), >= 0"),
        CArg("M", "i64", "rows of a and c (tokens), >= 0"),
        CArg("N", "i64", "rows of b, columns of c: a multiple of 16"),
        FP8_K,
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("B < 0 || M < 0 || N < 0 || K <= 0", "fp8_bmm: B = %lld, M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("B", "M", "N", "K")),
        k_in_act_groups("fp8_bmm"),
        Check("N % 16 != 0", "fp8_bmm: N = %lld must be a multiple of 16", ("N",)),
        Check(" || ".join(f"{name} < 0" for name in _BMM_STRIDE_NAMES), "fp8_bmm: strides must be >= 0"),
        fits_in_32_bits("fp8_bmm", ("B", "M", "N", "K", *_BMM_STRIDE_NAMES)),
        not_null("fp8_bmm", ("B", "M", "N"), ("a", "a_s", "b", "b_s", "c")),
    ),
    nothing_to_do="B == 0 || M == 0 || N == 0",
    m="M",
    n="N",
    problems=_fp8_bmm_problems,
    bench_problems={"fp8_bmm": lambda case: {
        "fp8_bmm": fp8_bmm_problems((case.batch,), [(case.n, case.k)], ms=(case.m,))}},
)


SPECS = (
    OpSpec("act_quant", "(Tensor x, int group_size) -> (Tensor, Tensor)", _act_quant_impl, _act_quant_fake,
           example=_act_quant_example, c_abi=ACT_QUANT_ABI),
    OpSpec("weight_quant", "(Tensor w, int block_n, int block_k) -> (Tensor, Tensor)", _weight_quant_impl,
           _weight_quant_fake, example=_weight_quant_example),
    OpSpec("weight_dequant", "(Tensor q, Tensor s, int block_n, int block_k, ScalarType out_dtype) -> Tensor",
           _weight_dequant_impl, _weight_dequant_fake, example=_weight_dequant_example),
    OpSpec("fp8_gemm", "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor",
           _fp8_gemm_impl, _fp8_gemm_fake, example=_fp8_gemm_example, c_abi=FP8_GEMM_ABI),
    OpSpec("fp8_bmm", "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype) -> Tensor",
           _fp8_bmm_op, _fp8_bmm_fake, example=_fp8_bmm_example, c_abi=FP8_BMM_ABI),
    OpSpec("fp8_linear", "(Tensor x, Tensor w, Tensor w_s, Tensor? bias, ScalarType? out_dtype) -> Tensor",
           _fp8_linear_impl, _fp8_linear_fake, example=_fp8_linear_example),
)
