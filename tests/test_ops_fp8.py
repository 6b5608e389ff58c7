"""Block-FP8 ops against the independent fp32 references in tests/reference.py.

CPU tensors with TRITON_INTERPRET=1 (set by conftest) run the generated kernels through
Triton's interpreter; the `launched` fixture records which kernel actually ran. With the
interpreter off, the same calls take kdsl's torch fallback and must give the same answers.
Shapes are small and ragged on purpose: N and K not multiples of the 128 block, M not a
multiple of any BLOCK_M, leading batch dims.
"""
from __future__ import annotations

import re

import pytest
import torch
from conftest import interpreting
from reference import (
    FP8,
    act_quant_ref,
    fp8_gemm_ref,
    random_fp8,
    random_scales,
    rel_fro_error,
    weight_dequant_ref,
    weight_quant_ref,
)

import kdsl
from kdsl.kernels.block_fp8 import fp8_gemm_deferred_gluon
from kdsl import registry

FP8_SCHEME = kdsl.BlockFP8()
TMA = "fp8_gemm__e4m3_w128x128_a128_f32__tma_persistent_sm90"
PORTABLE = "fp8_gemm__e4m3_w128x128_a128_f32__portable_sm89"
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BF16_ULP = 2.0 ** -8  # bf16 has 8 significant bits: one ulp is 2^-8 to 2^-7 of the value


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.dtype == FP8 and expected.dtype == FP8
    assert actual.shape == expected.shape
    # Compare bit patterns: +0 and -0 are different codes, but both dequantize to 0; compare values.
    a, e = actual.float(), expected.float()
    bad = a != e
    if bad.any():
        where = bad.nonzero()[:5].tolist()
        details = ", ".join(f"{tuple(i)}: got {a[tuple(i)].item()} want {e[tuple(i)].item()}" for i in where)
        pytest.fail(f"{int(bad.sum())} of {a.numel()} fp8 values differ ({details})")


def expect_kernel(launched: list[str], name_part: str):
    """Under the interpreter the generated kernel must have run; otherwise the fallback did."""
    if interpreting():
        assert launched and all(name_part in name for name in launched), launched
    else:
        assert launched == []


def use_arch(monkeypatch, arch: str):
    monkeypatch.setenv("KDSL_ARCH", arch)
    registry.reset()


def random_activations(shape, dtype) -> torch.Tensor:
    """Random activations with a few outliers, in the input dtype."""
    x = torch.randn(*shape) * 3.0
    if x.numel():
        x.view(-1)[:: 97] *= 40.0
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# act_quant

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
# Row counts of each tile (1, 2, 4 and 8 rows a program) and with rows left over in the last program.
@pytest.mark.parametrize("shape", [(1, 128), (2, 256), (3, 128), (4, 256), (3, 5, 256), (17, 384), (384,)])
def test_act_quant_matches_reference(shape, dtype, launched):
    x = random_activations(shape, dtype)
    q, s = kdsl.ops.act_quant(x)
    q_ref, s_ref = act_quant_ref(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], shape[-1] // 128)
    assert s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    expect_kernel(launched, "act_quant__")


def test_act_quant_many_rows(launched):
    # More rows than one program's BLOCK_M, not a multiple of it.
    x = random_activations((50, 256), torch.bfloat16)
    q, s = kdsl.ops.act_quant(x)
    q_ref, s_ref = act_quant_ref(x)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    expect_kernel(launched, "act_quant__")


def _e4m3_edge_values() -> torch.Tensor:
    """Every positive finite e4m3 value, the midpoints between neighbours and one fp32 ulp either side."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN in e4m3fn
    grid = codes.view(FP8).float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    return torch.cat([grid, mids, up, down])


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_act_quant_rounds_like_a_correct_e4m3_cast(sign, launched):
    """Round to nearest, ties to even, over the whole e4m3 range (subnormals included).

    Each row holds 448 (so the scale is exactly 1 and x / s = x) and 127 test values.
    Triton's interpreter rounds some fp32 -> fp8 casts wrongly, so this also checks that
    kdsl's pre-rounding keeps interpreter and GPU results identical to a correct cast.
    """
    values = sign * _e4m3_edge_values()
    per_row = 127
    rows = -(-values.numel() // per_row)
    padded = torch.cat([values, torch.full((rows * per_row - values.numel(),), sign * 1.0)])
    x = torch.cat([torch.full((rows, 1), 448.0), padded.view(rows, per_row)], dim=1)
    q, s = kdsl.ops.act_quant(x)
    assert torch.equal(s, torch.ones(rows, 1))
    assert_fp8_equal(q, x.to(FP8))
    expect_kernel(launched, "act_quant__")


def test_act_quant_all_zero_group(launched):
    x = random_activations((5, 384), torch.bfloat16)
    x[:, 128:256] = 0  # the middle group of every row
    x[2] = 0  # and one whole token
    q, s = kdsl.ops.act_quant(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not torch.isnan(q.float()).any()
    assert (q[:, 128:256].float() == 0).all() and (q[2].float() == 0).all()
    q_ref, s_ref = act_quant_ref(x)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)


@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 128), (4, 0)])
def test_act_quant_empty(shape, launched):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q, s = kdsl.ops.act_quant(x)
    assert q.shape == shape and q.dtype == FP8
    assert s.shape == (*shape[:-1], shape[-1] // 128) and s.dtype == torch.float32
    assert launched == []


def test_act_quant_non_contiguous(launched):
    big = random_activations((9, 640), torch.bfloat16)
    # A column slice (row stride 640, unit stride along K).
    x = big[:, 128:512]
    q, s = kdsl.ops.act_quant(x)
    q_ref, s_ref = act_quant_ref(x)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    # A transposed layout (unit stride along M, not K).
    xt = random_activations((256, 7), torch.float16).T
    q, s = kdsl.ops.act_quant(xt)
    q_ref, s_ref = act_quant_ref(xt)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    # Every other token of a batch.
    xs = random_activations((4, 6, 256), torch.float32)[:, ::2]
    q, s = kdsl.ops.act_quant(xs)
    q_ref, s_ref = act_quant_ref(xs)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)


# ---------------------------------------------------------------------------------------------
# weight_quant / weight_dequant

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n, k", [(200, 384), (72, 128), (130, 260)])
def test_weight_quant_matches_reference(n, k, dtype, launched):
    w = random_activations((n, k), dtype) * 0.05
    q, s = kdsl.ops.weight_quant(w)
    q_ref, s_ref = weight_quant_ref(w)
    assert s.shape == (-(-n // 128), -(-k // 128))
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    expect_kernel(launched, "weight_quant__")


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_weight_quant_rounds_like_a_correct_e4m3_cast(sign, launched):
    values = sign * _e4m3_edge_values()
    w = torch.full((128, 128), sign * 1.0)
    w.view(-1)[: values.numel()] = values
    w[-1, -1] = 448.0  # block scale exactly 1
    q, s = kdsl.ops.weight_quant(w)
    assert torch.equal(s, torch.ones(1, 1))
    assert_fp8_equal(q, w.to(FP8))


def test_weight_quant_all_zero_block(launched):
    w = random_activations((200, 260), torch.bfloat16)
    w[:128, 128:256] = 0
    w[128:, 256:] = 0  # a zero edge block
    q, s = kdsl.ops.weight_quant(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not torch.isnan(q.float()).any()
    assert (q[:128, 128:256].float() == 0).all() and (q[128:, 256:].float() == 0).all()
    q_ref, s_ref = weight_quant_ref(w)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)


def test_weight_quant_empty(launched):
    q, s = kdsl.ops.weight_quant(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    assert launched == []


def test_weight_quant_non_contiguous(launched):
    big = random_activations((150, 640), torch.float32)
    w = big[10:140, 100:484]  # a window: row stride 640, offset start
    q, s = kdsl.ops.weight_quant(w)
    q_ref, s_ref = weight_quant_ref(w)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)
    wt = random_activations((256, 144), torch.bfloat16).T  # [144, 256], column-major
    q, s = kdsl.ops.weight_quant(wt)
    q_ref, s_ref = weight_quant_ref(wt)
    assert torch.equal(s, s_ref)
    assert_fp8_equal(q, q_ref)


def _check_dequant(w, q, s, out_dtype):
    expected = weight_dequant_ref(q, s)
    assert w.dtype == out_dtype and w.shape == q.shape
    if out_dtype == torch.bfloat16 and interpreting():
        # Triton's interpreter truncates fp32 -> bf16 instead of rounding: accept the correctly
        # rounded value or the truncated one (within one bf16 ulp, nothing else).
        rounded = expected.to(torch.bfloat16)
        truncated = (expected.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        ok = (w == rounded) | (w == truncated)
        assert ok.all(), f"{int((~ok).sum())} of {w.numel()} bf16 values are neither rounded nor truncated"
        torch.testing.assert_close(w.float(), expected, rtol=2 * BF16_ULP, atol=0)
    else:
        assert torch.equal(w, expected.to(out_dtype))


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n, k", [(200, 384), (72, 128), (130, 260)])
def test_weight_dequant_matches_reference(n, k, out_dtype, launched):
    q = random_fp8(n, k)
    s = random_scales(-(-n // 128), -(-k // 128))
    w = kdsl.ops.weight_dequant(q, s, out_dtype=out_dtype)
    _check_dequant(w, q, s, out_dtype)
    expect_kernel(launched, "weight_dequant__")


def test_weight_dequant_default_is_bf16(launched):
    q = random_fp8(72, 128)
    s = random_scales(1, 1)
    w = kdsl.ops.weight_dequant(q, s)
    _check_dequant(w, q, s, torch.bfloat16)


def test_weight_quant_dequant_round_trip(launched):
    w = random_activations((130, 260), torch.float32)
    q, s = kdsl.ops.weight_quant(w)
    back = kdsl.ops.weight_dequant(q, s, out_dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error per element at most 2^-4 (normals).
    assert rel_fro_error(back, w) < 0.04


def test_weight_dequant_non_contiguous(launched):
    big = random_fp8(200, 512)
    q = big[:, 128:388]  # [200, 260], row stride 512
    s = random_scales(3, 2).T  # [2, 3], column-major
    w = kdsl.ops.weight_dequant(q, s, out_dtype=torch.float32)
    _check_dequant(w, q, s, torch.float32)


def test_weight_dequant_empty(launched):
    w = kdsl.ops.weight_dequant(torch.empty(0, 128, dtype=FP8), torch.empty(0, 1))
    assert w.shape == (0, 128) and w.dtype == torch.bfloat16
    assert launched == []


# ---------------------------------------------------------------------------------------------
# fp8_gemm

def _gemm_operands(m_shape, n, k):
    a = random_fp8(*m_shape, k)
    a_s = random_scales(*m_shape, k // 128)
    b = random_fp8(n, k)
    b_s = random_scales(-(-n // 128), k // 128)
    return a, a_s, b, b_s


def _check_gemm(c, a, a_s, b, b_s, out_dtype=torch.bfloat16):
    expected = fp8_gemm_ref(a, a_s, b, b_s)
    assert c.dtype == out_dtype
    assert c.shape == (*a.shape[:-1], b.shape[0])
    assert torch.isfinite(c.float()).all()
    limit = 1e-2 if out_dtype == torch.bfloat16 else (2e-3 if out_dtype == torch.float16 else 1e-5)
    err = rel_fro_error(c, expected)
    assert err < limit, f"relative Frobenius error {err:.3g} over {limit}"


GEMM_KERNELS = {"sm_89": PORTABLE, "sm_90": TMA}


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
@pytest.mark.parametrize("k", [128, 384])
@pytest.mark.parametrize("n", [16, 72, 208])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
def test_fp8_gemm_matches_reference(m, n, k, arch, monkeypatch, launched):
    use_arch(monkeypatch, arch)
    assert registry.dispatch("fp8_gemm", FP8_SCHEME.name, torch.device("cpu")).name == GEMM_KERNELS[arch]
    torch.manual_seed(1000 * m + 10 * n + k)
    a, a_s, b, b_s = _gemm_operands((m,), n, k)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    _check_gemm(c, a, a_s, b, b_s)
    if m == 0:
        assert launched == []
    else:
        expect_kernel(launched, GEMM_KERNELS[arch])


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
def test_fp8_gemm_every_tile_bucket(arch, monkeypatch, launched):
    """One M per bucket of the chosen kernel, the largest it serves (the prefill bucket: above the last bound)."""
    use_arch(monkeypatch, arch)
    entry = registry.dispatch("fp8_gemm", FP8_SCHEME.name, torch.device("cpu"))
    bounds = [bucket.m_max for bucket in entry.tiles if bucket.m_max is not None]
    ms = sorted({*bounds, (bounds[-1] if bounds else 0) + 3})
    for m in ms:
        a, a_s, b, b_s = _gemm_operands((m,), 144, 256)
        _check_gemm(kdsl.ops.fp8_gemm(a, a_s, b, b_s), a, a_s, b, b_s)
    expect_kernel(launched, entry.name)


def test_fp8_gemm_edge_tiles_fill_the_spare_round(monkeypatch):
    """fp8_gemm/deferred_gluon's plan for edge_tiles (the Gluon kernel that runs it is GPU-tested): N's
    partial last column, in tiles as wide as it, goes to the programs with one whole tile fewer, where they
    can take it without a round more; otherwise the column stays in whole tiles."""
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    tile = next(bucket.params for bucket in entry.tiles if bucket.params.get("edge_tiles"))
    assert tile["persistent"] and tile["impl"] == "deferred_gluon" and (tile["BLOCK_M"], tile["BLOCK_N"]) == (128, 128)
    plan = fp8_gemm_deferred_gluon.edge_tiles
    # DeepSeek-V3's N = 2112 on 132 SMs: 512 whole tiles leave programs 116..131 a round to spare, and the
    # 32 half-width edge tiles go two to each of them.
    assert plan(4096, 2112, tile, 132) == (64, 116, 132)
    assert plan(2048, 2112, tile, 132) == (64, 124, 132)  # 256 whole tiles: 8 spare programs, 16 edge tiles
    # Fewer whole tiles than SMs: the edge gets programs of its own, two edge tiles each.
    assert plan(1024, 2112, tile, 132) == (64, 128, 132)
    assert plan(512, 2112, tile, 132) == (64, 64, 66)
    assert plan(512, 2088, tile, 132) == (64, 64, 66)  # a 40-column edge takes a 64-wide tile
    assert plan(512, 2064, tile, 132) == (16, 64, 65)  # 16 columns: eight to a program
    assert plan(512, 2052, tile, 132) == (16, 64, 65)  # 4 columns: still 16 wide
    # An edge wider than half a tile takes a whole one's time: it fits only where a program each is spare.
    assert plan(512, 2144, tile, 132) == (128, 64, 68)
    assert plan(4096, 2144, tile, 132) == (0, 0, 132)  # 16 spare programs for 32 edge tiles: one more round
    assert plan(4096, 7168, tile, 132) == (0, 0, 132)  # no partial column
    assert plan(4096, 2176, tile, 132) == (0, 0, 132)  # 544 whole tiles fill whole rounds: nothing spare
    assert plan(4096, 64, tile, 132) == (0, 0, 32)  # nothing but the edge
    assert plan(4096, 2112, dict(tile, edge_tiles=False), 132) == (0, 0, 132)


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
def test_fp8_gemm_batched(arch, monkeypatch, launched):
    use_arch(monkeypatch, arch)
    a, a_s, b, b_s = _gemm_operands((2, 3), 80, 256)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    assert c.shape == (2, 3, 80)
    _check_gemm(c, a, a_s, b, b_s)
    expect_kernel(launched, GEMM_KERNELS[arch])


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_fp8_gemm_out_dtype(out_dtype, arch, monkeypatch, launched):
    use_arch(monkeypatch, arch)
    a, a_s, b, b_s = _gemm_operands((9,), 208, 256)
    # Keep the products inside fp16's range.
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s, out_dtype=out_dtype)
    _check_gemm(c, a, a_s, b, b_s, out_dtype)
    expect_kernel(launched, GEMM_KERNELS[arch])


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
def test_fp8_gemm_one_dimensional_a(arch, monkeypatch, launched):
    use_arch(monkeypatch, arch)
    a, a_s, b, b_s = _gemm_operands((), 48, 256)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    assert c.shape == (48,)
    _check_gemm(c, a, a_s, b, b_s)


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
def test_fp8_gemm_non_contiguous(arch, monkeypatch, launched):
    use_arch(monkeypatch, arch)
    m, n, k = 7, 80, 256
    a_big = random_fp8(m, k + 128)
    a = a_big[:, 128:]  # column slice: row stride k + 128
    a_s = random_scales(k // 128, m).T  # [m, k/128], column-major (like torch._scaled_mm wants)
    b = random_fp8(k, n).T  # [n, k], column-major
    b_s = random_scales(2, -(-n // 128) + 1)[:, :-1].T  # [1, 2] view of a transposed slice
    assert not (a.is_contiguous() or a_s.is_contiguous() or b.is_contiguous())
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    _check_gemm(c, a, a_s, b, b_s)
    # And a batch where every other token is taken.
    a3 = random_fp8(2, 6, k)[:, ::2]
    a3_s = random_scales(2, 6, k // 128)[:, ::2]
    c3 = kdsl.ops.fp8_gemm(a3, a3_s, b, b_s)
    _check_gemm(c3, a3, a3_s, b, b_s)
    expect_kernel(launched, GEMM_KERNELS[arch])


@pytest.mark.parametrize("arch", sorted(GEMM_KERNELS))
def test_fp8_gemm_misaligned_operands(arch, monkeypatch, launched):
    """Contiguous views whose data does not start on a 16-byte boundary (e.g. carved out of a pool).

    Either the right answer or a ValueError naming the argument; never an internal error.
    """
    use_arch(monkeypatch, arch)
    m, n, k = 5, 80, 256
    a = random_fp8(m * k + 16)[1:1 + m * k].view(m, k)
    b = random_fp8(n * k + 16)[3:3 + n * k].view(n, k)
    assert a.is_contiguous() and a.data_ptr() % 16 and b.is_contiguous() and b.data_ptr() % 16
    a_s = random_scales(m, k // 128)
    b_s = random_scales(1, k // 128)
    try:
        c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    except ValueError as error:
        assert names_argument(str(error), "a") or names_argument(str(error), "b"), str(error)
    else:
        _check_gemm(c, a, a_s, b, b_s)


def test_fp8_gemm_of_quantized_operands(launched):
    """End to end: quantize x and w with kdsl, GEMM, compare with the unquantized product."""
    x = torch.randn(11, 384, dtype=torch.bfloat16)
    w = torch.randn(208, 384, dtype=torch.bfloat16) * 0.02
    q, s = kdsl.ops.act_quant(x)
    wq, ws = kdsl.ops.weight_quant(w)
    c = kdsl.ops.fp8_gemm(q, s, wq, ws)
    _check_gemm(c, q, s, wq, ws)
    # fp8 on both sides: a few percent from the exact bf16 product.
    assert rel_fro_error(c, x.float() @ w.float().T) < 0.08


def test_fp8_gemm_zero_k(launched):
    """K = 0 is a multiple of 128: either an all-zero [M, N] result or a ValueError naming a."""
    a = torch.empty(3, 0, dtype=FP8)
    b = torch.empty(16, 0, dtype=FP8)
    try:
        c = kdsl.ops.fp8_gemm(a, torch.empty(3, 0), b, torch.empty(1, 0))
    except ValueError as error:
        assert names_argument(str(error), "a"), str(error)
    else:
        assert c.shape == (3, 16) and (c.float() == 0).all()


# ---------------------------------------------------------------------------------------------
# Argument checks: a ValueError or TypeError naming the argument, before any launch


def names_argument(message: str, name: str) -> bool:
    """The message starts with the argument's name, or quotes it."""
    return bool(re.match(rf"{re.escape(name)}(\[\d+\])?\s*[:=(]", message)) or \
        f"'{name}'" in message or f"`{name}`" in message


def _raises_naming(name: str, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert names_argument(message, name), f"error does not name {name!r}: {message}"
    return message


def _good_gemm_args():
    return _gemm_operands((4,), 80, 256)


def test_fp8_gemm_wrong_dtypes(launched):
    a, a_s, b, b_s = _good_gemm_args()
    message = _raises_naming("a", kdsl.ops.fp8_gemm, a.float(), a_s, b, b_s)
    assert "float8_e4m3fn" in message and "float32" in message  # expected and actual
    _raises_naming("a_s", kdsl.ops.fp8_gemm, a, a_s.bfloat16(), b, b_s)
    _raises_naming("b", kdsl.ops.fp8_gemm, a, a_s, b.to(torch.float8_e5m2), b_s)
    _raises_naming("b_s", kdsl.ops.fp8_gemm, a, a_s, b, b_s.double())
    _raises_naming("out_dtype", kdsl.ops.fp8_gemm, a, a_s, b, b_s, out_dtype=torch.int32)
    assert launched == []


def test_fp8_gemm_non_tensor(launched):
    a, a_s, b, b_s = _good_gemm_args()
    _raises_naming("a", kdsl.ops.fp8_gemm, a.tolist(), a_s, b, b_s)
    _raises_naming("b_s", kdsl.ops.fp8_gemm, a, a_s, b, 1.0)
    assert launched == []


def test_fp8_gemm_bad_shapes(launched):
    a, a_s, b, b_s = _good_gemm_args()
    # K not a multiple of 128.
    message = _raises_naming("a", kdsl.ops.fp8_gemm, a[:, :200], a_s, b[:, :200], b_s)
    assert "128" in message and "200" in message
    # N not a multiple of the kernels' granularity.
    _raises_naming("b", kdsl.ops.fp8_gemm, a, a_s, b[:77], b_s)
    _raises_naming("b", kdsl.ops.fp8_gemm, a, a_s, random_fp8(100, 256), b_s)
    # Mismatched K between a and b.
    _raises_naming("b", kdsl.ops.fp8_gemm, a, a_s, random_fp8(80, 384), random_scales(1, 3))
    # a_s: wrong number of groups, wrong number of tokens.
    message = _raises_naming("a_s", kdsl.ops.fp8_gemm, a, a_s[:, :1], b, b_s)
    assert "(4, 2)" in message and "(4, 1)" in message  # expected and actual
    _raises_naming("a_s", kdsl.ops.fp8_gemm, a, a_s[:3], b, b_s)
    # b_s: too many row blocks, too few K blocks, and the transposed layout.
    _raises_naming("b_s", kdsl.ops.fp8_gemm, a, a_s, b, random_scales(2, 2))
    _raises_naming("b_s", kdsl.ops.fp8_gemm, a, a_s, b, b_s[:, :1])
    _raises_naming("b_s", kdsl.ops.fp8_gemm, a, a_s, random_fp8(256, 256), random_scales(2, 2)[:, :1].T)
    # b must be 2-D.
    _raises_naming("b", kdsl.ops.fp8_gemm, a, a_s, b.unsqueeze(0), b_s)
    assert launched == []


def test_act_quant_bad_inputs(launched):
    x = random_activations((4, 256), torch.bfloat16)
    _raises_naming("x", kdsl.ops.act_quant, x.to(torch.int32))
    _raises_naming("x", kdsl.ops.act_quant, x.to(FP8))
    _raises_naming("x", kdsl.ops.act_quant, x.double())
    _raises_naming("x", kdsl.ops.act_quant, x.tolist())
    message = _raises_naming("x", kdsl.ops.act_quant, x[:, :200])
    assert "200" in message
    _raises_naming("x", kdsl.ops.act_quant, torch.tensor(1.0))
    _raises_naming("group_size", kdsl.ops.act_quant, x, group_size=96)
    assert launched == []


def test_weight_quant_bad_inputs(launched):
    w = random_activations((72, 256), torch.bfloat16)
    _raises_naming("w", kdsl.ops.weight_quant, w.to(torch.int32))
    _raises_naming("w", kdsl.ops.weight_quant, w.to(FP8))
    _raises_naming("w", kdsl.ops.weight_quant, w.unsqueeze(0))
    _raises_naming("w", kdsl.ops.weight_quant, "w")
    _raises_naming("block_size", kdsl.ops.weight_quant, w, block_size=(128, 100))
    _raises_naming("block_size", kdsl.ops.weight_quant, w, block_size=128)
    assert launched == []


def test_weight_dequant_bad_inputs(launched):
    q = random_fp8(200, 260)
    s = random_scales(2, 3)
    _raises_naming("q", kdsl.ops.weight_dequant, q.float(), s)
    _raises_naming("s", kdsl.ops.weight_dequant, q, s.bfloat16())
    message = _raises_naming("s", kdsl.ops.weight_dequant, q, s[:, :2])
    assert "(2, 3)" in message and "(2, 2)" in message
    _raises_naming("s", kdsl.ops.weight_dequant, q, s.T)
    _raises_naming("q", kdsl.ops.weight_dequant, q.unsqueeze(0), s)
    _raises_naming("out_dtype", kdsl.ops.weight_dequant, q, s, out_dtype=torch.int8)
    assert launched == []


def test_no_kernel_for_other_block_sizes_is_a_lookup_error():
    """Argument checks pass, but no kernel was generated for 64x64 blocks: refused on every path (the torch
    fallback too), as a NoKernelError that is also a ValueError."""
    w = random_activations((72, 256), torch.bfloat16)
    with pytest.raises(kdsl.NoKernelError, match="weight_quant: block_size") as info:
        kdsl.ops.weight_quant(w, block_size=(64, 64))
    assert isinstance(info.value, ValueError)


@pytest.mark.skip(reason="mismatched devices need a second device; the CPU suite has only one")
def test_mismatched_devices():
    pass


# ---------------------------------------------------------------------------------------------
# Without the interpreter: CPU tensors take kdsl's torch fallback, same answers.

class TestTorchFallback:
    @pytest.fixture(autouse=True)
    def _no_interpreter(self, monkeypatch):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def test_act_quant(self, launched):
        for dtype in FLOAT_DTYPES:
            x = random_activations((3, 5, 256), dtype)
            x[0, 0, :128] = 0
            q, s = kdsl.ops.act_quant(x)
            q_ref, s_ref = act_quant_ref(x)
            assert torch.equal(s, s_ref)
            assert_fp8_equal(q, q_ref)
        assert launched == []

    def test_act_quant_rounding(self, launched):
        for sign in (1.0, -1.0):
            values = sign * _e4m3_edge_values()
            x = torch.full((values.numel(), 128), sign * 1.0)
            x[:, 0] = values
            x[:, 1] = 448.0
            q, s = kdsl.ops.act_quant(x)
            assert_fp8_equal(q, x.to(FP8))
        assert launched == []

    def test_weight_quant_and_dequant(self, launched):
        w = random_activations((130, 260), torch.bfloat16)
        q, s = kdsl.ops.weight_quant(w)
        q_ref, s_ref = weight_quant_ref(w)
        assert torch.equal(s, s_ref)
        assert_fp8_equal(q, q_ref)
        for out_dtype in FLOAT_DTYPES:
            deq = kdsl.ops.weight_dequant(q, s, out_dtype=out_dtype)
            assert torch.equal(deq, weight_dequant_ref(q, s).to(out_dtype))
        assert launched == []

    @pytest.mark.parametrize("m_shape", [(0,), (1,), (33,), (2, 3)])
    def test_fp8_gemm(self, m_shape, launched):
        for n in (16, 208):
            a, a_s, b, b_s = _gemm_operands(m_shape, n, 384)
            _check_gemm(kdsl.ops.fp8_gemm(a, a_s, b, b_s), a, a_s, b, b_s)
            _check_gemm(kdsl.ops.fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32), a, a_s, b, b_s, torch.float32)
        assert launched == []

    def test_checks_still_apply(self):
        a, a_s, b, b_s = _good_gemm_args()
        _raises_naming("a_s", kdsl.ops.fp8_gemm, a, a_s[:, :1], b, b_s)
        _raises_naming("x", kdsl.ops.act_quant, torch.ones(2, 100))
