"""kdsl.ops.rms_norm_quant (the norm quantized for the next FP8 GEMM) and the kdsl.nn paths that use it, against
references written here from the maths: the norm in float64 rounded to fp32 (test_rms_norm's rms_norm_ref), then
act_quant_ref (tests/reference.py).

Each op test runs on the generated kernel in Triton's interpreter (CPU tensors), on kdsl's torch fallback
(interpreter off), and, marked gpu, on CUDA (KDSL_TEST_GPU=1 python -m pytest -m gpu tests/test_rms_norm_quant.py).
The kernel sums in fp32 in its own order, so a few fp32 ulps of the normalized rows can move a code across a rounding
boundary: codes may be the neighbouring code, scales a few ulps off.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import interpreting, kernel_paths
from reference import FP8, assert_group_codes
from test_rms_norm import hidden_states, norm_weight, rms_norm_ref

import kdsl
from kdsl.runtime.registry import any_scheme

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RELATIVE_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
E4M3_HALF_STEP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most this, relative
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # the spacing of e4m3's subnormals, times the scale

# The kernels in the interpreter, the torch fallback, and CUDA: the norms', act_quant's (the two-op references) and
# the linears' (kdsl.nn; weight_quant builds FP8Linear). test_matches_reference checks that rms_norm_quant's
# kernel alone ran there.
device = kernel_paths(("rms_norm", "act_quant", "weight_quant", "fp8_gemm", "fp8_linear", "w4a16_gemm"))


def check_codes(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                group: int = 128):
    """q, s are act_quant_ref of the fp32 norm (reference.assert_group_codes: scales within a few fp32 ulps, codes
    equal or the neighbouring code, NaN codes exactly where the norm is NaN)."""
    y = rms_norm_ref(x.cpu(), weight.cpu(), eps).float()
    assert_group_codes(q.cpu(), s.cpu(), y, group, scale_rtol=1e-5, off_by_one_share=1e-2)


def check_dequantized(q, s, x, weight, eps, round_normalized, group: int = 128):
    """q * s is the fp32 norm to within e4m3's rounding (and, with round_normalized, one more step of x's dtype
    before the weight)."""
    y = rms_norm_ref(x.cpu(), weight.cpu(), eps, round_normalized)
    scale = s.cpu().double().repeat_interleave(group, -1)
    got = q.cpu().double() * scale
    extra = 2 * RELATIVE_ULP[x.dtype] if round_normalized else 0.0
    bound = (E4M3_HALF_STEP + extra) * y.abs() * 1.01 + E4M3_SUBNORMAL_STEP * scale
    error = (got - y).abs()
    assert (error <= bound).all(), f"{int((error > bound).sum())} of {error.numel()} values past e4m3's rounding"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (5, 896), (2, 3, 256), (17, 128)],
                         ids=["decode", "H-not-a-power-of-two", "3-d", "one-group"])
def test_matches_reference(device, launched, shape, dtype):
    x = hidden_states(shape, dtype, device)
    weight = norm_weight(shape[-1], dtype, device)
    q, s = kdsl.ops.rms_norm_quant(x, weight, 1e-5)
    assert q.device.type == s.device.type == device.type
    check_codes(q, s, x, weight, 1e-5)
    check_dequantized(q, s, x, weight, 1e-5, False)
    q, s = kdsl.ops.rms_norm_quant(x, weight, 1e-5, round_normalized=True)
    check_dequantized(q, s, x, weight, 1e-5, True)
    assert bool(launched) == (device.type == "cuda" or interpreting()), launched  # the kernel ran, or the fallback
    assert all(name.startswith("rms_norm_quant__") for name in launched), launched


def test_the_same_codes_as_act_quant_of_the_fp32_norm(device):
    """On fp32 rows rms_norm keeps the norm unrounded, so act_quant of it is what rms_norm_quant computes in one
    pass: the same codes and scales, bit for bit, on each path."""
    x = hidden_states((6, 1024), torch.float32, device, seed=21)
    weight = norm_weight(1024, torch.float32, device, seed=22)
    for round_normalized in (False, True):
        q, s = kdsl.ops.rms_norm_quant(x, weight, 1e-5, round_normalized=round_normalized)
        q_two, s_two = kdsl.ops.act_quant(kdsl.ops.rms_norm(x, weight, 1e-5, round_normalized))
        assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8)) and torch.equal(s, s_two)


def test_nan_and_inf(device):
    """A NaN in x makes its row's codes NaN; an inf makes its element NaN (inf * 0) and the rest of the row 0, as
    the norm itself has them; other rows are untouched."""
    x = hidden_states((4, 256), torch.float32, device, seed=5)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    weight = norm_weight(256, torch.float32, device)
    q, s = kdsl.ops.rms_norm_quant(x, weight)
    assert q[1].float().isnan().all() and q[2, 9].float().isnan() and (q[2].float().nan_to_num(0.0) == 0).all()
    check_codes(q, s, x, weight, 1e-6)


@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 512)])
def test_empty(device, shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    q, s = kdsl.ops.rms_norm_quant(x, torch.ones(shape[-1], dtype=torch.bfloat16, device=device))
    assert q.shape == x.shape and q.dtype == FP8 and s.shape == (*shape[:-1], shape[-1] // 128)


def test_refusals_name_the_argument(device):
    x = hidden_states((2, 512), torch.bfloat16, device)
    weight = norm_weight(512, torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"^group_size\b"):
        kdsl.ops.rms_norm_quant(x, weight, 1e-6, 96)
    with pytest.raises(ValueError, match=r"^x: last dimension 320 must be a multiple of group_size = 128"):
        kdsl.ops.rms_norm_quant(x[:, :320], weight[:320])
    with pytest.raises(ValueError, match=r"^weight\b"):
        kdsl.ops.rms_norm_quant(x, weight[:256])
    with pytest.raises(ValueError, match=r"^eps: expected a finite number >= 0"):
        kdsl.ops.rms_norm_quant(x, weight, float("nan"))
    with pytest.raises(TypeError, match=r"^x\b"):
        kdsl.ops.rms_norm_quant(x.to(torch.int32), weight)
    served = kdsl.registry.scheme_fields("rms_norm_quant")
    assert {fields["act_group"] for fields in served.values()} == {128}
    with pytest.raises(kdsl.registry.SchemeNotServedError, match="group_size = 64"):
        kdsl.ops.rms_norm_quant(x, weight, 1e-6, 64)  # a power of two no definition serves: refused by name


def test_custom_op_and_compile():
    x = hidden_states((3, 512), torch.bfloat16, "cpu", seed=7)
    weight = norm_weight(512, torch.bfloat16, "cpu")
    for round_normalized in (False, True):
        torch.library.opcheck(torch.ops.kdsl.rms_norm_quant.default, (x, weight, 1e-5, 128, round_normalized))
    compiled = torch.compile(lambda t: kdsl.ops.rms_norm_quant(t, weight, 1e-5)[1] * 2, fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(x), kdsl.ops.rms_norm_quant(x, weight, 1e-5)[1] * 2)


# --- kdsl.nn: a norm fused into an FP8Linear's input

def fp8_linear(k: int, n: int, device) -> kdsl.nn.FP8Linear:
    linear = torch.nn.Linear(k, n, bias=True, dtype=torch.float32)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
        linear.bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(4))
    return kdsl.nn.FP8Linear.from_float(linear.to(device))


def test_fp8_linear_forward_normed(device, launched):
    """forward_normed(x, kdsl.nn.RMSNorm) is fp8_gemm on rms_norm_quant's codes (no act_quant launch), the fp32
    dequantize-then-matmul of those codes within the GEMM's rounding, and within FP8's error of linear(norm(x))."""
    x = hidden_states((3, 512), torch.bfloat16, device, seed=9)
    norm = kdsl.nn.RMSNorm(512, 1e-5, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(512, torch.bfloat16, device))
    linear = fp8_linear(512, 256, device)
    launched.clear()
    y = linear.forward_normed(x, norm)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 256)
    if launched:
        assert not any(name.startswith("act_quant") for name in launched), launched
        assert any(name.startswith("rms_norm_quant") for name in launched), launched
    q, s = kdsl.ops.rms_norm_quant(x, norm.weight, 1e-5)
    check_codes(q, s, x, norm.weight, 1e-5)
    a = q.cpu().float() * s.cpu().repeat_interleave(128, -1)
    w = linear.weight.cpu().float() * linear.weight_scale_inv.cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = a @ w.T + linear.bias.cpu().float()
    torch.testing.assert_close(y.cpu().float(), ref, rtol=1e-2, atol=1e-2)
    unfused = linear(norm(x)).cpu().float()
    assert ((y.cpu().float() - unfused).norm() / unfused.norm()) < 5e-2


def test_forward_normed_runs_other_norms_as_they_are(device):
    """A norm without forward_quantized (torch's) runs first and the linear takes its output: exactly linear(norm(x));
    a W4A16Linear takes the norm's output whatever the norm."""
    x = hidden_states((2, 256), torch.bfloat16, device, seed=10)
    torch_norm = torch.nn.RMSNorm(256, eps=1e-5, dtype=torch.bfloat16, device=device).requires_grad_(False)
    linear = fp8_linear(256, 128, device)
    assert torch.equal(linear.forward_normed(x, torch_norm), linear(torch_norm(x)))
    w4 = kdsl.nn.W4A16Linear.from_float(torch.nn.Linear(256, 128, bias=False, dtype=torch.float16).to(device))
    xh = x.half()
    norm = kdsl.nn.RMSNorm(256, 1e-5, dtype=torch.float16, device=device)
    assert torch.equal(w4.forward_normed(xh, norm), w4(norm(xh)))


def test_norm_forward_quantized_with_a_weight_of_another_dtype(device):
    """transformers' norms with an fp32 weight on bf16 rows apply the weight in torch (RMSNorm.forward): the
    quantized output is act_quant of that, not a kernel of other maths."""
    x = hidden_states((2, 256), torch.bfloat16, device, seed=12)
    norm = kdsl.nn.RMSNorm(256, 1e-5, round_normalized=True, dtype=torch.float32, device=device)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(256, torch.float32, device))
    q, s = norm.forward_quantized(x, 128)
    q_ref, s_ref = kdsl.ops.act_quant(norm(x))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_registry_serves_it():
    entry = kdsl.registry.select("rms_norm_quant", arch="sm_89")
    assert entry.name == "rms_norm_quant__e4m3_w128x128_a128_f32__rowwise_sm89"
    with pytest.raises(kdsl.registry.NoKernelError):
        kdsl.registry.select("rms_norm_quant", arch="sm_80")  # no e4m3 stores before sm_89


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
@pytest.mark.parametrize("hidden", [4096, 7168, 8192])  # Llama-3-8B, DeepSeek-V3, Llama-3-70B
def test_gpu_model_shapes(m, hidden):
    for dtype in (torch.float16, torch.bfloat16):
        x = hidden_states((m, hidden), dtype, "cuda", seed=m)
        weight = norm_weight(hidden, dtype, "cuda")
        q, s = kdsl.ops.rms_norm_quant(x, weight, 1e-5)
        check_codes(q, s, x, weight, 1e-5)
        check_dequantized(q, s, x, weight, 1e-5, False)
        q, s = kdsl.ops.rms_norm_quant(x, weight, 1e-5, round_normalized=True)
        check_dequantized(q, s, x, weight, 1e-5, True)


@pytest.mark.parametrize("columns", [128, 256, 1024])
@pytest.mark.parametrize("where", ["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_row_spread_over_programs_gives_the_same_codes(where, columns):
    """A tile with options.columns (several programs per row, each reading the row whole for its mean square) writes
    what whole-row programs write, bit for bit: the same sum in the same order, the same groups. (The generated
    kernel's paths only: the torch fallback has no tiles.)"""
    if where == "interpreter" and not interpreting():
        pytest.skip("Triton's interpreter is off")
    device = torch.device("cpu" if where == "interpreter" else "cuda")
    x = hidden_states((3, 896), torch.bfloat16, device, seed=13)
    weight = norm_weight(896, torch.bfloat16, device)
    entry = kdsl.registry.dispatch("rms_norm_quant", any_scheme("rms_norm_quant"), device)
    whole = dict(entry.tile_for(3), columns=None)
    outputs = []
    for tile in (whole, dict(whole, columns=columns)):
        q = torch.empty(x.shape, dtype=FP8, device=device)
        s = torch.empty(3, 7, dtype=torch.float32, device=device)
        entry.launch(x, weight, q, s, 1e-5, False, tile)
        outputs.append((q.view(torch.uint8), s))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    check_codes(outputs[1][0].view(FP8), outputs[1][1], x, weight, 1e-5)


@pytest.mark.parametrize("columns", [96, 64])
def test_columns_that_split_a_group_are_refused(tmp_path, columns):
    """options.columns must cover whole act groups in a power of two: the definition is refused naming the field."""
    from kdsl.schema import DefinitionError, load_definition

    text = (Path(__file__).parents[1] / "kernel_defs" / "rms_norm.toml").read_text()
    text += f"""
[[variants]]
op = "rms_norm_quant"
impl = "rowwise"
min_arch = "sm_90"
tiles = [{{ block_m = 1, num_warps = 4, options = {{ columns = {columns} }} }}]
"""
    path = tmp_path / "norms.toml"
    path.write_text(text)
    with pytest.raises(DefinitionError, match=rf"norms.toml.*tiles\[0\]\.options\.columns: {columns} is not a power "
                                              "of two that is a multiple of the act group 128"):
        load_definition(path)
