"""fp8_linear: act_quant fused into the fp8 GEMM (one launch, one output).

Bit for bit against act_quant + fp8_gemm where both run the same tile (the fused module and fp8_gemm/portable's
module launched with one tile, K unsplit), and against the independent fp32 references in tests/reference.py
(act_quant_ref, fp8_gemm_ref) on every tile the definition declares, split K included. CPU tensors run the
generated kernels through Triton's interpreter (conftest); the `gpu`-marked tests run them on the GPU.
"""
from __future__ import annotations

import pytest
import torch
from conftest import interpreting
from reference import FP8, act_quant_ref, fp8_gemm_ref, rel_fro_error

import kdsl
from kdsl import registry
from kdsl.codegen.render import tile_params
from kdsl.kernels.block_fp8 import fp8_gemm_portable, fp8_linear_portable
from kdsl.ops import _plan
from kdsl.schema.tiling import Tile

SCHEME = kdsl.BlockFP8()
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def modules(arch: int = 89):
    """(fp8_linear's module, fp8_gemm/portable's module) for the scheme: kdsl.runtime KernelModules."""
    fused, gemm = registry.select("fp8_linear", SCHEME.name, arch=arch), registry.select("fp8_gemm", SCHEME.name, arch=89)
    return fused.modules[fused.impl], gemm.modules[gemm.impl]


def same_tile(block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 2) -> tuple[dict, dict]:
    """One tile's launch parameters for the fused module and for fp8_gemm/portable's (K unsplit)."""
    tile = dict(block_m=block_m, block_n=block_n, block_k=128, num_warps=num_warps, num_stages=num_stages)
    return (tile_params(Tile(**tile), fp8_linear_portable.IMPL), tile_params(Tile(**tile), fp8_gemm_portable.IMPL))


def weights(n: int, k: int, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16)
    return kdsl.ops.weight_quant(w)


def activations(shape, dtype=torch.bfloat16, device="cpu", seed=1):
    """Random x whose groups differ in magnitude (per-group scales matter), with an all-zero group where K >= 512."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device)
    x[..., :128] *= 8.0
    x[..., 128:256] *= 1 / 16
    if shape[-1] >= 512:
        x[..., 384:512] = 0.0
    return x.to(dtype)


def composed(x, b, b_s, tile_gemm, out_dtype, gemm_module):
    """act_quant (the op) then fp8_gemm/portable's module with tile_gemm."""
    a, a_s = kdsl.ops.act_quant(x)
    c = torch.full((x.shape[0], b.shape[0]), float("nan"), dtype=out_dtype, device=x.device)
    gemm_module.launch(a, a_s, b, b_s, c, tile_gemm)
    return c


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


# --- bit for bit, same tile ---------------------------------------------------------------------

@pytest.mark.skipif(not interpreting(), reason="runs the generated kernels through Triton's interpreter")
@pytest.mark.parametrize("m, n, k, block_m, block_n", [(1, 72, 256, 16, 64), (20, 200, 384, 16, 64),
                                                       (70, 136, 512, 64, 128)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_same_tile_gives_act_quant_plus_fp8_gemm_bit_for_bit(m, n, k, block_m, block_n, dtype):
    fused, gemm = modules()
    tile_fused, tile_gemm = same_tile(block_m, block_n)
    b, b_s = weights(n, k)
    x = activations((m, k), dtype)
    y = torch.full((m, n), float("nan"), dtype=dtype)
    fused.launch(x, b, b_s, None, y, tile_fused)
    want = composed(x, b, b_s, tile_gemm, dtype, gemm)
    assert torch.equal(bits(y), bits(want))


# --- against the fp32 reference, through the op ------------------------------------------------

def reference(x, b, b_s, bias=None):
    a, a_s = act_quant_ref(x)
    y = fp8_gemm_ref(a, a_s, b, b_s)
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("shape", [(1, 256), (16, 384), (2, 3, 512), (65, 256)])  # each tile, split K
@pytest.mark.parametrize("dtype, out_dtype, limit", [(torch.bfloat16, None, 8e-3), (torch.float16, torch.float32, 1e-5),
                                                     (torch.float32, torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference(shape, dtype, out_dtype, limit, with_bias):
    n = 200  # ragged against the 128-row weight block and every block_n
    b, b_s = weights(n, shape[-1])
    x = activations(shape, dtype)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    y = kdsl.ops.fp8_linear(x, b, b_s, bias, out_dtype=out_dtype)
    assert y.shape == (*shape[:-1], n) and y.dtype == (out_dtype or dtype) and y.is_contiguous()
    want = reference(x, b, b_s, bias)
    assert rel_fro_error(y, want) < limit
    # And within the output's rounding of the unfused ops (the split's order of sums differs).
    unfused = kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(x), b, b_s, out_dtype=torch.float32)
    if bias is not None:
        unfused = unfused + bias.float()
    assert rel_fro_error(y, unfused) < limit


def test_nan_and_inf_follow_act_quant_and_fp8_gemm():
    """A NaN element or an inf in a row of x makes that row NaN (NaN codes, inf scale), a NaN code in a row of w
    that column; everything else is the unfused ops' result."""
    n, k = 136, 384
    b, b_s = weights(n, k)
    b.view(torch.uint8)[5, 7] = 0x7F
    x = activations((6, k), torch.bfloat16)
    x[1, 3] = float("nan")
    x[3, 200] = float("inf")
    x[4, 300] = -float("inf")
    y = kdsl.ops.fp8_linear(x, b, b_s)
    unfused = kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(x), b, b_s)
    nan = torch.zeros(6, n, dtype=torch.bool)
    nan[[1, 3, 4]] = True
    nan[:, 5] = True
    assert torch.equal(y.isnan(), nan) and torch.equal(unfused.isnan(), nan)
    assert rel_fro_error(y[~nan].float(), unfused[~nan].float()) < 8e-3


def test_all_zero_rows_give_zeros_not_nan():
    b, b_s = weights(72, 256)
    y = kdsl.ops.fp8_linear(torch.zeros(3, 256, dtype=torch.bfloat16), b, b_s)
    assert torch.equal(y, torch.zeros_like(y))


def test_empty_m_and_zero_k():
    b, b_s = weights(72, 256)
    assert kdsl.ops.fp8_linear(torch.empty(0, 256), b, b_s).shape == (0, 72)
    bias = torch.randn(72)
    y = kdsl.ops.fp8_linear(torch.empty(2, 0), torch.empty(72, 0, dtype=FP8), torch.empty(1, 0), bias)
    assert torch.equal(y, bias.expand(2, 72))


def test_the_torch_fallback_gives_the_kernels_answer(monkeypatch):
    """With the interpreter off, CPU tensors take kdsl.ops.fallback: same checks, same math."""
    b, b_s = weights(200, 384)
    x = activations((5, 384), torch.bfloat16)
    bias = torch.randn(200, dtype=torch.bfloat16)
    kernel = kdsl.ops.fp8_linear(x, b, b_s, bias)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fallback = kdsl.ops.fp8_linear(x, b, b_s, bias)
    assert rel_fro_error(fallback, kernel) < 8e-3
    assert rel_fro_error(fallback, reference(x, b, b_s, bias)) < 8e-3


@pytest.mark.parametrize("call, error, words", [
    (lambda x, b, s: kdsl.ops.fp8_linear(x.to(torch.int32), b, s), TypeError, "x: expected dtype"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x[:, :200], b, s), ValueError, "x: last dimension K = 200"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b.view(torch.uint8), s), TypeError, "w: expected dtype"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b[:, :128], s), ValueError, "w: expected shape (N, 256)"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b, s[:, :1]), ValueError, "w_s: expected shape (1, 2)"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b, s, torch.randn(5)), ValueError, "bias: expected shape (72,)"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b, s, torch.ones(72, dtype=torch.int32)), TypeError, "bias: expected dtype"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b, s, out_dtype=torch.int8), TypeError, "out_dtype: expected one of"),
    (lambda x, b, s: kdsl.ops.fp8_linear(x, b, "s"), TypeError, "w_s: expected a torch.Tensor"),
])
def test_checks_name_the_argument(call, error, words):
    b, b_s = weights(72, 256)
    with pytest.raises(error) as raised:
        call(torch.randn(3, 256), b, b_s)
    assert words in str(raised.value)


# --- launch plan --------------------------------------------------------------------------------

def test_a_repeat_call_replays_its_plan_and_gives_the_ordinary_result():
    ops = kdsl.ops
    b, b_s = weights(200, 384)
    bias = torch.randn(200, dtype=torch.bfloat16)
    registry.plans.clear()
    for seed in range(3):  # miss (records), hit, hit; new data each call
        x = activations((4, 384), torch.bfloat16, seed=seed)
        y = ops.fp8_linear(x, b, b_s, bias)
        _plan.RECORD = False
        saved = dict(registry.plans)
        registry.plans.clear()
        try:
            want = ops.fp8_linear(x, b, b_s, bias)
        finally:
            _plan.RECORD = True
            registry.plans.update(saved)
        assert torch.equal(bits(y), bits(want))
    kept = [plan for key, plan in registry.plans.items() if key[0] == "fp8_linear"]
    assert len(kept) == 1 and kept[0]  # kept, and replayed by the calls after the first


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 200])
@pytest.mark.parametrize("n, k", [(2112, 7168), (576, 1536)])
def test_gpu_same_tile_bit_for_bit(m, n, k):
    """On the GPU (its fp8 MMA and e4m3 cast), with fp8_gemm/portable's module and the fused one on one tile."""
    cuda = torch.device("cuda")
    fused, gemm = modules(registry.device_arch(cuda))
    b, b_s = weights(n, k, device=cuda)
    for dtype in FLOAT_DTYPES:
        x = activations((m, k), dtype, device=cuda)
        for block_m, block_n, stages in ((16, 64, 4), (64, 128, 2)):
            tile_fused, tile_gemm = same_tile(block_m, block_n, num_stages=stages)
            y = torch.full((m, n), float("nan"), dtype=dtype, device=cuda)
            fused.launch(x, b, b_s, None, y, tile_fused)
            assert torch.equal(bits(y), bits(composed(x, b, b_s, tile_gemm, dtype, gemm))), (dtype, block_m, block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_gpu_matches_the_reference(m):
    cuda = torch.device("cuda")
    n, k = 2112, 7168
    b, b_s = weights(n, k, device=cuda)
    bias = torch.randn(n, device=cuda, dtype=torch.bfloat16)
    x = activations((m, k), torch.bfloat16, device=cuda)
    for call in range(3):  # the plan records, then replays
        y = kdsl.ops.fp8_linear(x, b, b_s, bias)
        assert rel_fro_error(y, reference(x, b, b_s, bias)) < 8e-3
    x[0, 5] = float("nan")
    x[-1, 9] = float("inf")
    y = kdsl.ops.fp8_linear(x, b, b_s, bias)
    assert y[0].isnan().all() and y[-1].isnan().all() and not y[1:-1].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_gpu_act_quant_fp8_gemm_is_one_plan_with_the_two_ops_results(m):
    """FP8Linear's path (above the fused rows, and in CUDA graphs at every M): one launch plan for act_quant and
    fp8_gemm, recorded on the first call and replayed after, bit for bit with the two ops called apart, on new data
    too; NaN and inf rows stay NaN."""
    from kdsl.ops.block_fp8 import act_quant_fp8_gemm

    cuda = torch.device("cuda")
    b, b_s = weights(2112, 7168, device=cuda)
    registry.plans.clear()
    for call in range(3):
        x = activations((m, 7168), torch.bfloat16, device=cuda)
        if call == 2:
            x[0, 5], x[-1, 9] = float("nan"), float("inf")
        y = act_quant_fp8_gemm(x, b, b_s, 128, torch.bfloat16)
        assert torch.equal(bits(y), bits(kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(x), b, b_s))), call
        kept = [plan for key, plan in registry.plans.items() if key[0] == "act_quant+fp8_gemm"]
        assert len(kept) == 1 and kept[0], call
    assert y[0].isnan().all() and y[-1].isnan().all() and not y[1:-1].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_act_quant_fp8_gemm_in_a_cuda_graph_matches_the_two_ops(m):
    """Captured in a CUDA graph (as a whole-model graph holds FP8Linear at decode), the pair gives the two ops'
    bits on every replay with new x, over several layers' distinct weights."""
    from kdsl.ops.block_fp8 import act_quant_fp8_gemm

    cuda = torch.device("cuda")
    shapes = ((4096, 4096), (2112, 7168), (4096, 4096))
    layers = [weights(n, k, device=cuda, seed=i) for i, (n, k) in enumerate(shapes)]
    x = activations((m, 4096), torch.bfloat16, device=cuda)

    def forward():
        h = act_quant_fp8_gemm(x, *layers[0], 128, torch.bfloat16)
        h = act_quant_fp8_gemm(torch.cat([h, h[:, :3072]], dim=1), *layers[1], 128, torch.bfloat16)
        return act_quant_fp8_gemm(torch.cat([h, h[:, :1984]], dim=1), *layers[2], 128, torch.bfloat16)

    def apart():
        h = kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(x), *layers[0])
        h = kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(torch.cat([h, h[:, :3072]], dim=1)), *layers[1])
        return kdsl.ops.fp8_gemm(*kdsl.ops.act_quant(torch.cat([h, h[:, :1984]], dim=1)), *layers[2])

    forward()  # compiled and planned outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward()
    for replay in range(3):
        x.copy_(activations((m, 4096), torch.bfloat16, device=cuda, seed=2 + replay))
        graph.replay()
        assert torch.equal(bits(y), bits(apart()))


# --- the module ---------------------------------------------------------------------------------

def test_fp8linear_runs_the_fused_op_for_few_rows_and_the_two_ops_for_many(monkeypatch):
    from kdsl.nn import FP8Linear
    from kdsl.nn import modules

    linear = torch.nn.Linear(256, 72, bias=True, dtype=torch.bfloat16)
    layer = FP8Linear.from_float(linear)
    called = []
    for where, name in ((modules.ops, "fp8_linear"), (modules, "act_quant_fp8_gemm")):
        real = getattr(where, name)
        monkeypatch.setattr(where, name, lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    for rows in (1, modules.FUSED_MAX_ROWS, modules.FUSED_MAX_ROWS + 1):
        called.clear()
        x = activations((rows, 256), torch.bfloat16)
        y = layer(x)
        assert called == (["fp8_linear"] if rows <= modules.FUSED_MAX_ROWS else ["act_quant_fp8_gemm"])
        want = reference(x, layer.weight, layer.weight_scale_inv, layer.bias)
        assert rel_fro_error(y, want) < 8e-3
    assert "fused=fp8_linear__" in repr(layer)
