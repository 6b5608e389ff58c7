"""Block-FP8 ops on a real GPU at DeepSeek-V3 shapes, against the fp32 references.

Skipped without CUDA. On the GPU machine run without the interpreter:

    KDSL_TEST_GPU=1 python -m pytest tests/test_gpu_fp8.py -q

Outputs are allocated by the ops with torch.empty, so a kernel that skips part of its output
leaves garbage there and fails the comparison.
"""
from __future__ import annotations

import pytest
import torch
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

from triton import next_power_of_2 as triton_next_power_of_2

import kdsl
from kdsl import registry
from kdsl.kernels.block_fp8 import fp8_gemm_deferred_gluon
from kdsl.runtime import launcher

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
FP8_SCHEME = kdsl.BlockFP8()
# (N, K) of DeepSeek-V3 projections: fused q_a/kv_a (2112 x 7168) and a wide-K down projection.
SHAPES = [(2112, 7168), (7168, 16384)]
MS = [1, 16, 4096]
Q_MISMATCH_FRACTION = 0.0


def assert_scales_close(s, s_ref):
    """Scales are amax / 448 correctly rounded, exactly as the reference computes them."""
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)


@pytest.fixture(autouse=True)
def _gpu_state():
    torch.manual_seed(0)
    yield
    torch.cuda.synchronize()


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def expected_gemm_impl() -> str:
    return "tma_persistent" if capability() == (9, 0) else "portable"


def fp8_mismatch_fraction(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.dtype == FP8 and actual.shape == expected.shape
    return (actual.float() != expected.float()).float().mean().item()


def test_registry_picks_the_right_gemm_kernel():
    entry = registry.dispatch("fp8_gemm", FP8_SCHEME.name, CUDA)
    if capability() < (8, 9):
        pytest.skip(f"no fp8 tensor cores on sm_{capability()[0]}{capability()[1]}")
    assert entry.impl == expected_gemm_impl()
    if capability() == (9, 0):
        assert entry.name == "fp8_gemm__e4m3_w128x128_a128_f32__tma_persistent_sm90"
        assert (entry.min_arch, entry.max_arch) == (90, 90)


@pytest.mark.parametrize("m", [*MS, 2, 3, 4])  # act_quant's decode tiles: 1, 2 and 4 rows a program
@pytest.mark.parametrize("k", sorted({k for _, k in SHAPES}))
def test_act_quant(m, k, launched):
    x = (torch.randn(m, k, device=CUDA) * 2.0).to(torch.bfloat16)
    q, s = kdsl.ops.act_quant(x)
    q_ref, s_ref = act_quant_ref(x)
    assert_scales_close(s, s_ref)
    assert fp8_mismatch_fraction(q, q_ref) <= Q_MISMATCH_FRACTION
    assert launched and all(name.startswith("act_quant__") for name in launched)


@pytest.mark.parametrize("n, k", SHAPES)
def test_weight_quant(n, k, launched):
    w = (torch.randn(n, k, device=CUDA) * 0.02).to(torch.bfloat16)
    q, s = kdsl.ops.weight_quant(w)
    q_ref, s_ref = weight_quant_ref(w)
    assert s.shape == (-(-n // 128), -(-k // 128))
    assert_scales_close(s, s_ref)
    assert fp8_mismatch_fraction(q, q_ref) <= Q_MISMATCH_FRACTION
    assert launched and all(name.startswith("weight_quant__") for name in launched)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n, k", SHAPES)
def test_weight_dequant(n, k, out_dtype, launched):
    q = random_fp8(n, k, device=CUDA)
    s = random_scales(-(-n // 128), -(-k // 128), device=CUDA)
    w = kdsl.ops.weight_dequant(q, s, out_dtype=out_dtype)
    # One fp32 product, one rounding to out_dtype: bit-exact on the GPU.
    assert torch.equal(w, weight_dequant_ref(q, s).to(out_dtype))
    assert launched and all(name.startswith("weight_dequant__") for name in launched)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp8_gemm(m, n, k, launched):
    a = random_fp8(m, k, device=CUDA)
    a_s = random_scales(m, k // 128, device=CUDA)
    b = random_fp8(n, k, device=CUDA)
    b_s = random_scales(-(-n // 128), k // 128, device=CUDA)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    assert c.shape == (m, n) and c.dtype == torch.bfloat16
    assert torch.isfinite(c.float()).all()
    err = rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s))
    assert err < 1e-2, f"relative Frobenius error {err:.3g}"
    if capability() >= (8, 9):
        # The entry's own kernels: on sm_90 its tiles name tma_persistent or the Gluon deferred_gluon.
        kernels = ("tma_persistent", "deferred_gluon") if capability() == (9, 0) else ("portable",)
        assert launched and all(any(k in name for k in kernels) for name in launched), launched


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("m", [16, 4096])
def test_fp8_gemm_out_dtypes(m, out_dtype):
    n, k = SHAPES[0]
    a = random_fp8(m, k, scale=16.0, device=CUDA)
    a_s = random_scales(m, k // 128, device=CUDA)
    b = random_fp8(n, k, scale=16.0, device=CUDA)
    b_s = random_scales(-(-n // 128), k // 128, device=CUDA)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s, out_dtype=out_dtype)
    assert c.dtype == out_dtype
    # fp32 output: only accumulation order differs from the reference (per-step scaling, tiling).
    limit = 2e-3 if out_dtype == torch.float16 else 5e-4
    assert rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s)) < limit


@pytest.mark.parametrize("m", [16, 512, 4096], ids=["wgmma-splitk", "gluon", "gluon-persistent-edge"])
def test_repeat_launches_skip_the_jit_and_stay_correct(m, monkeypatch):
    """After the first call on a shape, an sm_90 module's kernel is launched as its JIT call returned it (the
    launcher's compiled-kernel cache): new data on every call must still give the reference's result. An a_s of the same
    shape but off 16-byte alignment is a new key, so it gets a kernel compiled for it."""
    if capability() != (9, 0):
        pytest.skip("this checks the sm_90 modules' kernels")
    n, k = SHAPES[0]
    entry = registry.dispatch("fp8_gemm", FP8_SCHEME.name, CUDA)
    tile = entry.tile_for(m, n)
    kernel_module = entry.modules[tile["impl"]]
    module = kernel_module.load()
    kernel = getattr(module, kernel_module.path.stem)
    jit_calls = []

    def counted_run(*args, _run=kernel.run, **kwargs):
        jit_calls.append(1)
        return _run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted_run)
    for call in range(3):
        a = random_fp8(m, k, device=CUDA)
        a_s = random_scales(m, k // 128, device=CUDA)
        b = random_fp8(n, k, device=CUDA)
        b_s = random_scales(-(-n // 128), k // 128, device=CUDA)
        c = torch.full((m, n), float("nan"), device=CUDA, dtype=torch.bfloat16)
        kernel_module.launch(a, a_s, b, b_s, c, tile)
        assert rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s)) < 1e-2
        if call == 0:
            jit_calls.clear()  # the first call may compile, or find a key an earlier test left
    assert not jit_calls, "repeat launches went through Triton's JIT call"
    keys = len(launcher._COMPILED)
    misaligned = torch.empty(m * (k // 128) + 1, device=CUDA)[1:].view(m, k // 128).copy_(a_s)
    c = torch.full((m, n), float("nan"), device=CUDA, dtype=torch.bfloat16)
    kernel_module.launch(a, misaligned, b, b_s, c, tile)
    assert rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s)) < 1e-2
    assert len(launcher._COMPILED) == keys + 1 and jit_calls


def deferred_tiles() -> list[dict]:
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    return [bucket.params for bucket in entry.tiles if bucket.params["impl"] == "deferred_gluon"]


@pytest.mark.parametrize("tile", deferred_tiles(), ids=lambda t: f"{t['BLOCK_M']}x{t['BLOCK_N']}")
@pytest.mark.parametrize("m, n, k", [(1, 2112, 7168), (300, 576, 512), (515, 136, 384), (130, 24576, 1536),
                                     (64, 256, 128), (4100, 1000, 384), (2000, 2112, 256), (4100, 1000, 128)])
def test_fp8_gemm_deferred_rescale_ragged(tile, m, n, k):
    """fp8_gemm/deferred_gluon's kernel (the sm_90 Gluon tiles) on ragged shapes: M and N off the tile, an
    odd number of K blocks (3, 1) and an even one; with more tiles than SMs, the persistent tile's
    programs loop and its loads run into the next tile (with one K block, several tiles ahead). fp32
    output, so only the order of the fp32 sums differs from the reference. Rows whose activations are
    all zero (scale 0) give exact zeros."""
    if capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm_90's")
    module = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90").modules["deferred_gluon"]
    a = random_fp8(m, k, scale=16.0, device=CUDA)
    a_s = random_scales(m, k // 128, device=CUDA)
    a[m // 2].zero_()
    a_s[m // 2].zero_()
    b = random_fp8(n, k, scale=16.0, device=CUDA)
    b_s = random_scales(-(-n // 128), k // 128, device=CUDA)
    c = torch.empty(m, n, device=CUDA, dtype=torch.float32)
    module.launch(a, a_s, b, b_s, c, tile)
    assert torch.isfinite(c).all()
    assert rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s)) < 5e-4
    assert torch.equal(c[m // 2], torch.zeros_like(c[m // 2]))
    c16 = torch.empty(m, n, device=CUDA, dtype=torch.bfloat16)
    module.launch(a, a_s, b, b_s, c16, tile)
    assert rel_fro_error(c16, fp8_gemm_ref(a, a_s, b, b_s)) < 1e-2


def edge_tiles() -> list[dict]:
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    return [bucket.params for bucket in entry.tiles if bucket.params.get("edge_tiles")]


@pytest.mark.parametrize("tile", edge_tiles(), ids=lambda t: f"{t['BLOCK_M']}x{t['BLOCK_N']}")
@pytest.mark.parametrize("m, n, k", [(4096, 2112, 7168), (2000, 2104, 384), (512, 2064, 256), (512, 2144, 512)])
def test_fp8_gemm_edge_tiles_write_the_last_column(tile, m, n, k):
    """N's partial last column as narrow tiles for the programs with a round to spare (64, 64, 16 and
    128 columns wide here, M partial in the second shape). The stream's next kernel copies each result
    out of memory filled with NaN before every call: every column must be written, eagerly and at every
    replay of a CUDA graph."""
    if capability() != (9, 0):
        pytest.skip("edge tiles are part of the sm_90 Gluon kernel")
    module = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90").modules["deferred_gluon"]
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    if not fp8_gemm_deferred_gluon.edge_tiles(m, n, tile, sms)[0]:
        pytest.skip(f"with {sms} SMs the edge column has no spare round at this shape (132 SMs: it has)")
    a = random_fp8(m, k, scale=16.0, device=CUDA)
    a_s = random_scales(m, k // 128, device=CUDA)
    b = random_fp8(n, k, scale=16.0, device=CUDA)
    b_s = random_scales(-(-n // 128), k // 128, device=CUDA)
    expected = fp8_gemm_ref(a, a_s, b, b_s)
    c = torch.empty(m, n, device=CUDA, dtype=torch.float32)
    copy = torch.empty_like(c)
    for _ in range(2):
        c.fill_(float("nan"))
        module.launch(a, a_s, b, b_s, c, tile)
        copy.copy_(c)
        assert torch.isfinite(copy).all()
        assert rel_fro_error(copy, expected) < 5e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.launch(a, a_s, b, b_s, c, tile)
        copy.copy_(c)
    for _ in range(2):
        c.fill_(float("nan"))
        copy.fill_(float("nan"))
        graph.replay()
        assert torch.isfinite(copy).all()
        assert rel_fro_error(copy, expected) < 5e-4
    c16 = torch.full((m, n), float("nan"), device=CUDA, dtype=torch.bfloat16)
    module.launch(a, a_s, b, b_s, c16, tile)
    assert rel_fro_error(c16, expected) < 1e-2


def test_fp8_gemm_batched_and_ragged_n():
    # MLA-style batched call, N = 576 (not a multiple of 128), M not a multiple of any tile.
    a = random_fp8(2, 37, 512, device=CUDA)
    a_s = random_scales(2, 37, 4, device=CUDA)
    b = random_fp8(576, 512, device=CUDA)
    b_s = random_scales(5, 4, device=CUDA)
    c = kdsl.ops.fp8_gemm(a, a_s, b, b_s)
    assert c.shape == (2, 37, 576)
    assert rel_fro_error(c, fp8_gemm_ref(a, a_s, b, b_s)) < 1e-2


def test_end_to_end_quantized_linear():
    n, k = SHAPES[0]
    x = torch.randn(64, k, device=CUDA, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=CUDA) * 0.02).to(torch.bfloat16)
    q, s = kdsl.ops.act_quant(x)
    wq, ws = kdsl.ops.weight_quant(w)
    c = kdsl.ops.fp8_gemm(q, s, wq, ws)
    assert rel_fro_error(c, fp8_gemm_ref(q, s, wq, ws)) < 1e-2
    assert rel_fro_error(c, x.float() @ w.float().T) < 0.08


def test_all_zero_groups_give_no_nan():
    n, k = SHAPES[0]
    x = torch.randn(16, k, device=CUDA, dtype=torch.bfloat16)
    x[:, 256:384] = 0
    x[3] = 0
    q, s = kdsl.ops.act_quant(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not torch.isnan(q.float()).any()
    assert (q[:, 256:384].float() == 0).all() and (q[3].float() == 0).all()
    q_ref, s_ref = act_quant_ref(x)
    assert_scales_close(s, s_ref)

    w = (torch.randn(n, k, device=CUDA) * 0.02).to(torch.bfloat16)
    w[:128, :128] = 0
    w[2048:, 7040:] = 0  # the ragged corner block
    wq, ws = kdsl.ops.weight_quant(w)
    assert torch.isfinite(ws).all() and (ws > 0).all()
    assert not torch.isnan(wq.float()).any()
    assert (wq[:128, :128].float() == 0).all()

    c = kdsl.ops.fp8_gemm(q, s, wq, ws)
    assert torch.isfinite(c.float()).all()
    assert (c[3] == 0).all()
    assert rel_fro_error(c, fp8_gemm_ref(q, s, wq, ws)) < 1e-2


def test_empty_inputs_on_gpu():
    q, s = kdsl.ops.act_quant(torch.empty(0, 7168, device=CUDA, dtype=torch.bfloat16))
    assert q.shape == (0, 7168) and s.shape == (0, 56)
    b = random_fp8(2112, 7168, device=CUDA)
    b_s = random_scales(17, 56, device=CUDA)
    c = kdsl.ops.fp8_gemm(q, s, b, b_s)
    assert c.shape == (0, 2112)


def test_mismatched_devices_are_refused():
    a = random_fp8(4, 256, device=CUDA)
    a_s = random_scales(4, 2)  # on the CPU
    b = random_fp8(64, 256, device=CUDA)
    b_s = random_scales(1, 2, device=CUDA)
    with pytest.raises(ValueError, match="a_s"):
        kdsl.ops.fp8_gemm(a, a_s, b, b_s)
