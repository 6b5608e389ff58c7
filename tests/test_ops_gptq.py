"""GPTQ INT4 ops through the generated kernels (Triton's interpreter on CPU tensors) against
tests/reference_gptq.py, an independent reference, on checkpoints built by hand from integers.

Shapes stay small (K in {64, 256}, N in {16, 40, 80}, M in {1, 5, 33}) so the interpreter is quick;
M = 1 and 5 take the split-K decode tile, M = 33 the split-K 64-row tile.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import kdsl
import reference_gptq as ref

TOL = 1e-2
FORMATS = ("gptq", "gptq_v2")
GROUPS = (32, 64, 128, -1)
# (M, K, N): every M, K and N at least once; K = 64 only with groups that divide it.
SHAPES = [(1, 256, 16), (5, 256, 40), (33, 256, 80), (1, 64, 80), (5, 64, 16), (33, 64, 40)]
GEMM_CASES = [(g, *shape) for g in GROUPS for shape in SHAPES if g == -1 or shape[1] % g == 0]
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}



def _dtype_pairs(pairs):
    return [pytest.param(a, b, id=f"{DTYPE_NAMES[a]}-{DTYPE_NAMES[b]}") for a, b in pairs]


def _gemm(x, ck, *, group_size, fmt, g_idx="ckpt"):
    groups = ck["g_idx"] if g_idx == "ckpt" else g_idx
    return kdsl.ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], groups,
                              group_size=group_size, checkpoint_format=fmt)


def _ref(x, ck, *, group_size, fmt):
    return ref.gemm_ref(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                        group_size=group_size, checkpoint_format=fmt)


def _check_gemm(x, ck, *, group_size, fmt):
    y = _gemm(x, ck, group_size=group_size, fmt=fmt)
    expected = _ref(x, ck, group_size=group_size, fmt=fmt)
    assert y.dtype == x.dtype
    assert y.shape == (*x.shape[:-1], ck["scales"].shape[1])
    assert torch.isfinite(y).all()
    err = ref.rel_fro_error(y, expected)
    assert err < TOL, f"rel err {err:.3g}"
    return y


# ---------------------------------------------------------------------------------------------
# the reference itself (packer / unpacker), and kdsl's quantizer read back by it


def test_reference_pack_round_trip():
    q = torch.randint(0, 16, (64, 40))
    z = torch.randint(0, 16, (3, 40))
    assert torch.equal(ref.unpack_qweight(ref.pack_qweight(q)), q)
    assert torch.equal(ref.unpack_qzeros(ref.pack_qzeros(z)), z)


def test_reference_bit_layout():
    # Column 0: q[k] = k for k = 0..7 -> nibble k holds k -> 0x76543210.
    # Column 1: q[7] = 15 only -> 0xF0000000, negative as int32.
    q = torch.zeros(8, 2, dtype=torch.int64)
    q[:, 0] = torch.arange(8)
    q[7, 1] = 15
    words = ref.pack_qweight(q)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() == 0x76543210
    assert words[0, 1].item() == 0xF0000000 - (1 << 32)
    # qzeros pack along N the same way.
    z = torch.arange(8).view(1, 8)
    assert ref.pack_qzeros(z).item() == 0x76543210
    assert torch.equal(ref.unpack_qzeros(torch.tensor([[-1]], dtype=torch.int32)), torch.full((1, 8), 15))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_reference_unpacks_kdsl_quantize(sym, group_size):
    n, k = 40, 256
    w = torch.randn(n, k)
    ck = kdsl.ops.gptq_quantize(w, group_size=group_size, sym=sym)
    q = ref.unpack_qweight(ck["qweight"])
    stored = ref.unpack_qzeros(ck["qzeros"])
    assert q.shape == (k, n) and q.min() >= 0 and q.max() <= 15
    assert stored.shape == (ref.num_groups(k, group_size), n)
    # "gptq" layout: stored zero = real zero - 1, real zeros kept in 1..15.
    assert stored.min() >= 0 and stored.max() <= 14
    if sym:
        assert (stored == 7).all()
    deq = ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                          group_size=group_size, checkpoint_format="gptq")
    step = ck["scales"].float()[ck["g_idx"].long()]  # [K, N]
    # Round to nearest: within half a step, plus the fp16 rounding of the scale itself.
    assert ((deq - w.T).abs() <= 0.51 * step + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("g_idx", ["default", "none", "perm", "random"])
@pytest.mark.parametrize("group_size", [32, -1])
def test_dequant_reproduces_hand_made_integers(fmt, g_idx, group_size):
    """Unit scales: kdsl's dequant must give back exactly q - zero, the integers the checkpoint was built from."""
    k, n = 256, 40
    ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)
    ck["scales"] = torch.ones_like(ck["scales"])
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                              group_size=group_size, checkpoint_format=fmt)
    assert w.shape == (n, k) and w.dtype == torch.float16
    assert torch.equal(w.T.to(torch.int64), ref.integer_weight(ck))
    assert torch.equal(w.T.float(), ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                                                    group_size=group_size, checkpoint_format=fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("group_size, g_idx", [(32, "default"), (64, "perm"), (128, "random"), (-1, "none")])
def test_dequant_matches_reference(fmt, scale_dtype, group_size, g_idx):
    """(q - z) * s is exact in fp32; cast to scales' dtype it must equal the reference cast the same way."""
    k, n = 256, 80
    ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx,
                             scale_dtype=scale_dtype)
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                              group_size=group_size, checkpoint_format=fmt)
    assert w.shape == (n, k) and w.dtype == scale_dtype
    expected = ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                               group_size=group_size, checkpoint_format=fmt)
    if scale_dtype == torch.float16:
        assert torch.equal(w, expected.to(scale_dtype).T)
    else:
        # bf16: one rounding, but Triton 3.9's interpreter casts fp32 -> bf16 by truncation
        # (bf16 is raw uint16 there), so allow one bf16 ulp. The GPU test checks exact equality.
        assert ((w.T.float() - expected).abs() <= expected.abs() * 2.0**-7).all()


def test_dequant_exact_with_power_of_two_scales():
    k, n = 64, 16
    ck = ref.make_checkpoint(k, n, group_size=32, checkpoint_format="gptq_v2")
    ck["scales"] = torch.exp2(torch.randint(-8, 2, ck["scales"].shape).float()).half()
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                              group_size=32, checkpoint_format="gptq_v2")
    expected = ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                               group_size=32, checkpoint_format="gptq_v2")
    assert torch.equal(w.T.float(), expected)


def test_formats_differ_by_one_zero_step():
    """The same words read as "gptq" and as "gptq_v2" differ by exactly one scale step."""
    k, n = 64, 16
    ck = ref.make_checkpoint(k, n, group_size=32, checkpoint_format="gptq")
    ck["scales"] = torch.ones_like(ck["scales"])
    args = (ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    v1 = kdsl.ops.gptq_dequant(*args, group_size=32, checkpoint_format="gptq")
    v2 = kdsl.ops.gptq_dequant(*args, group_size=32, checkpoint_format="gptq_v2")
    assert torch.equal(v2 - v1, torch.ones_like(v1))


# ---------------------------------------------------------------------------------------------
# gptq_gemm against the reference


@pytest.mark.parametrize("group_size, m, k, n", GEMM_CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_matches_reference(fmt, group_size, m, k, n):
    ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt)
    _check_gemm(torch.randn(m, k).half(), ck, group_size=group_size, fmt=fmt)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_sym_and_asym_checkpoints(fmt, sym, m):
    ck = ref.make_checkpoint(256, 40, group_size=64, checkpoint_format=fmt, sym=sym)
    _check_gemm(torch.randn(m, 256).half(), ck, group_size=64, fmt=fmt)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("g_idx", ["perm", "random"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_act_order(fmt, group_size, g_idx, m):
    ck = ref.make_checkpoint(256, 80, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)
    assert not torch.equal(ck["g_idx"], ref.default_g_idx(256, group_size))
    _check_gemm(torch.randn(m, 256).half(), ck, group_size=group_size, fmt=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_act_order_g_idx_is_used(fmt):
    ck = ref.make_checkpoint(256, 40, group_size=32, checkpoint_format=fmt, g_idx="perm")
    x = torch.randn(5, 256).half()
    with_perm = _gemm(x, ck, group_size=32, fmt=fmt)
    without = _gemm(x, ck, group_size=32, fmt=fmt, g_idx=None)
    assert ref.rel_fro_error(with_perm, _ref(x, ck, group_size=32, fmt=fmt)) < TOL
    assert ref.rel_fro_error(without, _ref(x, ck, group_size=32, fmt=fmt)) > 0.05


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("x_dtype, scale_dtype", _dtype_pairs([
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
]))
def test_gemm_dtypes(x_dtype, scale_dtype, m):
    for fmt in FORMATS:
        ck = ref.make_checkpoint(256, 40, group_size=128, checkpoint_format=fmt, scale_dtype=scale_dtype)
        _check_gemm(torch.randn(m, 256).to(x_dtype), ck, group_size=128, fmt=fmt)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gemm_leading_batch_dims(x_dtype):
    ck = ref.make_checkpoint(256, 40, group_size=64, checkpoint_format="gptq", g_idx="perm", scale_dtype=x_dtype)
    x = torch.randn(2, 3, 256).to(x_dtype)
    y = _check_gemm(x, ck, group_size=64, fmt="gptq")
    assert y.shape == (2, 3, 40)
    flat = _gemm(x.reshape(6, 256), ck, group_size=64, fmt="gptq")
    assert torch.equal(y.reshape(6, 40), flat)


def test_gemm_non_contiguous_x():
    ck = ref.make_checkpoint(64, 16, group_size=32, checkpoint_format="gptq")
    x = torch.randn(64, 5).half().T  # stride (1, 5): not unit stride along K
    assert not x.is_contiguous()
    y = _check_gemm(x, ck, group_size=32, fmt="gptq")
    assert torch.equal(y, _gemm(x.contiguous(), ck, group_size=32, fmt="gptq"))


def test_gemm_strided_x_rows():
    ck = ref.make_checkpoint(64, 16, group_size=32, checkpoint_format="gptq_v2", g_idx="perm")
    x = torch.randn(5, 100).half()[:, 20:84]  # unit stride along K, row stride 100
    assert x.stride() == (100, 1)
    _check_gemm(x, ck, group_size=32, fmt="gptq_v2")


def test_gemm_column_slice_of_a_checkpoint():
    """Slicing N out of a wider checkpoint (qweight/scales columns, qzeros words) gives non-contiguous tensors."""
    wide = ref.make_checkpoint(256, 80, group_size=64, checkpoint_format="gptq", g_idx="random")
    ck = {"qweight": wide["qweight"][:, 16:56], "qzeros": wide["qzeros"][:, 2:7],
          "scales": wide["scales"][:, 16:56], "g_idx": wide["g_idx"]}
    assert not ck["qweight"].is_contiguous()
    x = torch.randn(5, 256).half()
    y = _check_gemm(x, ck, group_size=64, fmt="gptq")
    full = _gemm(x, wide, group_size=64, fmt="gptq")
    assert ref.rel_fro_error(y, full[:, 16:56]) < TOL


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_gemm_empty_m(shape):
    ck = ref.make_checkpoint(64, 16, group_size=32)
    x = torch.randn(shape).half()
    y = _gemm(x, ck, group_size=32, fmt="gptq")
    assert y.shape == (*shape[:-1], 16) and y.dtype == torch.float16


def test_gemm_empty_k():
    x = torch.randn(3, 0).half()
    qweight = torch.zeros(0, 16, dtype=torch.int32)
    qzeros = torch.zeros(0, 2, dtype=torch.int32)
    scales = torch.zeros(0, 16, dtype=torch.float16)
    y = kdsl.ops.gptq_gemm(x, qweight, qzeros, scales, group_size=32)
    assert y.shape == (3, 16) and (y == 0).all()


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_gemm_explicit_default_g_idx_same_as_none(group_size, m):
    ck = ref.make_checkpoint(256, 40, group_size=group_size, g_idx="none")
    x = torch.randn(m, 256).half()
    implicit = _gemm(x, ck, group_size=group_size, fmt="gptq")
    explicit = _gemm(x, ck, group_size=group_size, fmt="gptq", g_idx=ref.default_g_idx(256, group_size))
    assert torch.equal(implicit, explicit)
    assert ref.rel_fro_error(implicit, _ref(x, ck, group_size=group_size, fmt="gptq")) < TOL


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("fmt, g_idx", [("gptq", "default"), ("gptq_v2", "perm")])
def test_dequant_then_matmul_matches_gemm(fmt, g_idx, m):
    ck = ref.make_checkpoint(256, 80, group_size=64, checkpoint_format=fmt, g_idx=g_idx)
    args = (ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    w = kdsl.ops.gptq_dequant(*args, group_size=64, checkpoint_format=fmt)
    assert w.shape == (80, 256) and w.dtype == torch.float16
    x = torch.randn(m, 256).half()
    y = kdsl.ops.gptq_gemm(x, *args, group_size=64, checkpoint_format=fmt)
    assert ref.rel_fro_error(y, x.float() @ w.float().T) < TOL
    assert ref.rel_fro_error(x @ w.T, y) < TOL


# ---------------------------------------------------------------------------------------------
# gptq_quantize


@pytest.mark.parametrize("dtype, scale_dtype", _dtype_pairs([
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
]))
@pytest.mark.parametrize("group_size", [32, -1])
def test_quantize_outputs(dtype, scale_dtype, group_size):
    n, k = 40, 256
    out = kdsl.ops.gptq_quantize(torch.randn(n, k).to(dtype), group_size=group_size)
    assert set(out) == {"qweight", "qzeros", "scales", "g_idx"}
    groups = ref.num_groups(k, group_size)
    assert out["qweight"].dtype == torch.int32 and out["qweight"].shape == (k // 8, n)
    assert out["qzeros"].dtype == torch.int32 and out["qzeros"].shape == (groups, n // 8)
    assert out["scales"].dtype == scale_dtype and out["scales"].shape == (groups, n)
    assert out["g_idx"].dtype == torch.int32 and out["g_idx"].shape == (k,)
    assert torch.equal(out["g_idx"], ref.default_g_idx(k, group_size))
    assert (out["scales"].float() > 0).all()


@pytest.mark.parametrize("sym", [True, False])
def test_quantize_all_zero_group(sym):
    n, k = 16, 128
    w = torch.randn(n, k)
    w[:, 32:64] = 0  # group 1 of every column
    w[3] = 0  # and a whole output column
    out = kdsl.ops.gptq_quantize(w, group_size=32, sym=sym)
    assert torch.isfinite(out["scales"].float()).all() and (out["scales"].float() > 0).all()
    deq = kdsl.ops.gptq_dequant(out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=32)
    assert not deq.isnan().any()
    assert (deq[:, 32:64] == 0).all() and (deq[3] == 0).all()
    expected = ref.dequant_ref(out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=32)
    assert torch.equal(deq, expected.half().T)


def test_quantize_all_zero_weight():
    for sym in (True, False):
        out = kdsl.ops.gptq_quantize(torch.zeros(8, 64), group_size=32, sym=sym)
        deq = ref.dequant_ref(out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=32)
        assert (deq == 0).all()


def test_quantize_sym_vs_asym():
    # One-sided weights: asymmetric quantization spends its 16 levels on the range actually used.
    w = torch.rand(40, 256) + 1.0
    sym = kdsl.ops.gptq_quantize(w, group_size=64, sym=True)
    asym = kdsl.ops.gptq_quantize(w, group_size=64, sym=False)
    assert (ref.unpack_qzeros(sym["qzeros"]) == 7).all()  # zero 8, stored minus one
    stored = ref.unpack_qzeros(asym["qzeros"])
    assert stored.min() >= 0 and stored.max() <= 14
    err = {}
    for name, out in (("sym", sym), ("asym", asym)):
        deq = kdsl.ops.gptq_dequant(out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=64)
        err[name] = ref.rel_fro_error(deq, w)
    assert err["asym"] < err["sym"] < 0.1


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_then_gemm(group_size):
    w = torch.randn(80, 256)
    out = kdsl.ops.gptq_quantize(w, group_size=group_size, sym=False)
    x = torch.randn(5, 256).half()
    y = kdsl.ops.gptq_gemm(x, out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=group_size)
    expected = ref.gemm_ref(x, out["qweight"], out["qzeros"], out["scales"], out["g_idx"], group_size=group_size)
    assert ref.rel_fro_error(y, expected) < TOL
    assert ref.rel_fro_error(y, x.float() @ w.T) < 0.15  # 4-bit quantization error of the weights


def test_quantize_docstring():
    doc = inspect.getdoc(kdsl.ops.gptq_quantize).lower()
    assert "round-to-nearest" in doc
    assert "test" in doc and "demo" in doc


def test_quantize_bad_inputs():
    with pytest.raises(ValueError, match="bits"):
        kdsl.ops.gptq_quantize(torch.randn(16, 64), bits=8)
    with pytest.raises(ValueError, match="group_size"):
        kdsl.ops.gptq_quantize(torch.randn(16, 64), group_size=100)
    with pytest.raises(ValueError, match="group_size"):
        kdsl.ops.gptq_quantize(torch.randn(16, 96), group_size=64)
    with pytest.raises(ValueError, match="^w:"):
        kdsl.ops.gptq_quantize(torch.randn(12, 64), group_size=32)
    with pytest.raises(TypeError, match="^w:"):
        kdsl.ops.gptq_quantize(torch.randn(16, 64).double(), group_size=32)
    with pytest.raises(ValueError, match="^w:"):
        kdsl.ops.gptq_quantize(torch.randn(2, 16, 64), group_size=32)


# ---------------------------------------------------------------------------------------------
# argument checks


@pytest.fixture
def good():
    ck = ref.make_checkpoint(128, 16, group_size=32)
    return {"x": torch.randn(3, 128).half(), "qweight": ck["qweight"], "qzeros": ck["qzeros"],
            "scales": ck["scales"], "g_idx": ck["g_idx"]}


def _call(good, **changes):
    args = {**good, **{k: v for k, v in changes.items() if k in good}}
    kw = {k: v for k, v in changes.items() if k not in good}
    kw.setdefault("group_size", 32)
    return kdsl.ops.gptq_gemm(args["x"], args["qweight"], args["qzeros"], args["scales"], args["g_idx"], **kw)


def test_good_arguments_work(good):
    assert _call(good).shape == (3, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=str)
def test_x_dtype(good, dtype):
    with pytest.raises(TypeError, match="^x:.*float16"):
        _call(good, x=good["x"].to(dtype))


def test_x_k_mismatch_names_qweight(good):
    with pytest.raises(ValueError, match="^qweight:.*rows"):
        _call(good, x=torch.randn(3, 256).half())


def test_qweight_rows(good):
    with pytest.raises(ValueError, match="^qweight:"):
        _call(good, qweight=good["qweight"][:8])


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float16], ids=str)
def test_qweight_dtype(good, dtype):
    with pytest.raises(TypeError, match="^qweight:.*int32"):
        _call(good, qweight=good["qweight"].to(dtype))


def test_qweight_ndim(good):
    with pytest.raises(ValueError, match="^qweight:"):
        _call(good, qweight=good["qweight"].reshape(-1))


def test_qweight_n_not_multiple_of_8(good):
    with pytest.raises(ValueError, match="^qweight:.*multiple of 8"):
        _call(good, qweight=torch.zeros(16, 12, dtype=torch.int32))


def test_scales_groups(good):
    with pytest.raises(ValueError, match="^scales:"):
        _call(good, scales=good["scales"][:2])


def test_scales_n_mismatch(good):
    with pytest.raises(ValueError, match="^scales:"):
        _call(good, scales=torch.ones(4, 24, dtype=torch.float16))


def test_scales_dtype(good):
    with pytest.raises(TypeError, match="^scales:"):
        _call(good, scales=good["scales"].float())


@pytest.mark.parametrize("shape", [(4, 3), (3, 2), (4, 16)])
def test_qzeros_shape(good, shape):
    with pytest.raises(ValueError, match="^qzeros:"):
        _call(good, qzeros=torch.zeros(shape, dtype=torch.int32))


def test_qzeros_dtype(good):
    with pytest.raises(TypeError, match="^qzeros:"):
        _call(good, qzeros=good["qzeros"].to(torch.int64))


def test_k_not_multiple_of_group_size(good):
    ck = ref.make_checkpoint(96, 16, group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        kdsl.ops.gptq_gemm(torch.randn(2, 96).half(), ck["qweight"], ck["qzeros"][:1], ck["scales"][:1],
                           group_size=64)


@pytest.mark.parametrize("group_size", [100, 8, 0, -2, 64.0, True])
def test_bad_group_size(good, group_size):
    with pytest.raises(ValueError, match="group_size"):
        _call(good, group_size=group_size)


@pytest.mark.parametrize("bits", [8, 3, 2])
def test_bad_bits(good, bits):
    with pytest.raises(ValueError, match="bits"):
        _call(good, bits=bits)


@pytest.mark.parametrize("fmt", ["awq", "GPTQ", "marlin"])
def test_bad_checkpoint_format(good, fmt):
    with pytest.raises(ValueError, match="checkpoint_format"):
        _call(good, checkpoint_format=fmt)


def test_g_idx_wrong_length(good):
    with pytest.raises(ValueError, match="^g_idx:"):
        _call(good, g_idx=good["g_idx"][:64])


@pytest.mark.parametrize("bad", [4, -1, 1000])
def test_g_idx_out_of_range(good, bad):
    g_idx = good["g_idx"].clone()
    g_idx[17] = bad
    with pytest.raises(ValueError, match="^g_idx:.*0, 4"):
        _call(good, g_idx=g_idx)


def test_g_idx_dtype(good):
    with pytest.raises(TypeError, match="^g_idx:"):
        _call(good, g_idx=good["g_idx"].long())


def test_g_idx_out_of_range_group_all(good):
    ck = ref.make_checkpoint(128, 16, group_size=-1, g_idx="perm")
    assert ck["g_idx"].max() == 0
    with pytest.raises(ValueError, match="^g_idx:"):
        kdsl.ops.gptq_gemm(good["x"], ck["qweight"], ck["qzeros"], ck["scales"], good["g_idx"], group_size=-1)


def test_dequant_argument_checks(good):
    args = (good["qweight"], good["qzeros"], good["scales"], good["g_idx"])
    with pytest.raises(ValueError, match="^scales:"):
        kdsl.ops.gptq_dequant(good["qweight"], good["qzeros"], good["scales"][:2], group_size=32)
    with pytest.raises(ValueError, match="^qzeros:"):
        kdsl.ops.gptq_dequant(good["qweight"], good["qzeros"][:, :1], good["scales"], group_size=32)
    with pytest.raises(ValueError, match="^g_idx:"):
        kdsl.ops.gptq_dequant(*args[:3], good["g_idx"][:10], group_size=32)
    with pytest.raises(TypeError, match="^qweight:"):
        kdsl.ops.gptq_dequant(good["qweight"].long(), *args[1:], group_size=32)
    with pytest.raises(ValueError, match="bits"):
        kdsl.ops.gptq_dequant(*args, bits=8, group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        kdsl.ops.gptq_dequant(*args, group_size=100)
    with pytest.raises(ValueError, match="checkpoint_format"):
        kdsl.ops.gptq_dequant(*args, group_size=32, checkpoint_format="awq")


# ---------------------------------------------------------------------------------------------
# CPU fallback (interpreter off) and which kernel runs


@pytest.mark.parametrize("fmt, group_size, g_idx", [("gptq", 32, "perm"), ("gptq_v2", -1, "none"),
                                                    ("gptq", 128, "random")])
def test_cpu_fallback_matches_reference(monkeypatch, launched, fmt, group_size, g_idx):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ck = ref.make_checkpoint(256, 40, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 5, 256).to(dtype)
        _check_gemm(x, ck, group_size=group_size, fmt=fmt)
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                              group_size=group_size, checkpoint_format=fmt)
    expected = ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                               group_size=group_size, checkpoint_format=fmt)
    assert torch.equal(w, expected.half().T)
    assert launched == []  # plain torch, no generated kernel


def test_interpreter_runs_the_scheme_kernel(launched):
    ck = ref.make_checkpoint(64, 16, group_size=64, checkpoint_format="gptq")
    _gemm(torch.randn(1, 64).half(), ck, group_size=64, fmt="gptq")
    kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], group_size=64)
    assert launched == ["gptq_gemm__int4_g64_gptq__splitk_sm80", "gptq_dequant__int4_g64_gptq__blockwise_sm80"]


def test_registry_picks_scheme_kernel():
    name = kdsl.registry.select("gptq_gemm", kdsl.GPTQ(group_size=32, checkpoint_format="gptq_v2"), arch="sm_89").name
    assert "g32" in name and "gptq_v2" in name
    assert name.startswith("gptq_gemm__")
