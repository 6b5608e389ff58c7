"""W4A16 mixture of experts (kdsl.ops.w4a16_moe): int4 experts prepared once (GPTQ v1/v2, AWQ), and the MoE layer.

    gptq_moe_prepare   GPTQ checkpoint tensors of one projection of every expert, stacked on a leading E dimension
                       (qweight [E, K/8, N], qzeros [E, G, N/8], scales [E, G, N], g_idx [E, K] or [E, S, K])
    awq_moe_prepare    the same from AutoAWQ "gemm" tensors (qweight [E, K, N/8], qzeros [E, G, N/8] or None)
    moe_w4a16          y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]

Both prepare into one W4A16ExpertsPrepared per projection: every expert in the layout the moe_w4a16 kernel's
variant declares (`layout` in kernel_defs/moe_w4a16.toml, the w4a16 layouts of kdsl.ops.w4a16), keyed by bits
and group size only (scheme w4a16.int4.gNNN), so the kernels serve every checkpoint format alike.

Act-order (a permuted g_idx) is resolved at prepare time, per expert: each expert's K is sorted by group, so its
groups become contiguous, and the permutation is kept (perm [E, S, K]); each call gathers every sorted row's
activation through it once (x for gate-up, h for down), so the GEMMs read weights, scales, zeros and activations
as without act-order.
Permutations differ from expert to expert, and within w13 between its gate and up halves (two linears of the
checkpoint, each with its own g_idx): g_idx [E, S, K] gives S column segments of N their own groups, so the
gate-up projection prepares with S = 2 (torch.stack((gate_g_idx, up_g_idx), 1)). Once sorted, every group must
hold group_size rows (it does for GPTQ's act-order, where g_idx[perm[i]] = i // group_size): the kernels find a
row's group as k // group_size, and a g_idx whose groups have other sizes is refused naming g_idx.

Ids on the device: as kdsl.ops.moe_fp8 (kdsl/ops/moe.py): check_ids=True refuses ids outside [0, E) naming topk_ids
after the routing kernel (one host sync, skipped while a CUDA graph is captured); otherwise such a slot adds
nothing. Layouts and tiles: docs/moe.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdsl.naming import w4a16_scheme_name
from kdsl.ops import _checks as check
from kdsl.ops import fallback
from kdsl.ops._examples import MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, empty, int4_weights, moe_routing
from kdsl.ops.awq import unpack_columns
from kdsl.ops.gptq_checkpoint import ACTIVATIONS, ZERO_OFFSET, default_g_idx, pack_rows, scheme_args, unpack_rows
from kdsl.ops.moe import _capturing, _check_ids, _refuse_ids, tokens_per_expert
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry

OP = "moe_w4a16"
AWQ_BITS = 4
SEGMENTS = (1, 2)  # permutations per expert the gate-up GEMM takes: one for all of w13, or the gate's and the up's


@dataclass(frozen=True, eq=False)
class W4A16ExpertsPrepared:
    """One projection of every expert of a MoE layer, int4, ready for kdsl.ops.moe_w4a16.

    qweight int32 [E, K / 8, N]: each expert's rows in prepared order (row k of expert e holds input column
    perm[e, s, k] for the columns of segment s), GPTQ's word packing; zeros [E, G, N] in `dtype` (layout
    zeros="biased": zero + the kernel's magic bias) or int32 [E, G, N / 8] (zeros="packed": the real zeros packed
    along N); scales [E, G, N] in `dtype`; perm int32 [E, S, K] (S segments of N, each N / S columns with its own
    permutation of K) or None where every expert's checkpoint order was already sorted. Row k of every expert is in
    group k // group_size."""

    scheme: str  # the kernels' scheme, e.g. "w4a16.int4.g128"
    source: str  # the checkpoint format prepared from ("gptq", "gptq_v2", "awq")
    bits: int
    group_size: int
    layout: dict
    dtype: torch.dtype
    experts: int
    k: int
    n: int
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None
    zero_bias: int  # added to the zeros in the "biased" layout

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def segments(self) -> int:
        return 1 if self.perm is None else self.perm.shape[1]

    def __repr__(self) -> str:
        return (f"W4A16ExpertsPrepared({self.source} -> {self.scheme}, E={self.experts}, K={self.k}, N={self.n}, "
                f"dtype={check.dtype_name(self.dtype)}, layout={self.layout}, act_order={self.perm is not None})")


# ---------------------------------------------------------------------------------------------------------------
# preparation

def gptq_moe_prepare(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> W4A16ExpertsPrepared:
    """Prepare one projection of E GPTQ experts, stacked: qweight int32 [E, K / 8, N], qzeros int32 [E, G, N / 8],
    scales fp16/bf16 [E, G, N], g_idx int32 [E, K] or [E, S, K] (S segments of N with their own g_idx: 2 for a
    gate_up projection whose gate and up were quantized apart) or None; activations must then come in scales'
    dtype. Act-order is resolved here, per expert (module docstring)."""
    scheme_args(bits, group_size, checkpoint_format)
    check.tensor("qweight", qweight, (torch.int32,), ndim=3)
    experts, k, n, groups = _stacked_shapes(qweight, scales, group_size, qweight.shape[1] * (32 // bits),
                                            qweight.shape[2])
    check.tensor("qzeros", qzeros, (torch.int32,), ndim=3)
    check.shape("qzeros", qzeros, (experts, groups, n // 8), f"E = {experts} experts, G = {groups} groups by N / 8")
    g_idx = _check_g_idx(g_idx, experts, k, n, groups)
    check.same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    zeros = _unpack_zero_rows(qzeros.reshape(experts * groups, n // 8), bits) + ZERO_OFFSET[checkpoint_format]
    return _prepare(lambda e: qweight[e], lambda e: unpack_rows(qweight[e].contiguous(), bits),
                    zeros.view(experts, groups, n), scales, g_idx, bits=bits, group_size=group_size,
                    source=checkpoint_format)


def awq_moe_prepare(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, *,
                    group_size: int = 128) -> W4A16ExpertsPrepared:
    """Prepare one projection of E AutoAWQ "gemm" experts, stacked: qweight int32 [E, K, N / 8] (packed along N in
    AWQ's column order), qzeros int32 [E, G, N / 8] or None (symmetric: every zero 8), scales fp16/bf16 [E, G, N];
    activations must then come in scales' dtype. Runs the same kernels as prepared GPTQ experts."""
    if (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 16
            or group_size & (group_size - 1)):
        raise ValueError(f"group_size: expected a power of two >= 16, got {group_size!r}")
    check.tensor("qweight", qweight, (torch.int32,), ndim=3)
    experts, k, n, groups = _stacked_shapes(qweight, scales, group_size, qweight.shape[1], qweight.shape[2] * 8)
    if qzeros is None:
        zeros = torch.full((experts, groups, n), 2 ** (AWQ_BITS - 1), dtype=torch.int32, device=qweight.device)
    else:
        check.tensor("qzeros", qzeros, (torch.int32,), ndim=3)
        check.shape("qzeros", qzeros, (experts, groups, n // 8), f"E = {experts} experts, G = {groups} groups by N / 8")
        zeros = unpack_columns(qzeros.reshape(experts * groups, n // 8)).view(experts, groups, n)
    check.same_device(qweight=qweight, qzeros=qzeros, scales=scales)
    return _prepare(None, lambda e: unpack_columns(qweight[e]), zeros, scales, None, bits=AWQ_BITS,
                    group_size=group_size, source="awq")


def _stacked_shapes(qweight, scales, group_size: int, k: int, n: int):
    """Check K and N (what qweight's packing gives) and scales against them; returns (E, K, N, G)."""
    check.tensor("scales", scales, ACTIVATIONS, ndim=3)
    experts = qweight.shape[0]
    if experts == 0:
        raise ValueError(f"qweight: expected at least one expert [E, ...], got shape {tuple(qweight.shape)}")
    if k % 8 or k == 0:
        raise ValueError(f"qweight: K = {k} must be a positive multiple of 8 (one int32 word packs 8 rows)")
    if n % 8 or n == 0:
        raise ValueError(f"qweight: N = {n} must be a positive multiple of 8 (qzeros packs 8 columns per int32)")
    if group_size != -1 and k % group_size:
        raise ValueError(f"qweight: K = {k} is not a multiple of group_size = {group_size}")
    groups = 1 if group_size == -1 else k // group_size
    check.shape("scales", scales, (experts, groups, n), f"E = {experts} experts, G = {groups} groups by N = {n}")
    return experts, k, n, groups


def _check_g_idx(g_idx, experts: int, k: int, n: int, groups: int) -> torch.Tensor | None:
    """g_idx [E, K] or [E, S, K] as int32 [E, S, K] (None stays None); values in [0, G)."""
    if g_idx is None:
        return None
    check.tensor("g_idx", g_idx, (torch.int32,))
    if g_idx.dim() == 2:
        g_idx = g_idx.unsqueeze(1)
    if g_idx.dim() != 3 or g_idx.shape[0] != experts or g_idx.shape[2] != k or g_idx.shape[1] == 0 \
            or n % g_idx.shape[1]:
        raise ValueError(f"g_idx: expected shape ({experts}, {k}) or ({experts}, S, {k}), S dividing N = {n} (the "
                         f"group of each of the K input rows, per expert and per segment of N), got "
                         f"{tuple(g_idx.shape)}")
    low, high = int(g_idx.min()), int(g_idx.max())
    if low < 0 or high >= groups:
        raise ValueError(f"g_idx: values must lie in [0, {groups}), got [{low}, {high}]")
    return g_idx


def _unpack_zero_rows(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, N / 8] packed along N (GPTQ) -> the stored zeros [R, N]."""
    return unpack_rows(qzeros.T.contiguous(), bits).T


def _prepare(packed_of, values_of, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, *,
             bits: int, group_size: int, source: str) -> W4A16ExpertsPrepared:
    """Write the layout the moe_w4a16 kernel serving the device reads. values_of(e): expert e's weights as int
    [K, N] in checkpoint order; packed_of(e): the same as GPTQ words [K / 8, N] (None: pack values_of(e)), used
    as they are where the order does not change. zeros: real zeros int [E, G, N]."""
    experts, groups, n = zeros.shape
    device = zeros.device
    scheme = w4a16_scheme_name(bits, group_size)
    registry.require_scheme(OP, scheme, f"bits = {bits}, group_size = {group_size}")
    entry = registry.dispatch(OP, scheme, device)
    layout = dict(entry.layout)
    k = values_of(0).shape[0] if packed_of is None else packed_of(0).shape[0] * (32 // bits)
    perm = _sorted_order(g_idx, group_size) if g_idx is not None else None

    qweight = torch.empty((experts, k // (32 // bits), n), dtype=torch.int32, device=device)
    for e in range(experts):
        if perm is None and packed_of is not None:
            qweight[e] = packed_of(e)
            continue
        q = values_of(e).to(torch.int64)
        if perm is not None:
            cols = n // perm.shape[1]
            q = torch.cat([q[perm[e, s].long(), s * cols:(s + 1) * cols] for s in range(perm.shape[1])], dim=1)
        qweight[e] = pack_rows(q, bits)

    zero_bias = 0
    scales = scales.contiguous()
    if layout["zeros"] == "biased":
        zero_bias = entry.zero_bias[check.dtype_name(scales.dtype)]
        stored = (zeros + zero_bias).to(scales.dtype).contiguous()
    elif layout["zeros"] == "packed":
        if int(zeros.min()) < 0 or int(zeros.max()) > 2**bits - 1:
            raise ValueError(f"qzeros: layout {layout} packs real zeros in {bits} bits, but they span "
                             f"[{int(zeros.min())}, {int(zeros.max())}]")
        rows = zeros.reshape(experts * groups, n).T.contiguous().to(torch.int64)
        stored = pack_rows(rows, bits).T.reshape(experts, groups, n // 8).contiguous()
    else:  # validation allows only the layouts of checkpoint-order words (kdsl/kernels/w4a16/moe_sorted.py)
        raise ValueError(f"{entry.name} declares layout {layout}, which moe_w4a16 preparation does not write")
    return W4A16ExpertsPrepared(
        scheme=scheme, source=source, bits=bits, group_size=group_size, layout=layout, dtype=scales.dtype,
        experts=experts, k=k, n=n, qweight=qweight, zeros=stored, scales=scales, perm=perm, zero_bias=zero_bias)


def _sorted_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Each expert's (and segment's) rows sorted by group, int32 [E, S, K], or None where every one is in order
    already; refuses (naming g_idx) groups that do not hold group_size consecutive rows once sorted."""
    experts, segments, k = g_idx.shape
    order = torch.argsort(g_idx, dim=-1, stable=True)
    arranged = torch.gather(g_idx, -1, order)
    default = default_g_idx(k, group_size, g_idx.device)
    bad = (arranged != default).any(dim=-1)  # [E, S]
    if bool(bad.any()):
        e, s = (int(i) for i in bad.nonzero()[0])
        sizes = torch.bincount(g_idx[e, s].long()).tolist()
        where = f"expert {e}" + (f", segment {s}" if segments > 1 else "")
        raise ValueError(f"g_idx: {where} has groups of {sorted(set(sizes))} rows; moe_w4a16 needs every group to "
                         f"hold group_size = {group_size} rows (a row's group is k // group_size once K is sorted)")
    if torch.equal(order, torch.arange(k, device=g_idx.device).expand_as(order)):
        return None
    return order.to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# moe_w4a16

def moe_w4a16(x: torch.Tensor, w13: W4A16ExpertsPrepared, w2: W4A16ExpertsPrepared, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, check_ids: bool = True) -> torch.Tensor:
    """y [T, H] in x's dtype: y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
    e = topk_ids[t, j].

    x [T, H] fp16/bf16, in the dtype the experts were prepared with; w13: every expert's gate_proj then up_proj as
    one [2I, H] linear (K = H, N = 2I: gate columns, then up columns), w2 their down_proj (K = I, N = H), both from
    kdsl.ops.gptq_moe_prepare / awq_moe_prepare with one scheme; topk_weights float32 [T, k]; topk_ids int32
    [T, k]. Both GEMMs multiply fp16/bf16 operands (the weights dequantized in registers, (q - zero) * scale
    rounded once) with fp32 accumulation; h = silu(gate) * up is rounded to x's dtype, each slot's down
    projection too, and the slots are summed in fp32. One CUDA graph serves any routing.
    check_ids: refuse ids outside [0, E) naming topk_ids (one host sync; skipped while a CUDA graph is captured).
    """
    _check_prepared("w13", w13)
    _check_prepared("w2", w2)
    if torch.compiler.is_compiling():  # one opaque op for Dynamo; see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.moe_w4a16(x, *prepared_args(w13, w2), topk_weights, topk_ids, check_ids)
    return _moe_w4a16_impl(x, w13, w2, topk_weights, topk_ids, check_ids)


def _check_prepared(name: str, prepared) -> None:
    if not isinstance(prepared, W4A16ExpertsPrepared):
        raise TypeError(f"{name}: expected experts from kdsl.ops.gptq_moe_prepare or awq_moe_prepare, "
                        f"got {type(prepared).__name__}")


def prepared_args(w13: W4A16ExpertsPrepared, w2: W4A16ExpertsPrepared) -> tuple:
    """The two projections as torch.ops.kdsl.moe_w4a16's arguments between x and topk_weights, then the fields
    both share (prepared_from_args rebuilds them; _moe_w4a16_outputs checks that they share them)."""
    return (w13.qweight, w13.zeros, w13.scales, w13.perm, w2.qweight, w2.zeros, w2.scales, w2.perm,
            w13.scheme, w13.source, w13.bits, w13.group_size, w13.layout["zeros"], w13.layout.get("weights", ""),
            w13.zero_bias)


def prepared_from_args(qweight, zeros, scales, perm, scheme: str, source: str, bits: int, group_size: int,
                       layout_zeros: str, layout_weights: str, zero_bias: int) -> W4A16ExpertsPrepared:
    """One projection from the op's arguments (prepared_args' inverse)."""
    layout = {"zeros": layout_zeros}
    if layout_weights:
        layout["weights"] = layout_weights
    return W4A16ExpertsPrepared(
        scheme=scheme, source=source, bits=bits, group_size=group_size, layout=layout, dtype=scales.dtype,
        experts=qweight.shape[0], k=qweight.shape[1] * (32 // bits), n=qweight.shape[2], qweight=qweight, zeros=zeros,
        scales=scales, perm=perm, zero_bias=zero_bias)


def _fields(p: W4A16ExpertsPrepared) -> tuple:
    return p.scheme, p.bits, p.group_size, p.layout, p.dtype, p.zero_bias


def _moe_w4a16_outputs(x, w13: W4A16ExpertsPrepared, w2: W4A16ExpertsPrepared, topk_weights, topk_ids) -> torch.Tensor:
    """Checks and the empty output y [T, H] (the fake kernel under torch.compile too)."""
    check.tensor("x", x, ACTIVATIONS, ndim=2)
    for name, p in (("w13", w13), ("w2", w2)):
        check.tensor(f"{name}.qweight", p.qweight, (torch.int32,), ndim=3)
        check.tensor(f"{name}.scales", p.scales, ACTIVATIONS, ndim=3)
        if p.perm is not None:
            check.tensor(f"{name}.perm", p.perm, (torch.int32,), ndim=3)
    check.tensor("topk_weights", topk_weights, (torch.float32,), ndim=2)
    check.tensor("topk_ids", topk_ids, (torch.int32,), ndim=2)
    tokens, hidden = x.shape
    if x.dtype != w13.dtype:
        raise TypeError(f"x: expected dtype {check.dtype_name(w13.dtype)} (the experts were prepared with scales in "
                        f"that dtype), got {check.dtype_name(x.dtype)}")
    if _fields(w2) != _fields(w13):
        raise ValueError(f"w2: prepared as {w2.scheme} {w2.layout} {check.dtype_name(w2.dtype)}, but w13 as "
                         f"{w13.scheme} {w13.layout} {check.dtype_name(w13.dtype)}; prepare both alike")
    if w13.k != hidden:
        raise ValueError(f"w13: expected K = {hidden} (x's hidden size H) for experts [E, 2I, H], got K = {w13.k}")
    if w13.n % 2:
        raise ValueError(f"w13: expected N = 2I (gate columns, then up columns), got N = {w13.n}")
    inter = w13.n // 2
    if (w2.experts, w2.k, w2.n) != (w13.experts, inter, hidden):
        raise ValueError(f"w2: expected {w13.experts} experts with K = {inter} (I, from w13) and N = {hidden} (H), got "
                         f"E = {w2.experts}, K = {w2.k}, N = {w2.n}")
    if w13.segments not in SEGMENTS:
        raise ValueError(f"w13.perm: expected one permutation per expert or two (gate and up halves), got "
                         f"{w13.segments} segments")
    if w2.segments != 1:
        raise ValueError(f"w2.perm: expected one permutation per expert (down_proj's g_idx), got {w2.segments} "
                         "segments")
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected shape ({tokens}, k), one row per token of x, got {tuple(topk_ids.shape)}")
    check.shape("topk_weights", topk_weights, tuple(topk_ids.shape), "one weight per routed slot, as topk_ids")
    check.same_device(x=x, w13=w13.qweight, w2=w2.qweight, topk_weights=topk_weights, topk_ids=topk_ids)
    return x.new_empty((tokens, hidden))


def _moe_w4a16_impl(x, w13: W4A16ExpertsPrepared, w2: W4A16ExpertsPrepared, topk_weights, topk_ids,
                    check_ids: bool = True) -> torch.Tensor:
    y = _moe_w4a16_outputs(x, w13, w2, topk_weights, topk_ids)
    registry.require_scheme(OP, w13.scheme, f"bits = {w13.bits}, group_size = {w13.group_size}")
    tokens, hidden = x.shape
    experts, topk = w13.experts, topk_ids.shape[1]
    if y.numel() == 0:
        return y
    if topk == 0:
        return y.zero_()
    what = f"expert ids (w13 has {experts} experts)"
    device = x.device
    if not check.use_kernels(device):
        if check_ids:
            _check_ids("topk_ids", topk_ids, 0, experts, what)
        return y.copy_(fallback.moe_w4a16(
            x, lambda e: (_dequant(w13, e), _perm(w13, e), _dequant(w2, e), _perm(w2, e)), topk_weights, topk_ids,
            experts))

    def refuse_outside(count: torch.Tensor) -> None:
        # The routing kernel counted the ids outside [0, E): the op's one host sync, before the GEMMs launch.
        if int(count.item()):
            _refuse_ids("topk_ids", topk_ids, 0, experts, what)

    on_routed = refuse_outside if check_ids and not _capturing(x) else None
    x = x if x.stride(1) == 1 else x.contiguous()
    entry = registry.dispatch(OP, w13.scheme, device)
    if entry.layout != w13.layout:
        raise ValueError(f"w13: experts are in layout {w13.layout}, but {entry.name} reads {entry.layout}; "
                         "prepare them again")
    tile = entry.tile_for(tokens_per_expert(tokens * topk, experts), w2.k)  # by I, as moe_fp8
    entry.launch(x, w13.qweight, w13.zeros, w13.scales, w13.perm, w2.qweight, w2.zeros, w2.scales, w2.perm,
                 topk_weights, topk_ids, y, on_routed, tile)
    return y


def _perm(p: W4A16ExpertsPrepared, e: int) -> torch.Tensor | None:
    return None if p.perm is None else p.perm[e]


def _dequant(p: W4A16ExpertsPrepared, e: int) -> torch.Tensor:
    """Expert e's weights as float32 [K, N] in prepared K order (the torch fallback's, and tests')."""
    groups = default_g_idx(p.k, p.group_size, p.device).long()
    if p.layout["zeros"] == "packed":
        zeros = _unpack_zero_rows(p.zeros[e], p.bits).float()
    else:
        zeros = p.zeros[e].float() - p.zero_bias
    return (unpack_rows(p.qweight[e], p.bits).float() - zeros[groups]) * p.scales[e].float()[groups]


__all__ = ["W4A16ExpertsPrepared", "gptq_moe_prepare", "awq_moe_prepare", "moe_w4a16"]


# --- torch.ops.kdsl.moe_w4a16 (kdsl.ops.spec): the two W4A16ExpertsPrepared cross as their tensors and the fields
# they share (prepared_args)

def _experts(w13_qweight, w13_zeros, w13_scales, w13_perm, w2_qweight, w2_zeros, w2_scales, w2_perm, *shared):
    """(w13, w2) as kdsl.ops.moe_w4a16 takes them, from the op's arguments."""
    return (prepared_from_args(w13_qweight, w13_zeros, w13_scales, w13_perm, *shared),
            prepared_from_args(w2_qweight, w2_zeros, w2_scales, w2_perm, *shared))


def _moe_w4a16_op(x, *args):
    *fields, topk_weights, topk_ids, check_ids = args
    return _moe_w4a16_impl(x, *_experts(*fields), topk_weights, topk_ids, check_ids)


def _moe_w4a16_fake(x, *args):
    *fields, topk_weights, topk_ids, check_ids = args
    return _moe_w4a16_outputs(x, *_experts(*fields), topk_weights, topk_ids)


def _moe_w4a16_example(tile, dtype, device):
    """DeepSeek-V3's sizes; act-order on gate-up, its gate and up halves permuted apart (the gather kernel)."""
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER
    yield (empty(device, 4, h, dtype=dtype), *int4_weights(device, e, k=h, n=2 * i, out=dtype),
           empty(device, e, 2, h, dtype=torch.int32), *int4_weights(device, e, k=i, n=h, out=dtype), None,
           *moe_routing(device), empty(device, 4, h, dtype=dtype), None)


SPECS = (
    OpSpec("moe_w4a16", "(Tensor x, Tensor w13_qweight, Tensor w13_zeros, Tensor w13_scales, Tensor? w13_perm, "
                        "Tensor w2_qweight, Tensor w2_zeros, Tensor w2_scales, Tensor? w2_perm, str scheme, "
                        "str source, int bits, int group_size, str layout_zeros, str layout_weights, int zero_bias, "
                        "Tensor topk_weights, Tensor topk_ids, bool check_ids) -> Tensor",
           _moe_w4a16_op, _moe_w4a16_fake, example=_moe_w4a16_example),
)
