"""kdsl.ops.add_rms_norm and add_rms_norm_quant (a decoder layer's residual add and the norm after it in one launch)
and the kdsl.nn paths that use them.

h must be x + residual rounded once to x's dtype, checked against the float32 sum rounded here (independent of the
kernels) and against torch's own add; y and the codes must be what rms_norm and rms_norm_quant give for that h, bit
for bit (the same fp32 sums over the same rows), and within test_rms_norm's and test_rms_norm_quant's bounds of the
float64 norm. Each op test runs on the generated kernel in Triton's interpreter (CPU tensors), on kdsl's torch
fallback (interpreter off), and, marked gpu, on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from conftest import interpreting, kernel_paths
from reference import FP8
from test_rms_norm import check_y, hidden_states, norm_weight
from test_rms_norm_quant import check_codes, check_dequantized, fp8_linear

import kdsl

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 4096), (5, 896), (2, 3, 256), (17, 128)]
SHAPE_IDS = ["decode", "H-not-a-power-of-two", "3-d", "one-group"]

# The add_ kernels, and the one-op references they are compared with.
device = kernel_paths(("add_rms_norm", "rms_norm", "fp8_gemm", "fp8_linear", "act_quant", "weight_quant",
                       "w4a16_gemm"))


def summed(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x + residual in float32 (exact for two values of a 16-bit dtype), rounded once to x's dtype."""
    return (x.float() + residual.float()).to(x.dtype)


def inputs(shape, dtype, device, seed=0):
    x = hidden_states(shape, dtype, device, seed=seed)
    residual = hidden_states(shape, dtype, device, seed=seed + 100)
    return x, residual, norm_weight(shape[-1], dtype, device, seed=seed + 200)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_add_rms_norm_is_the_add_then_rms_norm(device, launched, shape, dtype):
    x, residual, weight = inputs(shape, dtype, device)
    for round_normalized in (False, True):
        y, h = kdsl.ops.add_rms_norm(x, residual, weight, 1e-5, round_normalized)
        assert h.dtype == y.dtype == dtype and h.shape == y.shape == x.shape and h.device == x.device
        assert torch.equal(h.cpu(), summed(x.cpu(), residual.cpu())) and torch.equal(h, x + residual)
        assert torch.equal(y, kdsl.ops.rms_norm(h, weight, 1e-5, round_normalized))
        check_y(y, h, weight, 1e-5, round_normalized)
    assert bool(launched) == (device.type == "cuda" or interpreting()), launched
    assert any(name.startswith("add_rms_norm__") for name in launched) or not launched, launched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_add_rms_norm_quant_is_the_add_then_rms_norm_quant(device, launched, shape, dtype):
    x, residual, weight = inputs(shape, dtype, device, seed=3)
    for round_normalized in (False, True):
        q, s, h = kdsl.ops.add_rms_norm_quant(x, residual, weight, 1e-5, 128, round_normalized)
        assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (*shape[:-1], shape[-1] // 128)
        assert torch.equal(h.cpu(), summed(x.cpu(), residual.cpu()))
        q_two, s_two = kdsl.ops.rms_norm_quant(h, weight, 1e-5, 128, round_normalized)
        assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8)) and torch.equal(s, s_two)
        check_dequantized(q, s, h, weight, 1e-5, round_normalized)
        if not round_normalized:
            check_codes(q, s, h, weight, 1e-5)
    assert any(name.startswith("add_rms_norm_quant__") for name in launched) or not launched, launched


def test_nan_and_inf(device):
    """A NaN in x or residual makes its element of h NaN and its row of y NaN; inf + -inf is NaN as torch has it;
    other rows are untouched."""
    x, residual, weight = inputs((4, 256), torch.float32, device, seed=5)
    x[1, 7] = float("nan")
    x[2, 9], residual[2, 9] = float("inf"), float("-inf")
    y, h = kdsl.ops.add_rms_norm(x, residual, weight)
    assert h[1, 7].isnan() and h[2, 9].isnan() and y[1].isnan().all() and y[2].isnan().all()
    assert y[[0, 3]].isfinite().all() and torch.equal(h[[0, 3]], (x + residual)[[0, 3]])
    q, s, h = kdsl.ops.add_rms_norm_quant(x, residual, weight)
    assert q[1].float().isnan().all() and q[0].float().isfinite().all()


@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 512)])
def test_empty(device, shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    weight = torch.ones(shape[-1], dtype=torch.bfloat16, device=device)
    y, h = kdsl.ops.add_rms_norm(x, x, weight)
    assert y.shape == h.shape == x.shape
    q, s, h = kdsl.ops.add_rms_norm_quant(x, x, weight)
    assert q.shape == x.shape and q.dtype == FP8 and s.shape == (*shape[:-1], shape[-1] // 128)


def test_refusals_name_the_argument(device):
    x, residual, weight = inputs((2, 512), torch.bfloat16, device)
    for op in (kdsl.ops.add_rms_norm, kdsl.ops.add_rms_norm_quant):
        with pytest.raises(TypeError, match=r"^residual: expected dtype bfloat16, got float16"):
            op(x, residual.half(), weight)
        with pytest.raises(ValueError, match=r"^residual: expected shape \(2, 512\) \(x's shape\), got \(2, 256\)"):
            op(x, residual[:, :256], weight)
        with pytest.raises(TypeError, match=r"^residual: expected a torch.Tensor, got float"):
            op(x, 1.0, weight)
        with pytest.raises(ValueError, match=r"^weight\b"):
            op(x, residual, weight[:256])
        with pytest.raises(ValueError, match=r"^eps: expected a finite number >= 0"):
            op(x, residual, weight, float("inf"))
        with pytest.raises(TypeError, match=r"^x\b"):
            op(x.to(torch.int32), residual, weight)
    with pytest.raises(ValueError, match=r"^group_size\b"):
        kdsl.ops.add_rms_norm_quant(x, residual, weight, 1e-6, 96)
    with pytest.raises(ValueError, match=r"^x: last dimension 320 must be a multiple of group_size = 128"):
        kdsl.ops.add_rms_norm_quant(x[:, :320], residual[:, :320], weight[:320])


def test_residual_with_other_strides(device):
    """A residual that is a view with a row stride of its own (x's rows are contiguous) is read through it."""
    x, _, weight = inputs((3, 256), torch.float16, device, seed=8)
    wide = hidden_states((3, 512), torch.float16, device, seed=9)
    residual = wide[:, 128:384]
    y, h = kdsl.ops.add_rms_norm(x, residual, weight)
    assert torch.equal(h, x + residual) and torch.equal(y, kdsl.ops.rms_norm(x + residual, weight))


def test_custom_ops_and_compile():
    x, residual, weight = inputs((3, 512), torch.bfloat16, "cpu", seed=7)
    for round_normalized in (False, True):
        torch.library.opcheck(torch.ops.kdsl.add_rms_norm.default, (x, residual, weight, 1e-5, round_normalized))
        torch.library.opcheck(torch.ops.kdsl.add_rms_norm_quant.default,
                              (x, residual, weight, 1e-5, 128, round_normalized))
    compiled = torch.compile(lambda a, b: kdsl.ops.add_rms_norm(a, b, weight, 1e-5)[0] * 2, fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(x, residual), kdsl.ops.add_rms_norm(x, residual, weight, 1e-5)[0] * 2)


def test_registry_serves_them():
    assert kdsl.registry.select("add_rms_norm", arch="sm_80").name.startswith("add_rms_norm__")
    assert kdsl.registry.select("add_rms_norm_quant", arch="sm_90").name.startswith("add_rms_norm_quant__")
    with pytest.raises(kdsl.registry.NoKernelError):
        kdsl.registry.select("add_rms_norm_quant", arch="sm_80")  # no e4m3 stores before sm_89


# --- kdsl.nn

def rms_norm_module(hidden, dtype, device, **kwargs) -> kdsl.nn.RMSNorm:
    norm = kdsl.nn.RMSNorm(hidden, 1e-5, dtype=dtype, device=device, **kwargs)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(hidden, dtype, device))
    return norm


def test_norm_forward_add(device):
    x, residual, _ = inputs((3, 512), torch.bfloat16, device, seed=11)
    norm = rms_norm_module(512, torch.bfloat16, device)
    y, h = norm.forward_add(x, residual)
    assert torch.equal(h, x + residual) and torch.equal(y, norm(x + residual))
    q, s, h = norm.forward_add_quantized(x, residual, 128)
    q_ref, s_ref = norm.forward_quantized(x + residual, 128)
    assert torch.equal(h, x + residual) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    # A round_normalized weight of another dtype than x: torch's add, then the norm as forward applies the weight.
    other = rms_norm_module(512, torch.float32, device, round_normalized=True)
    y, h = other.forward_add(x, residual)
    assert torch.equal(h, x + residual) and torch.equal(y, other(x + residual))


def test_fp8_linear_forward_add_normed(device, launched):
    """FP8Linear.forward_add_normed(x, residual, kdsl.nn.RMSNorm) is fp8_gemm on add_rms_norm_quant's codes (no
    act_quant, no separate add or norm launch): forward_normed of x + residual, and x + residual."""
    x, residual, _ = inputs((3, 512), torch.bfloat16, device, seed=12)
    norm = rms_norm_module(512, torch.bfloat16, device)
    linear = fp8_linear(512, 256, device)
    launched.clear()
    y, h = linear.forward_add_normed(x, residual, norm)
    if launched:
        assert [name.split("__")[0] for name in launched] == ["add_rms_norm_quant", "fp8_gemm"], launched
    assert torch.equal(h, x + residual) and torch.equal(y, linear.forward_normed(x + residual, norm))
    torch_norm = torch.nn.RMSNorm(512, eps=1e-5, dtype=torch.bfloat16, device=device).requires_grad_(False)
    y, h = linear.forward_add_normed(x, residual, torch_norm)
    assert torch.equal(h, x + residual) and torch.equal(y, linear(torch_norm(x + residual)))


def test_w4a16_linear_forward_add_normed(device):
    x, residual, _ = inputs((2, 256), torch.float16, device, seed=14)
    norm = rms_norm_module(256, torch.float16, device)
    w4 = kdsl.nn.W4A16Linear.from_float(torch.nn.Linear(256, 128, bias=False, dtype=torch.float16).to(device))
    y, h = w4.forward_add_normed(x, residual, norm)
    assert torch.equal(h, x + residual) and torch.equal(y, w4(norm(x + residual)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
@pytest.mark.parametrize("hidden", [4096, 7168, 8192])  # Llama-3-8B, DeepSeek-V3, Llama-3-70B
def test_gpu_model_shapes(m, hidden):
    for dtype in (torch.float16, torch.bfloat16):
        x, residual, weight = inputs((m, hidden), dtype, "cuda", seed=m)
        y, h = kdsl.ops.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(h, summed(x, residual)) and torch.equal(y, kdsl.ops.rms_norm(h, weight, 1e-5))
        q, s, h = kdsl.ops.add_rms_norm_quant(x, residual, weight, 1e-5)
        q_two, s_two = kdsl.ops.rms_norm_quant(h, weight, 1e-5)
        assert torch.equal(h, summed(x, residual))
        assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8)) and torch.equal(s, s_two)
        check_dequantized(q, s, h, weight, 1e-5, False)
