"""Int4 weights prepared once for the fast W4A16 kernels, whatever checkpoint they came from.

`prepare` takes unpacked integer weights, real zeros and scales (kdsl.ops.gptq_prepare and
kdsl.ops.awq_prepare unpack their checkpoint formats into these), asks the registry which
w4a16_gemm kernel serves the device, and writes the weights the way that kernel's `layout`
(declared in its definition, listed in the manifest) says: K sorted by group, so act-order
costs a gather of x's columns instead of a gather of scales per element; zeros either
unpacked and biased for the kernel's dequant, or packed as real values. The kernels are keyed
by bits and group size only (scheme w4a16.int4.gNNN), so GPTQ v1/v2 and AWQ share them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kdsl.kernels.host import dependent_launches
from kdsl.kernels.w4a16.common import gather_columns
from kdsl.naming import w4a16_scheme_name
from kdsl.kernels.c_abi import CArg, Check, OpAbi, fits_in_32_bits, not_null
from kdsl.ops import _checks as check
from kdsl.ops import _plan, fallback
from kdsl.ops._examples import empty, int4_weights, split_steps
from kdsl.ops.gptq_checkpoint import ACTIVATIONS, default_g_idx, pack_rows, unpack_rows, unpack_zeros
from kdsl.ops.spec import OpSpec
from kdsl.packing import PLANE_ROWS, PLANE_TILE_K, PLANE_TILE_N
from kdsl.runtime import registry

PREPARED_OP = "w4a16_gemm"
DEQUANT_OP = "w4a16_dequant"  # the prepared weights as fp16/bf16 (w4a16_gemm's dequantize + cuBLAS path)


@dataclass(frozen=True, eq=False)
class W4A16Prepared:
    """Weights of one int4 linear layer, ready for `kdsl.ops.w4a16_gemm(x, prepared)`.

    qweight, rows in prepared order (row k holds input column perm[k]): int32 [K / 8, N] in the
    "checkpoint" weights layout, or int32 [N tiles, K tiles, PLANE_TILE_N, 16] in "k_planes"
    (see `pack_planes`);
    zeros [G, N] in `dtype` (layout zeros="biased": zero + the kernel's magic bias) or int32
    [G, N / 8] (zeros="packed": the real zeros, packed along N as GPTQ packs qzeros); scales [G, N] in `dtype`
    (zeros="paired": biased zeros and scales are views, column stride 2, of one [G, N, 2] tensor);
    groups int32 [K], the group of each prepared row; perm int32 [K] or None when the
    checkpoint's order is already sorted.
    """

    scheme: str  # the kernels' scheme, e.g. "w4a16.int4.g128"
    source: str  # the checkpoint format prepared from ("gptq", "gptq_v2", "awq")
    bits: int
    group_size: int
    layout: dict
    dtype: torch.dtype
    k: int
    n: int
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    perm: torch.Tensor | None
    contiguous_groups: bool  # prepared row k is in group k // group_size
    zero_bias: int  # added to the zeros in the "biased" layout

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @cached_property
    def plan_key(self) -> tuple:
        """The part of a launch plan's key (_plan_key) these weights make: the fields the kernels read and each
        tensor's metadata. Computed once: the fields and tensors of a frozen instance cannot be replaced (resizing or
        re-pointing its tensors in place is not supported), and building the key took a quarter of W4A16Linear's
        eager host time per call (cProfile on an H200 host, 4096x4096, M = 1)."""
        key = (self.scheme, self.bits, self.group_size, self.dtype, self.k, self.n, self.contiguous_groups,
               self.zero_bias, len(self.layout), self.layout["zeros"], self.layout.get("weights"))
        for t in (self.qweight, self.zeros, self.scales, self.groups, self.perm):
            key += (None,) if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
        return key

    def __getstate__(self) -> dict:
        # A copy or an unpickled instance (torch.load may map its tensors elsewhere) works its key out again.
        return {name: value for name, value in self.__dict__.items() if name != "plan_key"}

    def __repr__(self) -> str:
        return (f"W4A16Prepared({self.source} -> {self.scheme}, K={self.k}, N={self.n}, "
                f"dtype={check.dtype_name(self.dtype)}, layout={self.layout}, act_order={self.perm is not None})")


GPTQPrepared = W4A16Prepared  # the name before AWQ shared these kernels


def prepare(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, row_groups: torch.Tensor | None, *,
            bits: int, group_size: int, source: str) -> W4A16Prepared:
    """q int [K, N] in [0, 2**bits), zeros int [G, N] (real values), scales [G, N] fp16/bf16, row_groups
    int32 [K] (None: row k is in group k // group_size); source names the checkpoint format for repr.
    Shapes and ranges are the caller's to check (each checkpoint format words its own errors)."""
    k, n = q.shape
    device = q.device
    scheme = w4a16_scheme_name(bits, group_size)
    registry.require_scheme(PREPARED_OP, scheme, f"bits = {bits}, group_size = {group_size}")
    entry = registry.dispatch(PREPARED_OP, scheme, device)
    layout = dict(entry.layout)

    default_groups = default_g_idx(k, group_size, device)
    perm = None
    if row_groups is None:
        row_groups = default_groups
    elif k:
        row_groups = row_groups.to(torch.int32)
        order = torch.argsort(row_groups, stable=True)
        if not torch.equal(order, torch.arange(k, device=device)):
            perm = order.to(torch.int32)
            row_groups = row_groups[order]
            q = q[order]
    contiguous = torch.equal(row_groups, default_groups)

    zero_bias = 0
    scales = scales.contiguous()
    if layout["zeros"] != "packed":  # "biased", or "paired" with the scales
        # The kernel makes (bias + q) from q's bits and subtracts (bias + zero): both exact.
        zero_bias = entry.zero_bias[check.dtype_name(scales.dtype)]
        packed_zeros = (zeros + zero_bias).to(scales.dtype).contiguous()
        if layout["zeros"] == "paired":
            pairs = torch.stack((scales, packed_zeros), dim=-1)  # [G, N, 2]: one 32-bit (scale, zero) per column
            scales, packed_zeros = pairs[..., 0], pairs[..., 1]
    else:
        if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > 2**bits - 1):
            raise ValueError(f"zeros: layout {layout} packs real zeros in {bits} bits, but they span "
                             f"[{int(zeros.min())}, {int(zeros.max())}]")
        packed_zeros = pack_rows(zeros.T.contiguous().to(torch.int64), bits).T.contiguous()
    if layout.get("weights") == "k_planes":
        packed = pack_planes(q.to(torch.int64))
    else:
        packed = pack_rows(q.to(torch.int64), bits).contiguous()
    return W4A16Prepared(
        scheme=scheme, source=source, bits=bits, group_size=group_size, layout=layout, dtype=scales.dtype,
        k=k, n=n, qweight=packed, zeros=packed_zeros, scales=scales, groups=row_groups.contiguous(), perm=perm,
        contiguous_groups=contiguous, zero_bias=zero_bias,
    )


def pack_planes(q: torch.Tensor) -> torch.Tensor:
    """q int64 [K, N] in [0, 16) -> int32 [N tiles, K tiles, PLANE_TILE_N, PLANE_ROWS], the "k_planes" layout.

    Word (n, kk) of tile (nt, kt) holds, of column nt * PLANE_TILE_N + n, the rows
    kt * PLANE_TILE_K + PAIR_SPAN * p + 2 kk + h in nibble p + 4 h (p < 4, h < 2): the two nibbles a
    LOP3 turns into one half2 are adjacent rows. K and N are padded with zeros to whole tiles.
    """
    k, n = q.shape
    k_tiles, n_tiles = -(-k // PLANE_TILE_K), -(-n // PLANE_TILE_N)
    padded = torch.zeros(k_tiles * PLANE_TILE_K, n_tiles * PLANE_TILE_N, dtype=torch.int64, device=q.device)
    padded[:k, :n] = q
    rows = padded.view(k_tiles, 4, PLANE_ROWS, 2, n_tiles, PLANE_TILE_N)  # [kt, p, kk, h, nt, n]
    nibbles = rows.permute(4, 0, 5, 2, 3, 1).reshape(n_tiles, k_tiles, PLANE_TILE_N, PLANE_ROWS, 8)  # j = 4 h + p
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def unpack_planes(words: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """pack_planes' inverse: int32 [N tiles, K tiles, PLANE_TILE_N, PLANE_ROWS] -> int32 [k, n]."""
    n_tiles, k_tiles = words.shape[:2]
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 15  # [nt, kt, n, kk, j]
    rows = nibbles.view(n_tiles, k_tiles, PLANE_TILE_N, PLANE_ROWS, 2, 4).permute(1, 5, 3, 4, 0, 2)
    return rows.reshape(k_tiles * PLANE_TILE_K, n_tiles * PLANE_TILE_N)[:k, :n]


def checkpoint_rows(prepared: W4A16Prepared) -> torch.Tensor:
    """The prepared weights as int32 [K / 8, N] words in prepared row order, whatever the layout."""
    if prepared.layout.get("weights") == "k_planes":
        return pack_rows(unpack_planes(prepared.qweight, prepared.k, prepared.n).to(torch.int64), prepared.bits)
    return prepared.qweight


def w4a16_gemm(x: torch.Tensor, prepared: W4A16Prepared) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w in x's dtype, w from kdsl.ops.gptq_prepare or kdsl.ops.awq_prepare.

    From the variant's dequant_min_m rows of x up (prefill), the weights are dequantized into a scratch
    w [N, K] (w4a16_dequant's kernel) and cuBLAS multiplies; below it, the W4A16 GEMM kernels run."""
    _check_prepared(prepared)
    if torch.compiler.is_compiling():  # one opaque op for Dynamo; see kdsl.ops.block_fp8.act_quant
        # A Python object cannot cross the op boundary: its tensors and fields do (SPECS below).
        return torch.ops.kdsl.w4a16_gemm(x, *prepared_args(prepared))
    return _w4a16_gemm_impl(x, prepared)


def w4a16_dequant(prepared: W4A16Prepared) -> torch.Tensor:
    """w [N, K] in the prepared dtype (fp16/bf16, nn.Linear's layout) with K in prepared order: input column
    perm[k] of the checkpoint is column k of w, so x.index_select(-1, prepared.perm) @ w.T (x @ w.T when
    prepared.perm is None) is w4a16_gemm(x, prepared) up to rounding. The checkpoint's order, where wanted:
    w_ck = torch.empty_like(w); w_ck[:, prepared.perm.long()] = w. Exact: (q - zero) * scale rounded once."""
    _check_prepared(prepared)
    if torch.compiler.is_compiling():  # one opaque op for Dynamo, as w4a16_gemm
        return torch.ops.kdsl.w4a16_dequant(*prepared_args(prepared))
    return _w4a16_dequant_impl(prepared)


def _check_prepared(prepared) -> None:
    if not isinstance(prepared, W4A16Prepared):
        raise TypeError(f"prepared: expected weights from kdsl.ops.gptq_prepare or awq_prepare, "
                        f"got {type(prepared).__name__}")


def _w4a16_dequant_outputs(prepared: W4A16Prepared) -> torch.Tensor:
    """w4a16_dequant's checks and empty output (the fake kernel under torch.compile too)."""
    check.tensor("prepared.qweight", prepared.qweight, (torch.int32,))
    check.tensor("prepared.scales", prepared.scales, ACTIVATIONS)
    device = check.same_device(qweight=prepared.qweight, zeros=prepared.zeros, scales=prepared.scales,
                               groups=prepared.groups)
    return torch.empty((prepared.n, prepared.k), dtype=prepared.dtype, device=device)


def _w4a16_dequant_impl(prepared: W4A16Prepared) -> torch.Tensor:
    w = _w4a16_dequant_outputs(prepared)
    registry.require_scheme(DEQUANT_OP, prepared.scheme,
                            f"bits = {prepared.bits}, group_size = {prepared.group_size}")
    if w.numel() == 0:
        return w
    if not check.use_kernels(w.device):
        return _dequant_torch(prepared)
    entry = registry.dispatch(DEQUANT_OP, prepared.scheme, w.device)
    _check_layout(entry, prepared)
    entry.launch(prepared.qweight, prepared.zeros, prepared.scales, prepared.groups, prepared.contiguous_groups,
                 None, w, entry.tile_for(None))
    return w


def _dequant_torch(prepared: W4A16Prepared) -> torch.Tensor:
    """The torch fallback of w4a16_dequant (CPU without Triton's interpreter): contiguous [N, K]."""
    groups = prepared.groups.long()
    w = (unpack_rows(checkpoint_rows(prepared), prepared.bits).float() - _real_zeros(prepared).float()[groups]
         ) * prepared.scales.float()[groups]  # [K, N]
    return w.T.to(prepared.dtype).contiguous()


def _real_zeros(prepared: W4A16Prepared) -> torch.Tensor:
    """The zeros [G, N] as real values, whatever the layout stores."""
    if prepared.layout["zeros"] == "packed":
        return unpack_zeros(prepared.zeros, prepared.bits, 0)
    return prepared.zeros.float() - prepared.zero_bias


def _check_layout(entry, prepared: W4A16Prepared) -> None:
    if entry.layout != prepared.layout:
        raise ValueError(f"prepared: weights are in layout {prepared.layout}, but {entry.name} reads "
                         f"{entry.layout}; prepare them again")


def _dequant_kernel(entry, m: int, n: int, device: torch.device):
    """The dequantizer of w4a16_gemm's dequantize + cuBLAS path for M rows and N columns (None: the GEMM tiles
    serve the call): the variant's dequant_min_m and dequant_max_n (manifest "dequant") and registry.dequant_for,
    remembered per kernel and device."""
    dequant = entry.dequant
    if dequant is None or m < dequant["min_m"] or n > dequant.get("max_n", n):
        return None
    return registry.memo(("w4a16_dequant_for", entry.name, device.type, device.index),
                         lambda: registry.dequant_for(entry, registry.device_arch(device))[0])


def prepared_args(prepared: W4A16Prepared) -> tuple:
    """The fields of prepared in the order of torch.ops.kdsl.w4a16_gemm's arguments after x
    (prepared_from_args rebuilds the object from them)."""
    return (prepared.qweight, prepared.zeros, prepared.scales, prepared.groups, prepared.perm,
            prepared.scheme, prepared.source, prepared.bits, prepared.group_size,
            prepared.layout["zeros"], prepared.layout.get("weights", ""), prepared.k, prepared.n,
            prepared.contiguous_groups, prepared.zero_bias)


def prepared_from_args(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                       perm: torch.Tensor | None, scheme: str, source: str, bits: int, group_size: int,
                       layout_zeros: str, layout_weights: str, k: int, n: int, contiguous_groups: bool,
                       zero_bias: int) -> W4A16Prepared:
    """prepared_args' inverse: the W4A16Prepared the op's implementation and fake kernel work on."""
    layout = {"zeros": layout_zeros}
    if layout_weights:
        layout["weights"] = layout_weights
    return W4A16Prepared(
        scheme=scheme, source=source, bits=bits, group_size=group_size, layout=layout, dtype=scales.dtype,
        k=k, n=n, qweight=qweight, zeros=zeros, scales=scales, groups=groups, perm=perm,
        contiguous_groups=contiguous_groups, zero_bias=zero_bias,
    )


def _w4a16_gemm_outputs(x: torch.Tensor, prepared: W4A16Prepared) -> torch.Tensor:
    """w4a16_gemm's checks and empty output (the fake kernel under torch.compile too)."""
    check.tensor("x", x, ACTIVATIONS, min_ndim=1)
    if x.dtype != prepared.dtype:
        raise TypeError(f"x: expected dtype {check.dtype_name(prepared.dtype)} (the weights were prepared "
                        f"with scales in that dtype), got {check.dtype_name(x.dtype)}")
    if x.shape[-1] != prepared.k:
        raise ValueError(f"x: expected K = {prepared.k} in the last dimension (the prepared weights), got shape {tuple(x.shape)}")
    device = check.same_device(x=x, prepared=prepared.qweight)
    return torch.empty((*x.shape[:-1], prepared.n), dtype=x.dtype, device=device)


def _plan_key(x: torch.Tensor, p: W4A16Prepared) -> tuple:
    """The launch plan's key (kdsl/ops/_plan.py): x's and the prepared tensors' metadata, the fields read."""
    return ("w4a16_gemm", _plan.current_device(), type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
            x.requires_grad,  # the checks refuse an input that requires grad: a plan must not skip them
            p.plan_key)


# Launch plans serve calls of up to this many rows: decode, whose short kernels wait on the host. Above it the
# kernels hide the host's time, and a plan's replay of the Gluon TMA tile measured 5% slower on the GPU
# (H100, M = 256, N = 4096, K = 14336: 57.1-57.9 us against 55.0-56.2 without, interleaved in one process).
PLAN_MAX_ROWS = 128


def _w4a16_gemm_impl(x: torch.Tensor, prepared: W4A16Prepared) -> torch.Tensor:
    try:
        key = _plan_key(x, prepared) if x.numel() <= PLAN_MAX_ROWS * x.shape[-1] else None
        plan = _plan.PLANS.get(key) if key is not None else None
    except Exception:  # not a tensor, say: the checks below word the error
        key = plan = None
    if plan:
        y = plan(x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups)
        if y is not None:
            return y if prepared.perm is None else y[0]  # act-order's plans also allocate the gathered x
    y = _w4a16_gemm_outputs(x, prepared)
    device = y.device
    k, n = prepared.k, prepared.n
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    x2 = check.rows(x, k)
    if not check.use_kernels(device):
        return fallback.gptq_gemm_sorted(x2, checkpoint_rows(prepared), _real_zeros(prepared), prepared.scales,
                                         prepared.groups, prepared.perm, prepared.bits).view(y.shape)
    entry = registry.dispatch(PREPARED_OP, prepared.scheme, device)
    _check_layout(entry, prepared)
    perm = prepared.perm
    m = x2.shape[0]
    dequant = _dequant_kernel(entry, m, n, device)
    if dequant is not None:
        # Prefill: the GEMM is compute-bound, and cuBLAS's fp16/bf16 GEMM on the weights dequantized into a scratch
        # w (the caching allocator's: capturable in a CUDA graph) beats the W4A16 kernels; the dequant reads
        # K * N / 2 bytes and writes K * N * 2. No launch plan: only this path's signatures reach here (M >= min_m).
        if perm is None:
            w = torch.empty((n, k), dtype=x2.dtype, device=device)
            dequant.launch(prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                           prepared.contiguous_groups, None, w, dequant.tile_for(None))
            torch.mm(x2, w.t(), out=y.view(-1, n))
        else:  # act-order: w's rows go back to the checkpoint's K order as they are written, so x is not gathered
            w = torch.empty((k, n), dtype=x2.dtype, device=device)
            dequant.launch(prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                           prepared.contiguous_groups, perm, w, dequant.tile_for(None))
            torch.mm(x2, w, out=y.view(-1, n))
        return y
    # act_order=False: act-order's x is gathered once by the chosen module's gather kernel (gather_columns), then
    # the tile of plain g_idx runs; the in-kernel perm lookups that act_order facts select are the AOT C ABI's.
    call = registry.Call(m=m, n=n, k=k, device_type=device.type, dtype=check.dtype_name(x2.dtype),
                         act_order=False, contiguous_groups=prepared.contiguous_groups,
                         align=check.alignment(x2, prepared.scales))
    tile = entry.tile_for(m, n, call)  # the plan key holds everything the call's facts are made of
    kernel_module = entry.modules[tile["impl"]]
    # Act-order: x's columns gathered into a buffer of the call's own, which the plan allocates like an output.
    gathered = None if perm is None else torch.empty((m, k), dtype=x2.dtype, device=device)
    with _plan.Recorder(kernel_module.load() if plan is None else None) as rec:
        if gathered is not None:
            kernel_module.run(gather_columns, x2, perm, gathered, tile.get("gather_pdl") is True)
        kernel_module.launch(x2 if gathered is None else gathered, None, prepared.qweight, prepared.zeros,
                             prepared.scales, prepared.groups, prepared.contiguous_groups, y.view(-1, n), tile,
                             dependent=tile.get("plain_pdl" if gathered is None else "pdl") is True
                             and dependent_launches(device))
    _plan.store(key, rec, (x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups),
                (y,) if gathered is None else (y, gathered))
    return y


# --- torch.ops.kdsl.* (kdsl.ops.spec). W4A16Prepared crosses the boundary as its tensors and plain fields
# (prepared_args); the implementations rebuild it (_prepared). layout_weights "" means the layout has no "weights".

def _w4a16_gemm_op(x, *fields):
    return _w4a16_gemm_impl(x, _prepared(*fields))


def _w4a16_dequant_op(*fields):
    return _w4a16_dequant_impl(_prepared(*fields))


def _prepared(qweight, zeros, scales, groups, perm, scheme, source, bits, group_size, layout_zeros,
              layout_weights, k, n, contiguous_groups, zero_bias):
    """The W4A16Prepared the implementations take, from the op's arguments."""
    if layout_zeros == "paired" and not _paired(scales, zeros):
        # The "paired" kernels read each (scale, zero) through scales' pointer: the two must be the views of one
        # [G, N, 2] tensor that prepare() made. An op's result may depend only on its inputs' values, not on how
        # they alias (torch.compile or opcheck may pass copies), so copies are paired again here.
        pairs = torch.stack((scales, zeros), dim=-1)
        scales, zeros = pairs[..., 0], pairs[..., 1]
    return prepared_from_args(qweight, zeros, scales, groups, perm, scheme, source, bits, group_size,
                              layout_zeros, layout_weights, k, n, contiguous_groups, zero_bias)


def _paired(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    return (scales.dim() == 2 and scales.stride(1) == 2 and zeros.stride() == scales.stride()
            and zeros.data_ptr() == scales.data_ptr() + scales.element_size())


def _w4a16_gemm_fake(x, *fields):
    return _w4a16_gemm_outputs(x, prepared_from_args(*fields))


def _w4a16_dequant_fake(*fields):
    return _w4a16_dequant_outputs(prepared_from_args(*fields))


def _w4a16_gemm_example(tile, dtype, device):
    """Act-order (perm given, groups in order), then the plain call for an implementation that refuses act-order.
    K: 64 past a whole number of 4096-row chunks (the K-unrolled Gluon GEMV's masks past K), or longer for the
    tile's split."""
    m, n = tile["BLOCK_M"], tile["BLOCK_N"]
    k = max(4096, tile["BLOCK_K"] * split_steps(tile)) + 64
    x, y = empty(device, m, k, dtype=dtype), empty(device, m, n, dtype=dtype)
    weights, groups = int4_weights(device, k=k, n=n, out=dtype), empty(device, k, dtype=torch.int32)
    for perm in (empty(device, k, dtype=torch.int32), None):
        yield x, perm, *weights, groups, True, y


def _w4a16_dequant_example(tile, dtype, device):
    """w [N, K]: fp16 with its groups in order (one group per tile where the group size allows), bf16 with
    act-order's groups out of order (the per-row group lookup), so the two dtypes reach both group paths."""
    yield (*int4_weights(device, k=4096, n=4096, out=dtype), empty(device, 4096, dtype=torch.int32),
           dtype == torch.float16, None, empty(device, 4096, 4096, dtype=dtype))


# ---- the C ABI of `kdsl aot` (kdsl.kernels.c_abi): what the exported C function takes and checks, which calls the
# export compiles for (representative problems: M over every tile bucket, the layers' N and K), and each kernel
# unit's C_LAUNCH says how it is launched from there.

W4A16_MS = (1, 4, 16, 64, 128, 256, 1024)
# w4a16_gemm's (perm, contiguous_groups): no act-order; sorted act-order groups (contiguous); a v1 checkpoint's
# uneven act-order groups (not).
W4A16_ORDERS = ((0, 1), (1, 1), (1, 0))


def w4a16_problems(nks, ms=W4A16_MS, orders=W4A16_ORDERS, dtypes=("f16", "bf16")):
    """nks: the (N, K) of the weights; orders: (perm, contiguous_groups) pairs, W4A16_ORDERS."""
    for m in ms:
        for n, k in nks:
            for perm, contiguous in orders:
                for dtype in dtypes:
                    yield dict(M=m, N=n, K=k, ldx=k, ldqw=n, ldz=n, lds=n, ldy=n, perm=perm,
                               contiguous_groups=contiguous, x_dtype=dtype)


def _w4a16_problems():
    # M per tile bucket of both variants; N and K of the bench shapes; act-order and groups as checkpoints
    # give them (sorted act-order groups stay contiguous; a v1 checkpoint's uneven groups do not).
    return w4a16_problems(((4096, 4096), (14336, 4096), (4096, 14336)))


W4A16_GEMM_ABI = OpAbi(
    op="w4a16_gemm",
    function="kdsl_gptq_gemm",
    summary="y = x @ w on int4 weights prepared by kdsl.ops.gptq_prepare / awq_prepare (W4A16), fp32 accumulation.",
    args=(
        CArg("x", "ptr", "x [M, K] of x_dtype, row stride ldx, unit stride along K (the activations)"),
        CArg("ldx", "i64", "row stride of x in elements (>= K)"),
        CArg("perm", "ptr", "W4A16Prepared.perm: int32 [K], the column of x each prepared row reads (act-order), "
                            "or NULL (perm is None); its values must lie in [0, K) (not checked)"),
        CArg("qweight", "ptr", "W4A16Prepared.qweight, int32: [K / 8, N] with row stride ldqw (layout weights = "
                               "checkpoint, the sm_80 kernels), or [ceil(N/128), ceil(K/128), 128, 16] contiguous "
                               "(layout k_planes, sm_90; ldqw is then not read)"),
        CArg("ldqw", "i64", "row stride of qweight in int32 elements (>= N) for the checkpoint layout; for k_planes "
                            "pass N (not read)"),
        CArg("zeros", "ptr", "W4A16Prepared.zeros [G, N] of x_dtype (biased zeros), row stride ldz, column stride "
                             "1 (layout zeros = biased) or 2 (paired: scales + 1 element, one [G, N, 2] tensor)"),
        CArg("ldz", "i64", "row stride of zeros in elements (>= N; 2 N for a contiguous paired tensor)"),
        CArg("scales", "ptr", "W4A16Prepared.scales [G, N] of x_dtype, row stride lds, column stride as zeros'"),
        CArg("lds", "i64", "row stride of scales in elements (>= N)"),
        CArg("groups", "ptr", "W4A16Prepared.groups: int32 [K], the group of each prepared row (values in [0, G), "
                              "not checked)"),
        CArg("contiguous_groups", "i64", "W4A16Prepared.contiguous_groups: 1 if prepared row k is in group "
                                         "k / group_size, else 0"),
        CArg("y", "ptr", "y [M, N] of x_dtype, row stride ldy, unit stride along N (output)", const=False),
        CArg("ldy", "i64", "row stride of y in elements (>= N)"),
        CArg("x_dtype", "dtype", "KDSL_F16 or KDSL_BF16: x's, y's, scales' and zeros' dtype (W4A16Prepared.dtype)"),
        CArg("M", "i64", "rows of x and y, >= 0"),
        CArg("N", "i64", "output features, a multiple of 8"),
        CArg("K", "i64", "input features, a multiple of 8, > 0"),
    ),
    dtype_choices={"x_dtype": ("f16", "bf16")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "w4a16_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        Check("N % 8 != 0 || K % 8 != 0", "w4a16_gemm: N = %lld and K = %lld must be multiples of 8", ("N", "K")),
        Check("contiguous_groups != 0 && contiguous_groups != 1",
              "w4a16_gemm: contiguous_groups = %lld must be 0 or 1", ("contiguous_groups",)),
        Check("ldx < K", "w4a16_gemm: ldx = %lld must be >= K = %lld", ("ldx", "K")),
        Check("ldy < N || ldz < N || lds < N || ldqw < N",
              "w4a16_gemm: ldy = %lld, ldz = %lld, lds = %lld and ldqw = %lld must be >= N = %lld",
              ("ldy", "ldz", "lds", "ldqw", "N")),
        fits_in_32_bits("w4a16_gemm", ("M", "N", "K", "ldx", "ldy", "ldz", "lds", "ldqw")),
        not_null("w4a16_gemm", ("M", "N"), ("x", "qweight", "zeros", "scales", "groups", "y"), optional="perm"),
    ),
    nothing_to_do="M == 0 || N == 0",
    m="M",
    n="N",
    problems=_w4a16_problems,
    bench_problems={"gptq_gemm": lambda case: {"w4a16_gemm": w4a16_problems([(case.n, case.k)], ms=(case.m,))}},
    call_flags={"perm": (0, 1), "contiguous_groups": (0, 1)},
)


SPECS = (
    OpSpec("w4a16_gemm", "(Tensor x, Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm, "
                         "str scheme, str source, int bits, int group_size, str layout_zeros, str layout_weights, "
                         "int k, int n, bool contiguous_groups, int zero_bias) -> Tensor",
           _w4a16_gemm_op, _w4a16_gemm_fake, example=_w4a16_gemm_example, c_abi=W4A16_GEMM_ABI),
    # The same fields without x: the prepared weights as w [N, K].
    OpSpec("w4a16_dequant", "(Tensor qweight, Tensor zeros, Tensor scales, Tensor groups, Tensor? perm, str scheme, "
                            "str source, int bits, int group_size, str layout_zeros, str layout_weights, int k, "
                            "int n, bool contiguous_groups, int zero_bias) -> Tensor",
           _w4a16_dequant_op, _w4a16_dequant_fake, example=_w4a16_dequant_example),
)
