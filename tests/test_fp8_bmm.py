"""kdsl.ops.fp8_bmm, the batched block-FP8 GEMM of DeepSeek-V3's MLA, against tests/reference.py.

The reference dequantizes each batch to fp32 and multiplies (fp8_gemm_ref per batch): nothing of kdsl's.
CPU tensors run the generated kernel through Triton's interpreter (conftest sets TRITON_INTERPRET=1);
TestTorchFallback runs the same calls with the interpreter off (kdsl's torch fallback). MLA's caller
passes a as `x.transpose(0, 1)` of [M, heads, K] activations, and may pass out as a transposed view of
a [M, heads, N] buffer: the kernel must get both as they are, with their strides, and no copy.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import interpreting, wrap_launch
from reference import FP8, fp8_gemm_ref, random_fp8, random_scales, rel_fro_error

import kdsl
from kdsl.ops import _checks as check
from kdsl import registry

BMM = "fp8_bmm__e4m3_w128x128_a128_f32__portable_sm89"
TMA = "fp8_bmm__e4m3_w128x128_a128_f32__tma_persistent_sm90"
KERNELS = {"sm_89": BMM, "sm_90": TMA}  # KDSL_ARCH -> the kernel the registry picks (both run in the interpreter)
MLA_SHAPES = [(128, 512), (512, 128)]  # (N, K): q_nope x w_kc (absorb), and the latent back through w_vc
LIMITS = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def bmm_ref(a, a_s, b, b_s) -> torch.Tensor:
    """fp32 [B, M, N]: the independent fp8_gemm reference for each batch."""
    return torch.stack([fp8_gemm_ref(a[g], a_s[g], b[g], b_s[g]) for g in range(a.shape[0])])


def mla_operands(batch, m, n, k, device="cpu"):
    """a and a_s as transpose(0, 1) views of [M, B, ...] tensors (MLA's layout); b, b_s contiguous."""
    x = random_fp8(m, batch, k, device=device)
    x_s = random_scales(m, batch, k // 128, device=device)
    b = random_fp8(batch, n, k, device=device)
    b_s = random_scales(batch, -(-n // 128), k // 128, device=device)
    return x.transpose(0, 1), x_s.transpose(0, 1), b, b_s


def check_bmm(c, a, a_s, b, b_s, out_dtype=torch.bfloat16):
    expected = bmm_ref(a, a_s, b, b_s)
    assert c.dtype == out_dtype
    assert c.shape == (a.shape[0], a.shape[1], b.shape[1])
    assert torch.isfinite(c.float()).all()
    err = rel_fro_error(c, expected)
    assert err < LIMITS[out_dtype], f"relative Frobenius error {err:.3g} over {LIMITS[out_dtype]}"


@pytest.fixture
def launches(monkeypatch):
    """The arguments of every launch of the fp8_bmm kernel: (a, a_s, b, b_s, c) as the module got them."""
    calls = []
    for entry in registry.entries():
        if entry.op != "fp8_bmm":
            continue
        def spy(original, _name=entry.name):
            def launch(*args):
                calls.append((_name, args[:5]))
                return original(*args)
            return launch

        wrap_launch(monkeypatch, entry.modules[entry.impl], spy)
    return calls


def expect_launch(launches, count=1, kernel=BMM):
    if interpreting():
        assert len(launches) == count and all(name == kernel for name, _ in launches), launches
    else:
        assert launches == []


@pytest.fixture(params=sorted(KERNELS))
def arch(request, monkeypatch):
    """Each kernel in turn, selected through KDSL_ARCH: the portable one (sm_89) and the TMA one (sm_90)."""
    monkeypatch.setenv("KDSL_ARCH", request.param)
    registry.reset()
    yield request.param
    monkeypatch.delenv("KDSL_ARCH")
    registry.reset()


# ---------------------------------------------------------------------------------------------
# Results

@pytest.mark.parametrize("n, k", MLA_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [0, 1, 5, 33])
@pytest.mark.parametrize("batch", [1, 3])
def test_fp8_bmm_matches_reference(batch, m, n, k, arch, launches):
    torch.manual_seed(100 * batch + m + n)
    a, a_s, b, b_s = mla_operands(batch, m, n, k)
    assert a.stride() == (k, batch * k, 1)  # a view of [M, B, K]
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
    check_bmm(c, a, a_s, b, b_s)
    assert c.is_contiguous()
    if m == 0:
        assert launches == []
        return
    expect_launch(launches, kernel=KERNELS[arch])
    if interpreting():
        # No copy: the kernel got a's and a_s's storage and strides, and wrote the returned tensor.
        ka, ka_s, kb, kb_s, kc = launches[0][1]
        for given, got in ((a, ka), (a_s, ka_s), (b, kb), (b_s, kb_s), (c, kc)):
            assert got.data_ptr() == given.data_ptr() and got.stride() == given.stride()


@pytest.mark.parametrize("n, k", MLA_SHAPES, ids=lambda v: str(v))
def test_fp8_bmm_writes_a_transposed_out_in_place(n, k, arch, launches):
    batch, m = 3, 5
    a, a_s, b, b_s = mla_operands(batch, m, n, k)
    buffer = torch.full((m, batch, n), 7.0, dtype=torch.bfloat16)
    out = buffer.transpose(0, 1)
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=out)
    assert c is out and c.data_ptr() == buffer.data_ptr()
    check_bmm(buffer.transpose(0, 1), a, a_s, b, b_s)
    assert torch.equal(c, kdsl.ops.fp8_bmm(a, a_s, b, b_s))  # the same kernel with a new output
    if interpreting():
        assert launches[0][1][4].data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_fp8_bmm_out_dtype(out_dtype, arch, launches):
    a, a_s, b, b_s = mla_operands(2, 9, 128, 256)
    check_bmm(kdsl.ops.fp8_bmm(a, a_s, b, b_s, out_dtype=out_dtype), a, a_s, b, b_s, out_dtype)
    out = torch.empty(2, 9, 128, dtype=out_dtype)
    assert kdsl.ops.fp8_bmm(a, a_s, b, b_s, out_dtype=out_dtype, out=out) is out
    check_bmm(out, a, a_s, b, b_s, out_dtype)
    expect_launch(launches, 2, KERNELS[arch])


def test_fp8_bmm_every_tile_bucket(arch, launches):
    """One M per bucket of the kernel (the largest each serves, and past the last bound), N not a
    multiple of either tile's block_n, strided b_s."""
    entry = registry.dispatch("fp8_bmm", kdsl.BlockFP8().name, torch.device("cpu"))
    assert entry.name == KERNELS[arch]
    bounds = [bucket.m_max for bucket in entry.tiles if bucket.m_max is not None]
    for m in sorted({*bounds, bounds[-1] + 3, 70}):
        a, a_s, b, _ = mla_operands(2, m, 208, 256)
        b_s = random_scales(2, 2, 2).transpose(1, 2).contiguous().transpose(1, 2)  # [2, 2, 2], not contiguous
        assert not b_s.is_contiguous()
        check_bmm(kdsl.ops.fp8_bmm(a, a_s, b, b_s), a, a_s, b, b_s)
    expect_launch(launches, len({*bounds, bounds[-1] + 3, 70}), KERNELS[arch])


def test_fp8_bmm_of_quantized_operands():
    """End to end: per-head activations and weights quantized by kdsl, then the batched GEMM."""
    heads, m, n, k = 2, 6, 128, 256
    x = torch.randn(m, heads, k, dtype=torch.bfloat16)
    w = torch.randn(heads, n, k, dtype=torch.bfloat16) * 0.02
    q, s = kdsl.ops.act_quant(x)  # [M, H, K], [M, H, K / 128]
    wq, ws = zip(*(kdsl.ops.weight_quant(w[h]) for h in range(heads)))
    wq, ws = torch.stack(wq), torch.stack(ws)
    c = kdsl.ops.fp8_bmm(q.transpose(0, 1), s.transpose(0, 1), wq, ws)
    check_bmm(c, q.transpose(0, 1), s.transpose(0, 1), wq, ws)
    exact = torch.einsum("mhk,hnk->hmn", x.float(), w.float())
    assert rel_fro_error(c, exact) < 0.08


def test_fp8_bmm_nan_codes_give_nan_rows_and_columns():
    """As fp8_gemm: a NaN code in a makes its output row NaN, one in b its column (the interpreter decodes
    the NaN code as 480; the op marks what read one, as the GPU computes it)."""
    a, a_s, b, b_s = mla_operands(3, 5, 128, 256)
    a, b = a.clone(), b.clone()
    nan = torch.tensor(float("nan")).to(FP8)
    a[1, 2, 200] = nan
    b[2, 7, 3] = nan
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s).float()
    expect = torch.zeros(c.shape, dtype=torch.bool)
    expect[1, 2, :] = True
    expect[2, :, 7] = True
    assert torch.equal(c.isnan(), expect)
    a2, b2 = a.clone(), b.clone()
    a2[1, 2, 200] = 0
    b2[2, 7, 3] = 0
    assert torch.equal(c[~expect], kdsl.ops.fp8_bmm(a2, a_s, b2, b_s).float()[~expect])


def test_fp8_bmm_a_without_unit_k_stride_is_copied(launches):
    """a needs unit stride along K for the kernel: otherwise it is made contiguous (the right answer still)."""
    a, a_s, b, b_s = mla_operands(2, 3, 128, 256)
    a_cols = a.contiguous().transpose(1, 2).contiguous().transpose(1, 2)  # [2, 3, 256], K stride 3
    assert a_cols.stride(2) != 1
    check_bmm(kdsl.ops.fp8_bmm(a_cols, a_s, b, b_s), a, a_s, b, b_s)
    expect_launch(launches)


# ---------------------------------------------------------------------------------------------
# Argument checks: a ValueError or TypeError naming the argument, expected and actual, before any launch

def names_argument(message: str, name: str) -> bool:
    return bool(re.match(rf"{re.escape(name)}\s*[:=(]", message))


def raises_naming(name: str, *args, **kwargs) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        kdsl.ops.fp8_bmm(*args, **kwargs)
    message = str(info.value)
    assert names_argument(message, name), f"error does not name {name!r}: {message}"
    return message


def test_fp8_bmm_bad_inputs(launches):
    a, a_s, b, b_s = mla_operands(2, 4, 128, 256)
    # dtypes
    message = raises_naming("a", a.float(), a_s, b, b_s)
    assert "float8_e4m3fn" in message and "float32" in message
    raises_naming("a_s", a, a_s.bfloat16(), b, b_s)
    raises_naming("b", a, a_s, b.to(torch.float8_e5m2), b_s)
    raises_naming("b_s", a, a_s, b, b_s.double())
    raises_naming("out_dtype", a, a_s, b, b_s, out_dtype=torch.int32)
    raises_naming("a", a.tolist(), a_s, b, b_s)
    # dimensions: fp8_gemm's [M, K] and [N, K] are not batches
    raises_naming("a", a[0], a_s, b, b_s)
    raises_naming("b", a, a_s, b[0], b_s)
    # K not a multiple of 128
    message = raises_naming("a", a[..., :200], a_s, b[..., :200], b_s)
    assert "128" in message and "200" in message
    # N not a multiple of 16
    message = raises_naming("b", a, a_s, b[:, :120], b_s)
    assert "16" in message and "120" in message
    # K of b differs from a's
    raises_naming("b", a, a_s, random_fp8(2, 128, 384), random_scales(2, 1, 3))
    # batch mismatch: b, then the scales
    message = raises_naming("b", a, a_s, b[:1], b_s[:1])
    assert "2" in message and "(1, 128, 256)" in message
    raises_naming("a_s", a, a_s[:1], b, b_s)
    raises_naming("b_s", a, a_s, b, b_s[:1])
    # scale shapes
    message = raises_naming("a_s", a, a_s[..., :1], b, b_s)
    assert "(2, 4, 2)" in message and "(2, 4, 1)" in message
    message = raises_naming("b_s", a, a_s, b, random_scales(2, 2, 2))
    assert "(2, 1, 2)" in message and "(2, 2, 2)" in message
    raises_naming("b_s", a, a_s, b, b_s[..., :1])
    # out: shape, stride along N, dtype
    message = raises_naming("out", a, a_s, b, b_s, out=torch.empty(2, 4, 64, dtype=torch.bfloat16))
    assert "(2, 4, 128)" in message and "(2, 4, 64)" in message
    message = raises_naming("out", a, a_s, b, b_s, out=torch.empty(2, 128, 4, dtype=torch.bfloat16).transpose(1, 2))
    assert "stride" in message
    raises_naming("out", a, a_s, b, b_s, out=torch.empty(2, 4, 128, dtype=torch.float16))
    raises_naming("out", a, a_s, b, b_s, out=torch.empty(8, 128, dtype=torch.bfloat16))
    assert launches == []


def _manifest_without_fp8_bmm(tmp_path):
    shipped = registry.entries()[0].module_path.parent
    data = json.loads((shipped / "manifest.json").read_text())
    data["kernels"] = [k for k in data["kernels"] if k["op"] != "fp8_bmm"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("interpret", [True, False], ids=["kernels", "fallback"])
def test_unserved_scheme_is_refused_on_every_path(interpret, tmp_path, monkeypatch):
    """Kernels with no fp8_bmm (KDSL_GENERATED without it): SchemeNotServedError, with or without kernels."""
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("KDSL_GENERATED", str(_manifest_without_fp8_bmm(tmp_path)))
    registry.reset()
    a, a_s, b, b_s = mla_operands(1, 2, 128, 128)
    with pytest.raises(kdsl.SchemeNotServedError, match="fp8_bmm: .* served: none"):
        kdsl.ops.fp8_bmm(a, a_s, b, b_s)


def test_registry_picks_tma_on_hopper_and_portable_elsewhere():
    for arch in ("sm_89", "sm_100"):
        assert registry.select("fp8_bmm", kdsl.BlockFP8(), arch=arch).name == BMM
    assert registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90").name == TMA
    explained = registry.explain("fp8_bmm", None, arch="sm_90", m=1)
    assert f"{TMA}: CHOSEN" in explained and f"{BMM}: fits sm_89+, but {TMA} is more specific" in explained


# ---------------------------------------------------------------------------------------------
# The sm_90 variant on the CPU (the interpreter runs its TMA descriptors): what TMA cannot take, the TMA
# module refuses, and the alternative tile (the portable kernel, same blocks) serves

# The sm_90 variant's portable tiles run the portable module it shares with the sm_89 variant (same device code).
TMA_PORTABLE = BMM


@pytest.fixture
def tma_kernels(monkeypatch):
    """KDSL_ARCH=sm_90; the sm_90 entry, and the modules its launches ran, in order."""
    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    registry.reset()
    entry = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90")
    names = []
    for kernel_module in entry.modules.values():
        def spy(original, _name=kernel_module.path.stem):
            def launch(*args):
                names.append(_name)
                return original(*args)
            return launch

        wrap_launch(monkeypatch, kernel_module, spy)
    yield entry, names
    monkeypatch.delenv("KDSL_ARCH")
    registry.reset()


def _call(a, b, out):
    return registry.Call(m=a.shape[1], n=b.shape[1], device_type="cpu", dtype="bfloat16",
                         align=check.alignment(a, b, out), batch=a.shape[0])


def test_tma_kernel_takes_mla_views(tma_kernels):
    entry, names = tma_kernels
    a, a_s, b, b_s = mla_operands(3, 5, 512, 128)
    buffer = torch.zeros(5, 3, 512, dtype=torch.bfloat16)
    tile = entry.tile_for(5, 512, _call(a, b, buffer.transpose(0, 1)))
    assert tile["impl"] == "tma_persistent"
    check_bmm(kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=buffer.transpose(0, 1)), a, a_s, b, b_s)
    # A size-1 dimension is never stepped: its stride need not suit TMA (M = 1 out of a wider buffer).
    wide = torch.zeros(3, 1, 520, dtype=torch.bfloat16)[:, :, :512]
    assert check.alignment(a[:, :1], b, wide) == 16
    one = kdsl.ops.fp8_bmm(a[:, :1], a_s[:, :1], b, b_s, out=wide)
    check_bmm(one, a[:, :1], a_s[:, :1], b, b_s)
    assert names == [TMA, TMA]


@pytest.mark.parametrize("case", ["a-offset", "out-stride", "b-broadcast"])
def test_tma_refusal_passes_the_call_to_the_portable_tile(case, tma_kernels):
    """a off a 16-byte boundary, out with a batch stride of 264 bytes, b broadcast over the batch (stride 0): TMA
    cannot take them; the TMA module says why, and the alternative tile, the portable kernel, runs the call,
    with the right answer and no copy."""
    entry, names = tma_kernels
    batch, m, n, k = 2, 5, 128, 256
    a, a_s, b, b_s = mla_operands(batch, m, n, k)
    out = torch.empty(batch, m, n, dtype=torch.bfloat16)
    if case == "a-offset":
        storage = random_fp8(batch * m * k + 16)
        a = storage[1:1 + batch * m * k].view(batch, m, k)
    elif case == "out-stride":
        out = torch.empty(m, batch, n + 4, dtype=torch.bfloat16)[:, :, :n].transpose(0, 1)
    else:
        b = random_fp8(1, n, k).expand(batch, n, k)
    call = _call(a, b, out)
    tma_tile = entry.tile_for(m, n)
    assert tma_tile["impl"] == "tma_persistent"
    reason = entry.refusal_reason(tma_tile, call)
    assert reason.startswith("TMA needs every base and stepped stride of a, b and out")
    assert ("broadcast" in reason) == (case == "b-broadcast")
    chosen = entry.tile_for(m, n, call)
    assert chosen["impl"] == "portable" and (chosen["BLOCK_M"], chosen["BLOCK_N"]) == (16, 64)
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=out)
    assert c is out
    check_bmm(c, a, a_s, b, b_s)
    assert names == [TMA_PORTABLE]


@pytest.mark.parametrize("batch, served_by_few", [(3, True), (16, True), (17, False)])
def test_tiles_for_few_batches_pass_larger_calls_on(batch, served_by_few, monkeypatch):
    """A tile with batch_max serves calls of at most that many batches (TP = 8's 16 heads); a larger call
    goes to the tile after it, which explain shows with the reason; both give the reference's answer."""
    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    registry.reset()
    entry = registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90")
    tiles = []
    wrap_launch(monkeypatch, entry.modules["tma_persistent"],
                lambda original: lambda *args: tiles.append(args[-1]) or original(*args))
    a, a_s, b, b_s = mla_operands(batch, 1, 512, 128)
    check_bmm(kdsl.ops.fp8_bmm(a, a_s, b, b_s), a, a_s, b, b_s)
    assert len(tiles) == 1 and tiles[0]["impl"] == "tma_persistent"
    assert (tiles[0]["batch_max"] == 16) == served_by_few
    explained = registry.explain("fp8_bmm", None, arch="sm_90", m=1, n=512, batch=batch)
    passed_over = "the tile serves up to batch_max = 16 batches, the call has"
    assert (passed_over in explained) == (not served_by_few)
    monkeypatch.delenv("KDSL_ARCH")
    registry.reset()


def test_tma_options_are_checked_by_the_unit():
    """The unit's own rules: one scale per K block, one weight scale per tile, swap_ab's 64 rows of B,
    persistent-only knobs; and the knobs of other implementations are not options here."""
    from pydantic import ValidationError

    from kdsl.kernels import find_impl
    from kdsl.schema import Tile

    impl = find_impl("fp8_bmm", "tma_persistent")
    scheme = kdsl.BlockFP8()

    def problems(**fields):
        tile = Tile(**fields)
        return impl.problems("tiles[0]", scheme, None, tile, impl.resolve(tile))

    assert problems(block_m=64, block_n=128) == []
    assert any("block_k: needs 128" in p for p in problems(block_m=64, block_k=64))
    assert any("block_n: needs to divide" in p for p in problems(block_m=64, block_n=256))
    assert any("swap_ab" in p for p in problems(block_m=16, block_n=32, options={"swap_ab": True}))
    assert any("flatten" in p for p in problems(block_m=64, options={"persistent": False, "flatten": True}))
    with pytest.raises(ValidationError):
        impl.resolve(Tile(block_m=64, options={"deferred_rescale": True}))
    with pytest.raises(ValidationError, match="batch_max"):
        impl.resolve(Tile(block_m=64, options={"batch_max": 0}))


# ---------------------------------------------------------------------------------------------
# torch.ops.kdsl.fp8_bmm: functional; out= is copied into by the Python function under torch.compile

def test_custom_op_and_compile(monkeypatch):
    a, a_s, b, b_s = mla_operands(3, 5, 128, 256)
    want = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
    assert torch.equal(torch.ops.kdsl.fp8_bmm(a, a_s, b, b_s, torch.bfloat16), want)

    def fn(a, a_s, b, b_s, out):
        return kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=out) * 2, kdsl.ops.fp8_bmm(a, a_s, b, b_s)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    buffer = torch.zeros(5, 3, 128, dtype=torch.bfloat16)
    doubled, plain = torch.compile(fn, backend=counter, fullgraph=True)(a, a_s, b, b_s, buffer.transpose(0, 1))
    assert counter.frame_count == 1
    assert torch.equal(plain, want) and torch.equal(buffer.transpose(0, 1), want)
    assert torch.equal(doubled, want * 2)
    torch._dynamo.reset()


def test_compiles_once_for_every_m():
    """dynamic=True: one graph serves every M (the op's checks on M become guards, not specializations)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *t: kdsl.ops.fp8_bmm(*t) + 1, backend=counter, fullgraph=True, dynamic=True)
    for i, m in enumerate((5, 7, 17)):
        a, a_s, b, b_s = mla_operands(2, m, 128, 256)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(a, a_s, b, b_s)
        assert torch.equal(got, kdsl.ops.fp8_bmm(a, a_s, b, b_s) + 1), m
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Without the interpreter: CPU tensors take kdsl's torch fallback, same answers.

class TestTorchFallback:
    @pytest.fixture(autouse=True)
    def _no_interpreter(self, monkeypatch):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    @pytest.mark.parametrize("n, k", MLA_SHAPES, ids=lambda v: str(v))
    @pytest.mark.parametrize("m", [0, 1, 5, 33])
    @pytest.mark.parametrize("batch", [1, 3])
    def test_matches_reference(self, batch, m, n, k, launches):
        a, a_s, b, b_s = mla_operands(batch, m, n, k)
        c = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
        check_bmm(c, a, a_s, b, b_s)
        assert c.is_contiguous()
        buffer = torch.empty(m, batch, n, dtype=torch.float32)
        assert kdsl.ops.fp8_bmm(a, a_s, b, b_s, out_dtype=torch.float32, out=buffer.transpose(0, 1)).data_ptr() \
            == buffer.data_ptr()
        check_bmm(buffer.transpose(0, 1), a, a_s, b, b_s, torch.float32)
        assert launches == []

    def test_nan_and_checks(self, launches):
        test_fp8_bmm_nan_codes_give_nan_rows_and_columns()
        a, a_s, b, b_s = mla_operands(2, 4, 128, 256)
        raises_naming("b_s", a, a_s, b, b_s[:1])
        raises_naming("out", a, a_s, b, b_s, out=torch.empty(2, 128, 4, dtype=torch.bfloat16).transpose(1, 2))
        assert launches == []


# ---------------------------------------------------------------------------------------------
# GPU (KDSL_TEST_GPU=1 python -m pytest -m gpu): MLA's head counts and shapes on CUDA tensors

@pytest.mark.gpu
@pytest.mark.parametrize("n, k", MLA_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 64, 512])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_bmm_on_gpu(heads, m, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need sm_89 or newer")
    torch.manual_seed(heads + m + n)
    a, a_s, b, b_s = mla_operands(heads, m, n, k, device="cuda")
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s)
    check_bmm(c, a, a_s, b, b_s)
    buffer = torch.empty(m, heads, n, dtype=torch.bfloat16, device="cuda")
    out = kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=buffer.transpose(0, 1))
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer.transpose(0, 1), c)


@pytest.mark.gpu
def test_fp8_bmm_nan_on_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need sm_89 or newer")
    a, a_s, b, b_s = mla_operands(16, 64, 512, 128, device="cuda")
    a = a.clone()
    a[3, 10, 5] = torch.tensor(float("nan")).to(FP8)
    c = kdsl.ops.fp8_bmm(a, a_s, b, b_s).float().cpu()
    assert c[3, 10].isnan().all()
    c[3, 10] = 0
    assert torch.isfinite(c).all()


@pytest.mark.gpu
def test_fp8_bmm_strided_fallback_on_gpu():
    """On sm_90, an out whose batch stride TMA cannot take (264 bytes) runs the portable alternative tile."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need sm_89 or newer")
    batch, m, n, k = 16, 64, 128, 512
    a, a_s, b, b_s = mla_operands(batch, m, n, k, device="cuda")
    buffer = torch.empty(m, batch, n + 4, dtype=torch.bfloat16, device="cuda")
    out = buffer[:, :, :n].transpose(0, 1)
    entry = registry.dispatch("fp8_bmm", kdsl.BlockFP8().name, a.device)
    if entry.name == TMA:
        call = registry.Call(m=m, n=n, align=check.alignment(a, b, out))
        assert call.align == 8 and entry.tile_for(m, n, call)["impl"] == "portable"  # 264-byte batch stride
    assert kdsl.ops.fp8_bmm(a, a_s, b, b_s, out=out) is out
    check_bmm(out, a, a_s, b, b_s)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 512, 128), (16, 128, 512), (64, 512, 128), (128, 128, 512)])
def test_fp8_bmm_pdl_waits_for_its_producer_on_gpu(m, n, k):
    """Tiles with pdl start while the previous kernel finishes: each call here reads activations that act_quant
    wrote just before it, and writes an output that the previous fp8_bmm call also wrote, eagerly and replayed
    in a CUDA graph (where the launches become programmatic edges). Every result must be its own."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need sm_89 or newer")
    torch.manual_seed(m + n)
    heads, rounds = 16, 6
    entry = registry.dispatch("fp8_bmm", kdsl.BlockFP8().name, torch.device("cuda"))
    xs = [torch.randn(m, heads, k, device="cuda", dtype=torch.bfloat16) for _ in range(rounds)]
    _, _, b, b_s = mla_operands(heads, m, n, k, device="cuda")
    out = torch.empty(heads, m, n, dtype=torch.bfloat16, device="cuda")
    got = [torch.empty_like(out) for _ in range(rounds)]

    def chain():
        for x, keep in zip(xs, got):
            q, s = kdsl.ops.act_quant(x)
            kdsl.ops.fp8_bmm(q.transpose(0, 1), s.transpose(0, 1), b, b_s, out=out)
            keep.copy_(out)

    def check():
        for x, c in zip(xs, got):
            q, s = kdsl.ops.act_quant(x)
            check_bmm(c, q.transpose(0, 1), s.transpose(0, 1), b, b_s)

    chain()
    torch.cuda.synchronize()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for c in got:
        c.fill_(float("nan"))
    for x in xs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check()
    if entry.name == TMA:
        assert any(t.params.get("pdl") for t in entry.tiles)


@pytest.mark.parametrize("options", [
    {"epilogue": "pointer"},
    {"swap_ab": True, "persistent": False, "epilogue": "pointer", "pdl": True, "prefetch_weights": True},
    {"flatten": True, "pdl": True, "prefetch_weights": True},
], ids=["pointer", "swap-pointer-pdl", "flatten-pdl"])
def test_tma_kernel_options(options, monkeypatch):
    """The pointer epilogue and the PDL options give the same answers as the TMA store, on MLA's views and a
    transposed out= (the interpreter launches a pdl tile as an ordinary launch; the GPU tests launch it as a
    programmatic dependent launch)."""
    from kdsl.codegen.render import tile_params
    from kdsl.kernels import find_impl
    from kdsl.schema import Tile

    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    registry.reset()
    module = next(m for m in registry.select("fp8_bmm", kdsl.BlockFP8(), arch="sm_90").modules.values()
                  if m.path.stem == TMA)
    impl = find_impl("fp8_bmm", "tma_persistent")
    bm = 16 if options.get("swap_ab") else 64
    tile = tile_params(Tile(block_m=bm, block_n=64, num_warps=4, num_stages=2, options=options), impl)
    for m in (1, 5, 70):
        a, a_s, b, b_s = mla_operands(3, m, 192, 256)
        buffer = torch.full((m, 3, 192), float("nan"), dtype=torch.bfloat16)
        module.launch(a, a_s, b, b_s, buffer.transpose(0, 1), tile)
        check_bmm(buffer.transpose(0, 1), a, a_s, b, b_s)
    monkeypatch.delenv("KDSL_ARCH")
    registry.reset()
