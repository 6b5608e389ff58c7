"""Block-FP8 mixture-of-experts ops (DeepSeek-V3 layout): grouped GEMMs over experts and the MoE layer.

    fp8_grouped_gemm         contiguous layout: rows of a grouped by expert, group_ids[m] the expert of row m
                             (-1: a padding row), DeepGEMM's "contiguous" grouped GEMM
    fp8_grouped_gemm_masked  masked layout: a [E, max_m, K], masked_m[e] rows of expert e, read on the device
    moe_fp8                  y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]

Layouts, the kernels and how their tiles are chosen: docs/moe.md.

Ids on the device. The kernels never read outside their tensors whatever the ids hold: a row whose group id is
outside [0, E) is not computed (its output row is unspecified, like a padding row's), a slot whose expert id is
outside [0, E) adds nothing to its token, and masked_m is clamped to [0, max_m]. Refusing bad ids by name
(ValueError naming group_ids or topk_ids) means reading them on the host, one sync per call: the ops do it when
check_ids=True (the default) unless the current CUDA stream is capturing a graph, where a sync is illegal; so a
captured call (torch.compile(mode="reduce-overhead") included) and a call with check_ids=False wait on nothing,
and bad ids there drop their rows as above. moe_fp8's check costs no extra kernel: its routing kernel counts the
ids outside [0, E) and the op reads that count before the GEMMs are launched. masked_m is never checked (its
values are the device's business: one CUDA graph for any routing); rows past masked_m[e] are unspecified.
"""
from __future__ import annotations

import torch

from kdsl.kernels.c_abi import DTYPES, CArg, Check, OpAbi, fits_in_32_bits, not_null
from kdsl.ops import _checks as check
from kdsl.ops import fallback
from kdsl.ops._examples import MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, empty, fp8_operands, gemm_shape, moe_routing
from kdsl.ops.block_fp8 import (FP8, FP8_K, FP8_OUT_DTYPE, FP8_ROW_SCALES, _gemm_scheme, _interpreter_lost_nan,
                             _matching, _refuse_unserved, act_quant_problems, k_in_act_groups)
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

MOE_INPUTS = (torch.bfloat16, torch.float16)
GEMM_OUTPUTS = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# shared: id checks, strides, tile choice

def _capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (a host sync would fail the capture)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _refuse_ids(name: str, ids: torch.Tensor, low: int, high: int, what: str) -> None:
    """Raise the ValueError naming `name` for ids outside [low, high) (the error path may sync again)."""
    outside = ids[(ids < low) | (ids >= high)]
    raise ValueError(f"{name}: expected {what} in [{low}, {high}), got {outside.numel()} outside "
                     f"(first: {int(outside[0])}); ids outside are dropped only where the check does not run "
                     "(check_ids=False, or while a CUDA graph is captured)")


def _check_ids(name: str, ids: torch.Tensor, low: int, high: int, what: str) -> None:
    """The eager value check of ids: one host sync (skipped while a CUDA graph is captured)."""
    if ids.numel() and not _capturing(ids) and bool(((ids < low) | (ids >= high)).any()):
        _refuse_ids(name, ids, low, high, what)


def _unit_k(t: torch.Tensor) -> torch.Tensor:
    """Unit stride along the last dimension, which the kernels index by (copies only if not)."""
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def _experts_stacked(w: torch.Tensor) -> bool:
    """w [E, N, K] with unit stride along K is one [E * N, K] matrix: each expert's rows follow the last's."""
    return w.stride(0) == w.shape[1] * w.stride(1) or w.shape[0] == 1


def tokens_per_expert(assignments: int, experts: int) -> int:
    """moe_fp8's M for tile choice: the rows each routed expert gets, ceil(T * k / min(T * k, E))."""
    return max(1, -(-assignments // max(1, min(assignments, experts))))


def most_tokens(per_expert: int, experts: int, topk: int) -> int:
    """The most tokens T whose tokens per routed expert, tokens_per_expert(T * topk, experts), are at most
    per_expert (and, for topk <= experts, exactly per_expert): T * topk <= per_expert * E."""
    return max(1, per_expert * experts // topk)


def _positive_int_or_none(name: str, value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# fp8_grouped_gemm: contiguous layout

def fp8_grouped_gemm(
    a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, group_ids: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, *, check_ids: bool = True,
) -> torch.Tensor:
    """C [M, N]: row m is (a[m] * a_s[m]) @ (b[g] * b_s[g])^T with g = group_ids[m], block scaling as fp8_gemm.

    a [M, K] float8_e4m3fn with a_s float32 [M, K / 128]; b [E, N, K] float8_e4m3fn with b_s float32
    [E, ceil(N / 128), K / 128]; group_ids int32 [M], the expert of each row, -1 for a padding row (its output
    row is unspecified). DeepGEMM's contiguous layout groups rows by expert and pads each group to 128 rows:
    then every tile of rows belongs to one expert. Any other order is computed correctly, a tile holding rows of
    several experts making one pass over K per expert. K must be a multiple of 128; any M and N.
    check_ids: refuse ids outside [-1, E) by name (one host sync; skipped while a CUDA graph is captured).
    """
    if torch.compiler.is_compiling():  # see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, out_dtype, check_ids)
    return _fp8_grouped_gemm_impl(a, a_s, b, b_s, group_ids, out_dtype, check_ids)


def _fp8_grouped_gemm_outputs(a, a_s, b, b_s, group_ids, out_dtype, symbolic: bool = False):
    """Checks and the empty output: (scheme, act_group, block_n, block_k, c)."""
    check.tensor("a", a, (FP8,), ndim=2)
    check.tensor("a_s", a_s, (torch.float32,), ndim=2)
    check.tensor("b", b, (FP8,), ndim=3)
    check.tensor("b_s", b_s, (torch.float32,), ndim=3)
    check.tensor("group_ids", group_ids, (torch.int32,), ndim=1)
    check.out_dtype("out_dtype", out_dtype, GEMM_OUTPUTS)
    m, k = a.shape
    experts, n = b.shape[0], b.shape[1]
    scheme, group, (block_n, block_k) = _gemm_scheme(k, n, a_s.shape[-1], tuple(b_s.shape[1:]), symbolic,
                                                     op="fp8_grouped_gemm")
    if k % group:
        raise ValueError(f"a: last dimension K = {k} must be a multiple of {group}")
    if experts == 0:
        raise ValueError(f"b: expected at least one expert [E, N, K], got shape {tuple(b.shape)}")
    if b.shape[2] != k:
        raise ValueError(f"b: expected shape (E, N, {k}) to match a's K = {k}, got {tuple(b.shape)}")
    check.shape("a_s", a_s, (m, k // group), f"one scale per token per {group} of K")
    check.shape("b_s", b_s, (experts, -(-n // block_n), -(-k // block_k)),
                f"one scale per {block_n}x{block_k} block of each expert's b")
    check.shape("group_ids", group_ids, (m,), "one expert id per row of a")
    check.same_device(a=a, a_s=a_s, b=b, b_s=b_s, group_ids=group_ids)
    return scheme, group, block_n, block_k, a.new_empty((m, n), dtype=out_dtype)


def _fp8_grouped_gemm_impl(a, a_s, b, b_s, group_ids, out_dtype, check_ids: bool = True) -> torch.Tensor:
    scheme, group, block_n, block_k, c = _fp8_grouped_gemm_outputs(a, a_s, b, b_s, group_ids, out_dtype)
    m, k = a.shape
    experts, n = b.shape[0], b.shape[1]
    if c.numel() == 0:
        return c
    if check_ids:
        _check_ids("group_ids", group_ids, -1, experts, f"expert ids (-1 for padding; b has {experts} experts)")
    if k == 0:
        return c.zero_()
    device = a.device
    if not check.use_kernels(device):
        return c.copy_(fallback.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, group, block_n, block_k, out_dtype))
    a, a_s, b, b_s = (_unit_k(t) for t in (a, a_s, b, b_s))
    entry = registry.dispatch("fp8_grouped_gemm", scheme, device)
    tile = entry.tile_for(max(1, -(-m // experts)), n)
    entry.launch(a, a_s, b, b_s, group_ids.contiguous(), c, tile)
    if device.type == "cpu":
        _grouped_lost_nan(a, b, group_ids, c)
    return c


def _grouped_lost_nan(a, b, group_ids, c) -> None:
    """On the CPU, NaN where a row of a, or the row of its expert's b, holds the NaN code, as the GPU computes
    (kdsl.ops.block_fp8._interpreter_lost_nan)."""
    c[_interpreter_lost_nan(a).any(dim=1)] = float("nan")
    bad_columns = _interpreter_lost_nan(b).any(dim=2)  # [E, N]
    if bad_columns.any():
        routed = (group_ids >= 0) & (group_ids < b.shape[0])
        rows = routed.nonzero().squeeze(1)
        c[rows] = torch.where(bad_columns[group_ids[rows].long()], float("nan"), c[rows])


# ---------------------------------------------------------------------------------------------------------------
# fp8_grouped_gemm_masked: masked layout

def fp8_grouped_gemm_masked(
    a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, masked_m: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, *, expected_m: int | None = None,
) -> torch.Tensor:
    """C [E, max_m, N]: C[e, :masked_m[e]] = (a[e] * a_s[e]) @ (b[e] * b_s[e])^T, block scaling as fp8_gemm.

    a [E, max_m, K] float8_e4m3fn with a_s float32 [E, max_m, K / 128]; b [E, N, K] with b_s float32
    [E, ceil(N / 128), K / 128]; masked_m int32 [E] on a's device, read by the kernel (no host sync: one CUDA
    graph serves any routing), clamped to [0, max_m]; rows past masked_m[e] are unspecified. expected_m: the
    rows per expert the tile is chosen for (a hint, as DeepGEMM's; default max_m). K must be a multiple of 128.
    """
    expected_m = _positive_int_or_none("expected_m", expected_m)
    if torch.compiler.is_compiling():  # see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, out_dtype, expected_m)
    return _fp8_grouped_gemm_masked_impl(a, a_s, b, b_s, masked_m, out_dtype, expected_m)


def _fp8_grouped_gemm_masked_outputs(a, a_s, b, b_s, masked_m, out_dtype, symbolic: bool = False):
    """Checks and the empty output: (scheme, act_group, block_n, block_k, c)."""
    check.tensor("a", a, (FP8,), ndim=3)
    check.tensor("a_s", a_s, (torch.float32,), ndim=3)
    check.tensor("b", b, (FP8,), ndim=3)
    check.tensor("b_s", b_s, (torch.float32,), ndim=3)
    check.tensor("masked_m", masked_m, (torch.int32,), ndim=1)
    check.out_dtype("out_dtype", out_dtype, GEMM_OUTPUTS)
    experts, max_m, k = a.shape
    n = b.shape[1]
    scheme, group, (block_n, block_k) = _gemm_scheme(k, n, a_s.shape[-1], tuple(b_s.shape[1:]), symbolic,
                                                     op="fp8_grouped_gemm_masked")
    if k % group:
        raise ValueError(f"a: last dimension K = {k} must be a multiple of {group}")
    if b.shape[0] != experts:
        raise ValueError(f"b: expected {experts} experts (a's E) in dimension 0, got shape {tuple(b.shape)}")
    if b.shape[2] != k:
        raise ValueError(f"b: expected shape ({experts}, N, {k}) to match a's K = {k}, got {tuple(b.shape)}")
    check.shape("a_s", a_s, (experts, max_m, k // group), f"one scale per token per {group} of K")
    check.shape("b_s", b_s, (experts, -(-n // block_n), -(-k // block_k)),
                f"one scale per {block_n}x{block_k} block of each expert's b")
    check.shape("masked_m", masked_m, (experts,), "one row count per expert")
    check.same_device(a=a, a_s=a_s, b=b, b_s=b_s, masked_m=masked_m)
    return scheme, group, block_n, block_k, a.new_empty((experts, max_m, n), dtype=out_dtype)


def _fp8_grouped_gemm_masked_impl(a, a_s, b, b_s, masked_m, out_dtype, expected_m: int | None = None) -> torch.Tensor:
    scheme, group, block_n, block_k, c = _fp8_grouped_gemm_masked_outputs(a, a_s, b, b_s, masked_m, out_dtype)
    experts, max_m, k = a.shape
    n = b.shape[1]
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    device = a.device
    if not check.use_kernels(device):
        return c.copy_(fallback.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, group, block_n, block_k,
                                                        out_dtype))
    a, a_s, b, b_s = (_unit_k(t) for t in (a, a_s, b, b_s))
    entry = registry.dispatch("fp8_grouped_gemm_masked", scheme, device)
    tile = entry.tile_for(expected_m or max_m, n)
    entry.launch(a, a_s, b, b_s, masked_m.contiguous(), c, tile)
    if device.type == "cpu":
        c[_interpreter_lost_nan(a).any(dim=2)] = float("nan")  # [E, max_m] rows
        c.transpose(1, 2)[_interpreter_lost_nan(b).any(dim=2)] = float("nan")  # [E, N] columns
    return c


# ---------------------------------------------------------------------------------------------------------------
# moe_fp8: the layer

def moe_fp8(
    x: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, check_ids: bool = True,
) -> torch.Tensor:
    """y [T, H] in x's dtype: y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
    e = topk_ids[t, j].

    x [T, H] bf16/fp16; w13 [E, 2I, H] float8_e4m3fn, each expert's gate rows then its up rows, with w13_s
    float32 [E, ceil(2I / 128), H / 128]; w2 [E, H, I] float8_e4m3fn with w2_s float32 [E, ceil(H / 128), I / 128]
    (128x128 block scales, DeepSeek-V3's weight_scale_inv); topk_weights float32 [T, k]; topk_ids int32 [T, k].
    x and h = silu(gate) * up are quantized per token in 1x128 groups (act_quant's rule, s = amax / 448) before
    their GEMMs; both GEMMs accumulate in fp32, the slots are summed in fp32. H and I must be multiples of 128.

    Every step runs on the device with sizes the host knows (T, k, E), so one CUDA graph serves any routing.
    check_ids: refuse ids outside [0, E) naming topk_ids (one host sync after the routing kernel; skipped while a
    CUDA graph is captured); without the check such a slot adds nothing to its token.
    """
    if torch.compiler.is_compiling():  # see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids)
    return _moe_fp8_impl(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids)


def _moe_scheme(h: int, two_inter: int, w13_blocks: tuple, symbolic: bool = False) -> tuple[str, int, tuple[int, int]]:
    """(scheme, act_group, (block_n, block_k)) of the served moe_fp8 scheme whose blocks give w13_s's shape for
    w13 [E, 2I, H] (w2_s is then checked against the same blocks); where none does, the first served one, whose
    numbers word the shape errors."""
    def find():
        served = registry.scheme_fields("moe_fp8")
        if not served:
            registry.require_scheme("moe_fp8", "block_fp8", "any block-FP8 scheme")  # raises
        found = _matching(served, h, two_inter, w13_blocks)
        if found is None:
            _refuse_unserved("moe_fp8", h, two_inter, w13_blocks, None,
                             f"w13_s[e] shape {tuple(w13_blocks)} for w13[e] ({two_inter}, {h})")
            name, fields = next(iter(served.items()))
            found = name, fields["act_group"], tuple(fields["weight_block"])
        return found
    if symbolic:
        return find()
    return registry.memo(("moe_fp8", h, two_inter, w13_blocks), find)


def _moe_fp8_outputs(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, symbolic: bool = False):
    """Checks and the empty output: (scheme, act_group, block_n, block_k, y)."""
    check.tensor("x", x, MOE_INPUTS, ndim=2)
    check.tensor("w13", w13, (FP8,), ndim=3)
    check.tensor("w13_s", w13_s, (torch.float32,), ndim=3)
    check.tensor("w2", w2, (FP8,), ndim=3)
    check.tensor("w2_s", w2_s, (torch.float32,), ndim=3)
    check.tensor("topk_weights", topk_weights, (torch.float32,), ndim=2)
    check.tensor("topk_ids", topk_ids, (torch.int32,), ndim=2)
    tokens, hidden = x.shape
    experts, two_inter = w13.shape[0], w13.shape[1]
    scheme, group, (block_n, block_k) = _moe_scheme(hidden, two_inter, tuple(w13_s.shape[1:]), symbolic)
    if hidden % group:
        raise ValueError(f"x: hidden size H = {hidden} must be a multiple of {group} (the activation group)")
    if experts == 0:
        raise ValueError(f"w13: expected at least one expert [E, 2I, H], got shape {tuple(w13.shape)}")
    if w13.shape[2] != hidden:
        raise ValueError(f"w13: expected shape (E, 2I, {hidden}) to match x's H = {hidden}, got {tuple(w13.shape)}")
    if two_inter % (2 * group):
        raise ValueError(f"w13: expected (E, 2I, H), gate rows then up rows, with I a multiple of {group} "
                         f"(h = silu(gate) * up is quantized in groups of {group}), got {tuple(w13.shape)}")
    inter = two_inter // 2
    check.shape("w2", w2, (experts, hidden, inter), f"each expert's down projection [H, I], I = {inter} from w13")
    check.shape("w13_s", w13_s, (experts, -(-two_inter // block_n), -(-hidden // block_k)),
                f"one scale per {block_n}x{block_k} block of each expert's w13")
    check.shape("w2_s", w2_s, (experts, -(-hidden // block_n), -(-inter // block_k)),
                f"one scale per {block_n}x{block_k} block of each expert's w2")
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected shape ({tokens}, k), one row per token of x, got {tuple(topk_ids.shape)}")
    check.shape("topk_weights", topk_weights, tuple(topk_ids.shape), "one weight per routed slot, as topk_ids")
    check.same_device(x=x, w13=w13, w13_s=w13_s, w2=w2, w2_s=w2_s, topk_weights=topk_weights, topk_ids=topk_ids)
    return scheme, group, block_n, block_k, x.new_empty((tokens, hidden))


def _moe_fp8_impl(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids: bool = True) -> torch.Tensor:
    scheme, group, block_n, block_k, y = _moe_fp8_outputs(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    tokens, hidden = x.shape
    experts, topk = w13.shape[0], topk_ids.shape[1]
    if y.numel() == 0:
        return y
    if topk == 0:
        return y.zero_()
    what = f"expert ids (w13 has {experts} experts)"
    device = x.device
    if not check.use_kernels(device):
        if check_ids:
            _check_ids("topk_ids", topk_ids, 0, experts, what)
        return y.copy_(fallback.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, group, block_n, block_k))

    def refuse_outside(count: torch.Tensor) -> None:
        # The routing kernel counted the ids outside [0, E): the op's one host sync, before the GEMMs launch.
        if int(count.item()):
            _refuse_ids("topk_ids", topk_ids, 0, experts, what)

    on_routed = refuse_outside if check_ids and not _capturing(x) else None
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w13_s, w2, w2_s = (_unit_k(t) for t in (w13, w13_s, w2, w2_s))
    entry = registry.dispatch("moe_fp8", scheme, device)
    # Tiles by tokens per routed expert and the intermediate size I: I sets how many columns the gate/up GEMM
    # spreads over the SMs at decode (kernel_defs/moe_fp8.toml).
    m, inter = tokens_per_expert(tokens * topk, experts), w2.shape[2]
    # Modules that refuse calls (moe_fp8/sorted_gluon: the GPU only, TMA over the weights) read the call's facts.
    call = registry.Call(m=m, n=inter, device_type=device.type, dtype=check.dtype_name(x.dtype),
                         align=check.alignment(w13, w2), stacked=_experts_stacked(w13) and _experts_stacked(w2),
                         ) if entry.refuses_calls else None
    tile = entry.tile_for(m, inter, call)
    entry.launch(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, y, on_routed, tile)
    if device.type == "cpu":
        _moe_lost_nan(x, w13, w2, topk_ids, y)
    return y


def _moe_lost_nan(x, w13, w2, topk_ids, y) -> None:
    """On the CPU, NaN where the GPU computes it and the interpreter decodes a NaN code as 480
    (kdsl.ops.block_fp8._interpreter_lost_nan): a token whose x holds NaN or +-inf (NaN codes in its quantized
    groups), or routed to an expert whose w13 holds a NaN code, is NaN everywhere (its h row then holds NaN codes);
    a column of a token routed to an expert whose w2 holds a NaN code in that row is NaN."""
    experts = w13.shape[0]
    routed = (topk_ids >= 0) & (topk_ids < experts)
    ids = torch.where(routed, topk_ids, 0).long()
    bad_up = _interpreter_lost_nan(w13).flatten(1).any(dim=1)  # [E]
    bad_down = _interpreter_lost_nan(w2).any(dim=2)  # [E, H]
    whole = routed.any(dim=1) & ~torch.isfinite(x).all(dim=1) | (bad_up[ids] & routed).any(dim=1)
    y[whole] = float("nan")
    y.masked_fill_((bad_down[ids] & routed[..., None]).any(dim=1), float("nan"))  # [T, H]


# --- torch.ops.kdsl.* (kdsl.ops.spec). check_ids reads ids on the host unless a CUDA graph is being captured, so
# the ops stay capturable (not host_syncing): captured calls skip the check.

def _fp8_grouped_gemm_fake(a, a_s, b, b_s, group_ids, out_dtype, check_ids):
    return _fp8_grouped_gemm_outputs(a, a_s, b, b_s, group_ids, out_dtype, symbolic=True)[-1]


def _fp8_grouped_gemm_masked_fake(a, a_s, b, b_s, masked_m, out_dtype, expected_m):
    return _fp8_grouped_gemm_masked_outputs(a, a_s, b, b_s, masked_m, out_dtype, symbolic=True)[-1]


def _moe_fp8_fake(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids):
    return _moe_fp8_outputs(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, symbolic=True)[-1]


# Example calls (kdsl.ops.spec): the grouped GEMMs over 8 experts, the MoE layer as DeepSeek-V3's.
def _fp8_grouped_gemm_example(tile, dtype, device):
    m, n, k = gemm_shape(tile)
    a, a_s, _, _, c = fp8_operands(device, (), m, n, k, dtype)
    _, _, b, b_s, _ = fp8_operands(device, (8,), m, n, k, dtype)
    yield a, a_s, b, b_s, empty(device, m, dtype=torch.int32), c


def _fp8_grouped_gemm_masked_example(tile, dtype, device):
    a, a_s, b, b_s, c = fp8_operands(device, (8,), *gemm_shape(tile), dtype)
    yield a, a_s, b, b_s, empty(device, 8, dtype=torch.int32), c


def _moe_fp8_example(tile, dtype, device):
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER
    w13, w13_s = empty(device, e, 2 * i, h, dtype=FP8), empty(device, e, 2 * i // 128, h // 128, dtype=torch.float32)
    w2, w2_s = empty(device, e, h, i, dtype=FP8), empty(device, e, h // 128, i // 128, dtype=torch.float32)
    # 64 tokens x 8 slots over 256 experts take the routing kernels' three steps (more than one chunk of
    # assignments), 16 tokens their one program; 4 tokens (T * k * 4 <= E) skip them, each assignment a block of its
    # own: the kernels are specialized for each way.
    for tokens in (64, 16, 4):
        yield (empty(device, tokens, h, dtype=dtype), w13, w13_s, w2, w2_s, *moe_routing(device, tokens=tokens),
               empty(device, tokens, h, dtype=dtype), None)


# ---- the C ABI of `kdsl aot` (kdsl.kernels.c_abi): what the exported C function takes and checks, which calls the
# export compiles for (representative problems: M over every tile bucket, the layers' N and K), and each kernel
# unit's C_LAUNCH says how it is launched from there.

# ---- fp8_grouped_gemm / fp8_grouped_gemm_masked: a MoE layer's projection over its experts -----------------------

# The experts' (E, N, K) the full export targets: DeepSeek-V3 (256 experts, hidden 7168; gate-up 2I x H and down
# H x I at I = 2048 and at its TP-8 slice I = 256) and Qwen3-30B-A3B (128 experts, hidden 2048, I = 768).
MOE_PROJECTIONS = tuple((experts, n, k) for experts, hidden, inters in ((256, 7168, (2048, 256)), (128, 2048, (768,)))
                        for inter in inters for n, k in ((2 * inter, hidden), (hidden, inter)))
# fp8_grouped_gemm's M: DeepGEMM's contiguous layout pads each expert's rows to 128, and the tile buckets count
# rows per expert, ceil(M / E): with 256 and with 128 experts these reach every bucket.
GROUPED_MS = (128, 1024, 4096, 16384, 32768)
# fp8_grouped_gemm_masked's max_m (decode: the tokens, at most that many per expert), each with expected_m 0 (the
# default, max_m) and the even share of top-8 routing, ceil(8 * max_m / E).
MASKED_MS = (1, 16, 64, 128, 256)
MOE_TOPK = 8


def contiguous_rows(tokens: int, topk: int, experts: int, align: int = 128) -> int:
    """M of the contiguous layout when tokens * topk slots spread evenly over the experts they can reach, each
    expert's rows padded to `align` (kdsl.bench.moe.contiguous_layout's padding)."""
    slots = tokens * topk
    routed = min(slots, experts)
    per_expert = -(-slots // routed)
    return routed * (-(-per_expert // align) * align)


def fp8_grouped_gemm_problems(projections, ms=GROUPED_MS, dtypes=tuple(DTYPES)):
    """projections: the experts' (E, N, K); ms: rows of a in the contiguous layout."""
    for m in ms:
        for experts, n, k in projections:
            for dtype in dtypes:
                yield dict(M=m, N=n, K=k, E=experts, lda=k, lda_s=k // 128, stride_be=n * k, stride_bn=k,
                           stride_bse=-(-n // 128) * (k // 128), stride_bsn=k // 128, ldc=n, out_dtype=dtype)


def fp8_grouped_gemm_masked_problems(projections, max_ms=MASKED_MS, topk=MOE_TOPK, dtypes=tuple(DTYPES)):
    """projections: the experts' (E, N, K); max_ms: rows per expert of a [E, max_m, K] (contiguous tensors)."""
    for max_m in max_ms:
        for experts, n, k in projections:
            for expected_m in sorted({0, -(-topk * max_m // experts)}):
                for dtype in dtypes:
                    yield dict(E=experts, max_m=max_m, N=n, K=k, expected_m=expected_m, stride_ae=max_m * k,
                               stride_am=k, stride_ase=max_m * (k // 128), stride_asm=k // 128, stride_be=n * k,
                               stride_bn=k, stride_bse=-(-n // 128) * (k // 128), stride_bsn=k // 128,
                               stride_ce=max_m * n, stride_cm=n, out_dtype=dtype)


def _fp8_grouped_gemm_problems():
    return fp8_grouped_gemm_problems(MOE_PROJECTIONS)


def _fp8_grouped_gemm_masked_problems():
    return fp8_grouped_gemm_masked_problems(MOE_PROJECTIONS)


def _grouped_bench_problems(case) -> dict:
    """A bench case (T tokens routed to topk of E experts, one projection N x K): its contiguous rows, and
    act_quant's (M, K), as a layer quantizes its activations before the GEMM."""
    rows = contiguous_rows(case.m, case.topk, case.experts)
    return {"fp8_grouped_gemm": fp8_grouped_gemm_problems([(case.experts, case.n, case.k)], ms=(rows,)),
            "act_quant": act_quant_problems([case.k], ms=(rows,))}


def _masked_bench_problems(case) -> dict:
    """A bench case in the masked layout: a [E, T, K] (kdsl.bench.cases.fp8_grouped_gemm_masked), its activations
    quantized as [E * T, K]."""
    return {"fp8_grouped_gemm_masked": fp8_grouped_gemm_masked_problems(
                [(case.experts, case.n, case.k)], max_ms=(case.m,), topk=case.topk),
            "act_quant": act_quant_problems([case.k], ms=(case.experts * case.m,))}


# Both grouped GEMMs take the experts' weights alike.
_EXPERT_WEIGHTS = (
    CArg("b", "ptr", "b [E, N, K] float8_e4m3fn, strides (stride_be, stride_bn, 1): the experts' weights"),
    CArg("stride_be", "i64", "b's expert stride in elements (>= 0)"),
    CArg("stride_bn", "i64", "b's row stride in elements (>= K)"),
    CArg("b_s", "ptr", "b_s [E, ceil(N / block_n), K / block_k] float32, strides (stride_bse, stride_bsn, 1)"),
    CArg("stride_bse", "i64", "b_s's expert stride in elements (>= 0)"),
    CArg("stride_bsn", "i64", "b_s's row stride in elements (>= K / block_k)"),
)
_GROUPED_STRIDES = ("lda", "lda_s", "stride_be", "stride_bn", "stride_bse", "stride_bsn", "ldc")

FP8_GROUPED_GEMM_ABI = OpAbi(
    op="fp8_grouped_gemm",
    function="kdsl_fp8_grouped_gemm",
    summary="c[m] = (a[m] * a_s[m]) @ (b[g] * b_s[g])^T with g = group_ids[m] (DeepGEMM's contiguous layout), "
            "block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [M, K] float8_e4m3fn, row stride lda, unit stride along K: the rows grouped by expert"),
        *FP8_ROW_SCALES,
        *_EXPERT_WEIGHTS,
        CArg("group_ids", "ptr", "group_ids int32 [M], contiguous: the expert of each row of a, -1 for a padding "
                                 "row (its row of c is not written); ids outside [-1, E) are not checked (kdsl.ops "
                                 "refuses them with check_ids): their rows are not written either"),
        CArg("c", "ptr", "c [M, N] of out_dtype, row stride ldc, unit stride along N (output; padding rows "
                         "unspecified)", const=False),
        CArg("ldc", "i64", "row stride of c in elements (>= N)"),
        FP8_OUT_DTYPE,
        CArg("M", "i64", "rows of a, c and group_ids, >= 0 (DeepGEMM pads each expert's rows to 128; any M runs)"),
        CArg("N", "i64", "rows of each expert's b, columns of c, >= 0"),
        FP8_K,
        CArg("E", "i64", "experts, >= 1"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "fp8_grouped_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        Check("E <= 0", "fp8_grouped_gemm: E = %lld: expected at least one expert (b [E, N, K])", ("E",)),
        k_in_act_groups("fp8_grouped_gemm"),
        Check("lda < K || stride_bn < K", "fp8_grouped_gemm: lda = %lld and stride_bn = %lld must be >= K = %lld",
              ("lda", "stride_bn", "K")),
        Check("ldc < N", "fp8_grouped_gemm: ldc = %lld must be >= N = %lld", ("ldc", "N")),
        Check("lda_s < K / {act_group} || stride_bsn < K / {block_k}",
              "fp8_grouped_gemm: lda_s = %lld must be >= K / {act_group} and stride_bsn = %lld >= K / {block_k}",
              ("lda_s", "stride_bsn")),
        Check("stride_be < 0 || stride_bse < 0", "fp8_grouped_gemm: stride_be = %lld and stride_bse = %lld must be "
              ">= 0", ("stride_be", "stride_bse")),
        fits_in_32_bits("fp8_grouped_gemm", ("M", "N", "K", "E", *_GROUPED_STRIDES)),
        not_null("fp8_grouped_gemm", ("M", "N"), ("a", "a_s", "b", "b_s", "group_ids", "c")),
    ),
    nothing_to_do="M == 0 || N == 0",
    # kdsl.ops.fp8_grouped_gemm picks the tile by the rows per expert, ceil(M / E).
    m="cdiv(M, E)",
    n="N",
    problems=_fp8_grouped_gemm_problems,
    bench_problems={"fp8_grouped_gemm": _grouped_bench_problems},
    with_m=lambda problem, m: {**problem, "M": m * problem["E"]},
)

_MASKED_STRIDES = ("stride_ae", "stride_am", "stride_ase", "stride_asm", "stride_be", "stride_bn", "stride_bse",
                   "stride_bsn", "stride_ce", "stride_cm")

FP8_GROUPED_GEMM_MASKED_ABI = OpAbi(
    op="fp8_grouped_gemm_masked",
    function="kdsl_fp8_grouped_gemm_masked",
    summary="c[e, :masked_m[e]] = (a[e] * a_s[e]) @ (b[e] * b_s[e])^T for each expert e (DeepGEMM's masked layout; "
            "masked_m read on the device), block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [E, max_m, K] float8_e4m3fn, strides (stride_ae, stride_am, 1)"),
        CArg("stride_ae", "i64", "a's expert stride in elements (>= 0)"),
        CArg("stride_am", "i64", "a's row stride in elements (>= K)"),
        CArg("a_s", "ptr", "a_s [E, max_m, K / act_group] float32, strides (stride_ase, stride_asm, 1)"),
        CArg("stride_ase", "i64", "a_s's expert stride in elements (>= 0)"),
        CArg("stride_asm", "i64", "a_s's row stride in elements (>= K / act_group)"),
        *_EXPERT_WEIGHTS,
        CArg("masked_m", "ptr", "masked_m int32 [E], contiguous, on the device: the rows of each expert, read by the "
                                "kernel (no host sync: one CUDA graph serves any routing), clamped to [0, max_m]"),
        CArg("c", "ptr", "c [E, max_m, N] of out_dtype, strides (stride_ce, stride_cm, 1) (output; rows past "
                         "masked_m[e] unspecified)", const=False),
        CArg("stride_ce", "i64", "c's expert stride in elements (>= 0)"),
        CArg("stride_cm", "i64", "c's row stride in elements (>= N)"),
        FP8_OUT_DTYPE,
        CArg("E", "i64", "experts, >= 0 (at most 65535: one grid row each)"),
        CArg("max_m", "i64", "rows per expert of a and c, >= 0"),
        CArg("N", "i64", "rows of each expert's b, columns of c, >= 0"),
        FP8_K,
        CArg("expected_m", "i64", "the rows per expert the tile is chosen for (a hint, as kdsl.ops' and DeepGEMM's "
                                  "expected_m), or 0 for max_m"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("E < 0 || max_m < 0 || N < 0 || K <= 0",
              "fp8_grouped_gemm_masked: E = %lld, max_m = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("E", "max_m", "N", "K")),
        k_in_act_groups("fp8_grouped_gemm_masked"),
        Check("expected_m < 0", "fp8_grouped_gemm_masked: expected_m = %lld must be >= 0 (0: max_m)",
              ("expected_m",)),
        Check("stride_am < K || stride_bn < K",
              "fp8_grouped_gemm_masked: stride_am = %lld and stride_bn = %lld must be >= K = %lld",
              ("stride_am", "stride_bn", "K")),
        Check("stride_cm < N", "fp8_grouped_gemm_masked: stride_cm = %lld must be >= N = %lld", ("stride_cm", "N")),
        Check("stride_asm < K / {act_group} || stride_bsn < K / {block_k}",
              "fp8_grouped_gemm_masked: stride_asm = %lld must be >= K / {act_group} and stride_bsn = %lld >= "
              "K / {block_k}", ("stride_asm", "stride_bsn")),
        Check(" || ".join(f"{name} < 0" for name in _MASKED_STRIDES), "fp8_grouped_gemm_masked: strides must be >= 0"),
        fits_in_32_bits("fp8_grouped_gemm_masked", ("max_m", "N", "K", *_MASKED_STRIDES)),
        # The grid's second dimension is the expert (launch_masked), which CUDA caps at 65535.
        Check("E > 65535", "fp8_grouped_gemm_masked: E = %lld experts: at most 65535 (one grid row per expert)",
              ("E",)),
        not_null("fp8_grouped_gemm_masked", ("E", "max_m", "N"), ("a", "a_s", "b", "b_s", "masked_m", "c")),
    ),
    nothing_to_do="E == 0 || max_m == 0 || N == 0",
    # kdsl.ops.fp8_grouped_gemm_masked picks the tile by expected_m, else max_m.
    m="either(expected_m, max_m)",
    n="N",
    problems=_fp8_grouped_gemm_masked_problems,
    bench_problems={"fp8_grouped_gemm_masked": _masked_bench_problems},
    with_m=lambda problem, m: {**problem, "expected_m": m},
)


SPECS = (
    OpSpec("fp8_grouped_gemm", "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor group_ids, "
                               "ScalarType out_dtype, bool check_ids) -> Tensor",
           _fp8_grouped_gemm_impl, _fp8_grouped_gemm_fake, example=_fp8_grouped_gemm_example,
           c_abi=FP8_GROUPED_GEMM_ABI),
    OpSpec("fp8_grouped_gemm_masked", "(Tensor a, Tensor a_s, Tensor b, Tensor b_s, Tensor masked_m, "
                                      "ScalarType out_dtype, int? expected_m) -> Tensor",
           _fp8_grouped_gemm_masked_impl, _fp8_grouped_gemm_masked_fake, example=_fp8_grouped_gemm_masked_example,
           c_abi=FP8_GROUPED_GEMM_MASKED_ABI),
    OpSpec("moe_fp8", "(Tensor x, Tensor w13, Tensor w13_s, Tensor w2, Tensor w2_s, Tensor topk_weights, "
                      "Tensor topk_ids, bool check_ids) -> Tensor",
           _moe_fp8_impl, _moe_fp8_fake, example=_moe_fp8_example),
)
