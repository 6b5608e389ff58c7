"""GPTQ INT4 tensor ops on checkpoint tensors (layout: kdsl.ops.gptq_checkpoint) or prepared weights."""
from __future__ import annotations

import torch

from kdsl.naming import gptq_scheme_name
from kdsl.kernels.c_abi import CArg, Check, OpAbi, fits_in_32_bits, not_null
from kdsl.ops import _checks as check
from kdsl.ops import fallback
from kdsl.ops._examples import empty, split_steps
from kdsl.ops.gptq_checkpoint import (
    ACTIVATIONS,
    ZERO_OFFSET,
    checkpoint_shapes,
    default_g_idx,
    pack_rows,
    scheme_args,
    unpack_rows,
    unpack_zeros,
)
from kdsl.ops.w4a16 import W4A16Prepared, prepare, w4a16_gemm
from kdsl.ops.spec import OpSpec
from kdsl.runtime import registry


def gptq_gemm(
    x: torch.Tensor, qweight: torch.Tensor | W4A16Prepared, qzeros: torch.Tensor | None = None,
    scales: torch.Tensor | None = None, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantized weight [K, N], in x's dtype (fp16 or bf16).

    Either checkpoint tensors, `gptq_gemm(x, qweight, qzeros, scales, g_idx)`, or weights from
    `kdsl.ops.gptq_prepare`, `gptq_gemm(x, prepared)` (the fast path; the scheme comes with them).
    g_idx None means row k is in group k // group_size; any permuted g_idx (act-order) works.
    Symmetric checkpoints still carry qzeros, and they are used.
    """
    if isinstance(qweight, W4A16Prepared):
        for name, value in (("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            if value is not None:
                raise ValueError(f"{name}: prepared weights carry their own; call gptq_gemm(x, prepared)")
        return w4a16_gemm(x, qweight)
    if qzeros is None or scales is None:
        missing = "qzeros" if qzeros is None else "scales"
        raise TypeError(f"{missing}: required with checkpoint tensors (or pass weights from kdsl.ops.gptq_prepare)")
    if torch.compiler.is_compiling():  # one opaque op for Dynamo; see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.gptq_gemm(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)
    return _gptq_gemm_impl(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)


def _gptq_gemm_outputs(x, qweight, qzeros, scales, g_idx, bits: int, group_size: int, checkpoint_format: str,
                       values: bool = True) -> tuple[str, torch.Tensor]:
    """gptq_gemm's checks and empty output. values=False (the fake kernel under torch.compile, which has no
    data): g_idx's dtype and shape are checked but not the range of its values, which the op checks when it runs."""
    scheme = _served_scheme("gptq_gemm", bits, group_size, checkpoint_format)
    check.tensor("x", x, ACTIVATIONS, min_ndim=1)
    k = x.shape[-1]
    n = checkpoint_shapes(qweight, qzeros, scales, g_idx, k, bits, group_size, values)[1]
    device = check.same_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    return scheme, torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=device)


def _gptq_gemm_impl(x, qweight, qzeros, scales, g_idx, bits: int, group_size: int,
                    checkpoint_format: str) -> torch.Tensor:
    scheme, y = _gptq_gemm_outputs(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)
    device = y.device
    k = x.shape[-1]
    n = y.shape[-1]
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    x2 = check.rows(x, k)
    if not check.use_kernels(device):
        groups = g_idx if g_idx is not None else default_g_idx(k, group_size, device)
        return fallback.gptq_gemm(x2, qweight, qzeros, scales, groups, bits, ZERO_OFFSET[checkpoint_format]).view(y.shape)
    entry = registry.dispatch("gptq_gemm", scheme, device)
    entry.launch(x2, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                 None if g_idx is None else g_idx.contiguous(), y.view(-1, n), entry.tile_for(x2.shape[0], n))
    return y


def gptq_dequant(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """w [N, K] in scales' dtype (nn.Linear's layout): x @ w.T matches gptq_gemm up to rounding."""
    if torch.compiler.is_compiling():  # see kdsl.ops.block_fp8.act_quant
        return torch.ops.kdsl.gptq_dequant(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)
    return _gptq_dequant_impl(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)


def _gptq_dequant_outputs(qweight, qzeros, scales, g_idx, bits: int, group_size: int, checkpoint_format: str,
                          values: bool = True) -> tuple[str, torch.Tensor]:
    """gptq_dequant's checks and empty output; values as in _gptq_gemm_outputs."""
    scheme = _served_scheme("gptq_dequant", bits, group_size, checkpoint_format)
    k, n, _ = checkpoint_shapes(qweight, qzeros, scales, g_idx, None, bits, group_size, values)
    device = check.same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    return scheme, torch.empty((n, k), dtype=scales.dtype, device=device)


def _gptq_dequant_impl(qweight, qzeros, scales, g_idx, bits: int, group_size: int,
                       checkpoint_format: str) -> torch.Tensor:
    scheme, w = _gptq_dequant_outputs(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format)
    device = w.device
    n, k = w.shape
    if w.numel() == 0:
        return w
    if not check.use_kernels(device):
        groups = g_idx if g_idx is not None else default_g_idx(k, group_size, device)
        # contiguous [N, K] as the kernel writes it (and the fake kernel says), not the transposed [K, N]
        return fallback.gptq_dequant(qweight, qzeros, scales, groups, bits, ZERO_OFFSET[checkpoint_format],
                                     scales.dtype).contiguous()
    entry = registry.dispatch("gptq_dequant", scheme, device)
    entry.launch(qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                 None if g_idx is None else g_idx.contiguous(), w, entry.tile_for(n))
    return w


def gptq_prepare(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None, *,
    bits: int = 4, group_size: int = 128, checkpoint_format: str = "gptq",
) -> W4A16Prepared:
    """Prepare a GPTQ checkpoint's tensors once for kdsl.ops.w4a16_gemm (or gptq_gemm(x, prepared));
    activations must then come in scales' dtype. Act-order (a permuted g_idx) is resolved here, once."""
    scheme_args(bits, group_size, checkpoint_format)
    k, n, _ = checkpoint_shapes(qweight, qzeros, scales, g_idx, None, bits, group_size)
    check.same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    return prepare(unpack_rows(qweight.contiguous(), bits), unpack_zeros(qzeros, bits, ZERO_OFFSET[checkpoint_format]),
                   scales, g_idx, bits=bits, group_size=group_size, source=checkpoint_format)


def gptq_quantize(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, sym: bool = True) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of w [N, K] into the "gptq" checkpoint layout.

    For tests, demos and users without a calibrated GPTQ run: it is not GPTQ's
    error-compensating algorithm, only its storage format. Per group and column the range
    is min/max (asymmetric) or absmax (symmetric, zero at the midpoint). Zeros are kept in
    1..15 so that the stored zero - 1 fits in four bits (real zero 0 would wrap to -1).
    Returns {"qweight", "qzeros", "scales" (w's dtype if fp16/bf16, else fp16), "g_idx"}.
    """
    scheme_args(bits, group_size, "gptq")
    check.tensor("w", w, (torch.float16, torch.bfloat16, torch.float32), ndim=2)
    n, k = w.shape
    pack, max_q = 32 // bits, 2**bits - 1
    if k % pack or n % pack:
        raise ValueError(f"w: N = {n} and K = {k} must both be multiples of {pack}")
    if group_size != -1 and k % group_size:
        raise ValueError(f"w: K = {k} is not a multiple of group_size = {group_size}")
    size = k if group_size == -1 else group_size
    wt = w.float().T.reshape(k // size, size, n)  # [G, rows of the group, N]
    if sym:
        amax = wt.abs().amax(dim=1)
        scale = 2 * amax / max_q
        zero = torch.full_like(scale, (max_q + 1) // 2)
    else:
        low, high = wt.amin(dim=1).clamp(max=0), wt.amax(dim=1).clamp(min=0)
        scale = (high - low) / max_q
        zero = torch.round(-low / torch.where(scale == 0, 1.0, scale)).clamp(1, max_q)
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero group: any scale reproduces zeros
    scale_dtype = w.dtype if w.dtype in ACTIVATIONS else torch.float16
    scale = scale.to(scale_dtype)
    q = torch.clamp(torch.round(wt / scale.float()[:, None]) + zero[:, None], 0, max_q).to(torch.int64)
    return {
        "qweight": pack_rows(q.reshape(k, n), bits),
        "qzeros": pack_rows((zero.to(torch.int64) - 1).T.contiguous(), bits).T.contiguous(),
        "scales": scale,
        "g_idx": default_g_idx(k, group_size, w.device),
    }


def _served_scheme(op: str, bits: int, group_size: int, checkpoint_format: str) -> str:
    """The scheme these arguments select, refused (on the fallback path too) unless a kernel serves it."""
    scheme_args(bits, group_size, checkpoint_format)
    scheme = gptq_scheme_name(bits, group_size, checkpoint_format)
    registry.require_scheme(op, scheme, f"bits = {bits}, group_size = {group_size}, "
                                        f"checkpoint_format = {checkpoint_format!r}")
    return scheme


# --- torch.ops.kdsl.* (kdsl.ops.spec). The fake kernels leave out the range check of g_idx's values (it reads
# data); reading them is also why both ops wait on the GPU (host_syncing).

def _gptq_gemm_fake(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format):
    return _gptq_gemm_outputs(x, qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format,
                              values=False)[1]


def _gptq_dequant_fake(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format):
    return _gptq_dequant_outputs(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format,
                                 values=False)[1]


def _gptq_gemm_example(tile, dtype, device):
    """With g_idx (act-order); K long enough for the tile's split."""
    m, n = tile["BLOCK_M"], tile["BLOCK_N"]
    k = tile["BLOCK_K"] * split_steps(tile)
    yield (empty(device, m, k, dtype=dtype), empty(device, k // 8, n, dtype=torch.int32),
           empty(device, k // 32, n // 8, dtype=torch.int32), empty(device, k // 32, n, dtype=dtype),
           empty(device, k, dtype=torch.int32), empty(device, m, n, dtype=dtype))


def _gptq_dequant_example(tile, dtype, device):
    """Without g_idx: gptq_gemm's dequantize + cuBLAS path takes plain checkpoints only."""
    yield (empty(device, 512, 4096, dtype=torch.int32), empty(device, 128, 512, dtype=torch.int32),
           empty(device, 128, 4096, dtype=dtype), None, empty(device, 4096, 4096, dtype=dtype))


# ---- the C ABI of `kdsl aot` (kdsl.kernels.c_abi): what the exported C function takes and checks, which calls the
# export compiles for (representative problems: M over every tile bucket, the layers' N and K), and each kernel
# unit's C_LAUNCH says how it is launched from there.

def gptq_dequant_problems(nks, dtypes=("f16", "bf16"), g_idx=(0, 4096)):
    """nks: the (N, K) of the weights; g_idx: 0 (none) and/or an address (act-order)."""
    for n, k in nks:
        for dtype in dtypes:
            for address in g_idx:
                yield dict(N=n, K=k, ldqw=n, ldqz=n // 8, lds=n, scales_dtype=dtype, g_idx=address)


def _gptq_dequant_problems():
    return gptq_dequant_problems([(n, k) for n in (4096, 11008, 24) for k in (4096, 11008)])


GPTQ_DEQUANT_ABI = OpAbi(
    op="gptq_dequant",
    function="kdsl_gptq_dequant",
    summary="A GPTQ checkpoint's int4 weight dequantized to w [N, K] (nn.Linear's layout) in the scales' dtype.",
    args=(
        CArg("qweight", "ptr", "qweight int32 [K / 8, N] (8 rows packed per int32), row stride ldqw, unit stride along N"),
        CArg("ldqw", "i64", "row stride of qweight in int32 elements (>= N)"),
        CArg("qzeros", "ptr", "qzeros int32 [G, N / 8], row stride ldqz, unit stride along N"),
        CArg("ldqz", "i64", "row stride of qzeros in int32 elements (>= N / 8)"),
        CArg("scales", "ptr", "scales [G, N] of scales_dtype, row stride lds, unit stride along N"),
        CArg("lds", "i64", "row stride of scales in elements (>= N)"),
        CArg("scales_dtype", "dtype", "KDSL_F16 or KDSL_BF16 (also w's dtype)"),
        CArg("g_idx", "ptr", "g_idx int32 [K], the group of each input row (act-order), or NULL for row k in "
                             "group k / group_size; its values must lie in [0, G) (not checked)"),
        CArg("w", "ptr", "w [N, K] of scales_dtype, contiguous (output)", const=False),
        CArg("N", "i64", "output features, a multiple of 8"),
        CArg("K", "i64", "input features, a multiple of 8 and of the group size"),
    ),
    dtype_choices={"scales_dtype": ("f16", "bf16")},
    checks=(
        Check("N < 0 || K < 0", "gptq_dequant: N = %lld and K = %lld must be >= 0", ("N", "K")),
        Check("N % 8 != 0 || K % 8 != 0", "gptq_dequant: N = %lld and K = %lld must be multiples of 8", ("N", "K")),
        Check("{group_size} > 0 && K % {group_size} != 0", "gptq_dequant: K = %lld must be a multiple of the group size "
              "{group_size}", ("K",)),
        Check("ldqw < N || ldqz < N / 8 || lds < N",
              "gptq_dequant: ldqw = %lld and lds = %lld must be >= N = %lld, ldqz = %lld >= N / 8",
              ("ldqw", "lds", "N", "ldqz")),
        fits_in_32_bits("gptq_dequant", ("N", "K", "ldqw", "ldqz", "lds")),
        not_null("gptq_dequant", ("N", "K"), ("qweight", "qzeros", "scales", "w"), optional="g_idx"),
    ),
    nothing_to_do="N == 0 || K == 0",
    m="N",
    n=None,
    problems=_gptq_dequant_problems,
    bench_problems={"gptq_dequant": lambda case: {"gptq_dequant": gptq_dequant_problems([(case.n, case.k)])}},
    in_forward=False,
)


SPECS = (
    OpSpec("gptq_gemm", "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits, "
                        "int group_size, str checkpoint_format) -> Tensor",
           _gptq_gemm_impl, _gptq_gemm_fake, host_syncing=True, example=_gptq_gemm_example),
    OpSpec("gptq_dequant", "(Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, int bits, int group_size, "
                           "str checkpoint_format) -> Tensor",
           _gptq_dequant_impl, _gptq_dequant_fake, host_syncing=True, example=_gptq_dequant_example,
           c_abi=GPTQ_DEQUANT_ABI),
)
