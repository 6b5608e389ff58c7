"""kdsl.ops.rms_norm and kdsl.nn.RMSNorm against a reference written here from the maths: the norm in float64,
rounded once to x's dtype.

Each test runs on the generated kernel in Triton's interpreter (CPU tensors, as conftest sets it up), on kdsl's torch
fallback (interpreter off), and, marked gpu, on CUDA (KDSL_TEST_GPU=1 python -m pytest -m gpu tests/test_rms_norm.py).
The kernel sums in fp32 in its own order, so the comparisons allow one step of the output dtype (a few fp32 ulps of
the result can cross a rounding boundary; the interpreter truncates fp32 -> bf16).
"""
from __future__ import annotations

import re

import pytest
import torch
from conftest import interpreting, kernel_paths

import kdsl

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One unit in the last place of each dtype, relative to the value; fp32: the sum's rounding, a few ulps.
RELATIVE_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
TINY = {torch.bfloat16: 1e-37, torch.float16: 6e-8, torch.float32: 1e-37}


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in float64 (no rounding until the caller's; with
    round_normalized, x / rms rounded to x's dtype before the weight)."""
    xd = x.double()
    normalized = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps)
    if round_normalized:
        normalized = normalized.to(x.dtype).double()
    return normalized * weight.double()


# The kernel in the interpreter, the torch fallback, and CUDA; rms_norm's kernel the only one launched.
device = kernel_paths(("rms_norm",))


def hidden_states(shape, dtype, device, seed=0) -> torch.Tensor:
    """A residual stream: normal values with a few outliers, rows of different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 2.0
    if x.numel():
        x.view(-1)[::97] *= 30.0
        x *= torch.rand(*shape[:-1], 1, generator=g) * 4.0 + 0.01
    return x.to(dtype).to(device)


def norm_weight(hidden, dtype, device, seed=1) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def check_y(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool = False):
    """y is the reference rounded to x's dtype, to within one unit in its last place (with round_normalized, one
    more: x / rms may round the other way and the weight carries that step); NaN and inf where the reference has
    them."""
    ref = rms_norm_ref(x.cpu(), weight.cpu(), eps, round_normalized)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device and y.is_contiguous()
    got = y.cpu().double()
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ref.isfinite()
    assert torch.equal(got[~finite & ~ref.isnan()], ref[~finite & ~ref.isnan()])
    error = (got - ref)[finite].abs()
    bound = RELATIVE_ULP[y.dtype] * (2 if round_normalized else 1) * ref[finite].abs() * 1.001 + TINY[y.dtype]
    assert (error <= bound).all(), f"{int((error > bound).sum())} of {error.numel()} values over one ulp"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (5, 1000), (2, 3, 256), (17, 96)],
                         ids=["decode", "H-not-a-power-of-two", "3-d", "rows-past-a-block"])
def test_matches_reference(device, launched, shape, dtype):
    x = hidden_states(shape, dtype, device)
    weight = norm_weight(shape[-1], dtype, device)
    check_y(kdsl.ops.rms_norm(x, weight, 1e-5), x, weight, 1e-5)
    check_y(kdsl.ops.rms_norm(x, weight, 1e-5, True), x, weight, 1e-5, round_normalized=True)
    assert bool(launched) == (device.type == "cuda" or interpreting()), launched  # the kernel ran, or the fallback


def test_the_two_roundings_differ(device):
    """round_normalized is a second rounding, not the same kernel: on bf16 rows some values move by a step."""
    x = hidden_states((8, 1024), torch.bfloat16, device, seed=11)
    weight = norm_weight(1024, torch.bfloat16, device, seed=12)
    once, twice = kdsl.ops.rms_norm(x, weight, 1e-5), kdsl.ops.rms_norm(x, weight, 1e-5, True)
    assert not torch.equal(once, twice)
    check_y(once, x, weight, 1e-5)
    check_y(twice, x, weight, 1e-5, round_normalized=True)


def test_weight_in_another_dtype_and_eps(device):
    """A bf16 model's norm with fp32 weights, and an eps that dominates small rows."""
    x = hidden_states((4, 512), torch.bfloat16, device) * 1e-3
    weight = norm_weight(512, torch.float32, device)
    for eps in (0.0, 1e-6, 0.5):
        check_y(kdsl.ops.rms_norm(x, weight, eps), x, weight, eps)


def test_strided_rows(device):
    """A column slice (row stride past H) and a transposed view (copied to rows first): the same values."""
    base = hidden_states((6, 640), torch.float16, device, seed=3)
    weight = norm_weight(512, torch.float16, device)
    sliced = base[:, 64:576]
    check_y(kdsl.ops.rms_norm(sliced, weight), sliced, weight, 1e-6)
    transposed = hidden_states((512, 6), torch.float16, device, seed=4).t()
    check_y(kdsl.ops.rms_norm(transposed, weight), transposed, weight, 1e-6)


def test_nan_and_inf_stay(device):
    """A row with a NaN comes out all NaN, a row with an inf NaN or inf as the reference has it; other rows
    are untouched (never a number made up)."""
    x = hidden_states((4, 256), torch.float32, device, seed=5)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    weight = norm_weight(256, torch.float32, device)
    y = kdsl.ops.rms_norm(x, weight)
    assert y[1].isnan().all() and not y[2].isfinite().all()
    check_y(y, x, weight, 1e-6)


@pytest.mark.parametrize("shape", [(0, 256), (3, 0), (2, 0, 512)])
def test_empty(device, shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    y = kdsl.ops.rms_norm(x, torch.ones(shape[-1], dtype=torch.bfloat16, device=device))
    assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == device.type


def names(message: str, name: str) -> bool:
    return bool(re.match(rf"{re.escape(name)}\s*[:=(]", message))


def test_refusals_name_the_argument(device):
    x = hidden_states((2, 512), torch.bfloat16, device)
    weight = norm_weight(512, torch.bfloat16, device)
    bad_x = {"an int tensor": x.to(torch.int32), "float64": x.double(), "a 0-d tensor": x[0, 0],
             "not a tensor": x.tolist(), "a width other than the weight's": x[:, :500]}
    for what, value in bad_x.items():
        with pytest.raises((TypeError, ValueError)) as info:
            kdsl.ops.rms_norm(value, weight)
        assert names(str(info.value), "x" if "width" not in what else "weight"), f"{what}: {info.value}"
    for what, value in {"2-d": weight[None], "an int tensor": weight.to(torch.int32)}.items():
        with pytest.raises((TypeError, ValueError)) as info:
            kdsl.ops.rms_norm(x, value)
        assert names(str(info.value), "weight"), f"{what}: {info.value}"
    for eps in (-1e-6, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(ValueError, match=r"^eps: expected a finite number >= 0"):
            kdsl.ops.rms_norm(x, weight, eps)
    with pytest.raises(TypeError, match=r"^round_normalized: expected a bool"):
        kdsl.ops.rms_norm(x, weight, 1e-6, 1)
    with pytest.raises(ValueError, match=r"^x: last dimension 65544 is above 65536"):
        kdsl.ops.rms_norm(torch.zeros(1, 65544, device=device), torch.zeros(65544, device=device))
    grad = x.float().requires_grad_()
    with pytest.raises(RuntimeError, match="^x: requires grad"):
        kdsl.ops.rms_norm(grad, weight.float())
    with torch.no_grad():
        kdsl.ops.rms_norm(grad, weight.float())  # grad mode off: served


def test_module_matches_torch_rmsnorm(device):
    """kdsl.nn.RMSNorm.from_module of a torch.nn.RMSNorm (eps None: the weight dtype's finfo eps, as torch takes
    for inputs of that dtype) computes what torch's module does, to one step of the dtype."""
    norm = torch.nn.RMSNorm(384, dtype=torch.float16, device=device)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(384, torch.float16, device))
    module = kdsl.nn.RMSNorm.from_module(norm)
    assert module.eps == torch.finfo(torch.float16).eps and module.weight.data_ptr() == norm.weight.data_ptr()
    assert not module.weight.requires_grad and set(module.state_dict()) == {"weight"}
    x = hidden_states((3, 384), torch.float16, device, seed=6)
    check_y(module(x), x, norm.weight.detach(), module.eps)
    with torch.no_grad():
        expected = norm(x)
    assert ((module(x).float() - expected.float()).abs() <= 2.0 ** -10 * expected.float().abs() + 6e-8).all()


TRANSFORMERS_NORMS = sorted(kdsl.nn.norm.TRANSFORMERS_LLAMA_NORMS)


def _transformers_norm(qualified: str):
    transformers = pytest.importorskip("transformers")
    module_name, _, name = qualified.rpartition(".")
    try:
        module = __import__(module_name, fromlist=[name])
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {module_name}")
    return getattr(module, name)


@pytest.mark.parametrize("qualified", TRANSFORMERS_NORMS, ids=[q.rpartition(".")[2] for q in TRANSFORMERS_NORMS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_module_matches_each_transformers_norm(qualified, dtype):
    """Each norm the list names computes Llama's maths: the kdsl module built from it gives its output to one step
    of the dtype (the sum over the row is ordered differently), on rows of a residual stream. A norm whose maths
    changed in transformers fails here instead of being swapped silently."""
    norm = _transformers_norm(qualified)(384, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(384, dtype, "cpu"))
    module = kdsl.nn.RMSNorm.from_module(norm)
    assert module.round_normalized and module.eps == 1e-6 and module.weight.data_ptr() == norm.weight.data_ptr()
    x = hidden_states((3, 5, 384), dtype, "cpu", seed=13)
    with torch.no_grad():
        expected = norm(x)
    got = module(x)
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    step = RELATIVE_ULP[dtype] * 2 * expected.float().abs() + TINY[dtype]
    assert ((got.float() - expected.float()).abs() <= step).all()
    check_y(got, x, norm.weight.detach(), 1e-6, round_normalized=True)


def test_a_weight_of_another_dtype_is_applied_as_transformers_applies_it():
    """A float32 weight on bf16 activations: transformers returns float32 (torch's promotion); so does the module."""
    norm = _transformers_norm("transformers.models.llama.modeling_llama.LlamaRMSNorm")(256, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(256, torch.float32, "cpu"))
    x = hidden_states((4, 256), torch.bfloat16, "cpu", seed=14)
    with torch.no_grad():
        expected = norm(x)
    got = kdsl.nn.RMSNorm.from_module(norm)(x)
    assert got.dtype == expected.dtype == torch.float32
    assert ((got - expected).abs() <= 2.0 ** -7 * expected.abs() + 1e-30).all()


def test_transformers_norms_in_a_model_are_swapped():
    """swap_transformers_norms (kdsl.from_pretrained's fused_norms) replaces every Llama-family norm of a model,
    sharing weights, and the model's logits stay within a step of bf16."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    for module in model.modules():
        if kdsl.nn.norm.is_transformers_llama_norm(module):
            with torch.no_grad():
                module.weight.copy_(norm_weight(128, torch.bfloat16, "cpu", seed=15))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits.float()
    weight = model.model.norm.weight
    assert kdsl.nn.swap_transformers_norms(model) == 2 * 2 + 1
    assert type(model.model.norm) is kdsl.nn.RMSNorm and model.model.norm.weight.data_ptr() == weight.data_ptr()
    assert not any(kdsl.nn.norm.is_transformers_llama_norm(m) for m in model.modules())
    with torch.no_grad():
        got = model(ids).logits.float()
    assert ((got - expected).norm() / expected.norm()).item() < 2e-2


def test_module_refusals():
    with pytest.raises(ValueError, match="^norm: kdsl.nn.RMSNorm takes one normalized dimension"):
        kdsl.nn.RMSNorm.from_module(torch.nn.RMSNorm((4, 8)))
    with pytest.raises(ValueError, match="^norm: kdsl.nn.RMSNorm takes one normalized dimension"):
        kdsl.nn.RMSNorm.from_module(torch.nn.RMSNorm(8, elementwise_affine=False))
    with pytest.raises(TypeError, match="^norm: expected a torch.nn.RMSNorm"):
        kdsl.nn.RMSNorm.from_module(torch.nn.LayerNorm(8))
    gemma = pytest.importorskip("transformers").models.gemma.modeling_gemma.GemmaRMSNorm(8)
    with pytest.raises(TypeError, match="^norm: expected .* got transformers.models.gemma.*GemmaRMSNorm"):
        kdsl.nn.RMSNorm.from_module(gemma)  # (1 + weight), one rounding: other maths, not taken
    for size in (0, 8.0, True):
        with pytest.raises(ValueError, match="^hidden_size: expected a positive int"):
            kdsl.nn.RMSNorm(size)


def test_custom_op_and_compile():
    x = hidden_states((3, 512), torch.bfloat16, "cpu", seed=7)
    weight = norm_weight(512, torch.bfloat16, "cpu")
    torch.library.opcheck(torch.ops.kdsl.rms_norm.default, (x, weight, 1e-5, False))
    torch.library.opcheck(torch.ops.kdsl.rms_norm.default, (x, weight, 1e-5, True))
    compiled = torch.compile(lambda t: kdsl.ops.rms_norm(t, weight, 1e-5, True) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), kdsl.ops.rms_norm(x, weight, 1e-5, True) * 2)


def test_repeat_calls_replay_a_plan():
    if not interpreting():
        pytest.skip("plans record the generated kernels' launches")
    x = hidden_states((5, 512), torch.float16, "cpu", seed=8)
    weight = norm_weight(512, torch.float16, "cpu")
    first = kdsl.ops.rms_norm(x, weight, 1e-5)
    assert any(key[0] == "rms_norm" for key in kdsl.registry.plans)
    again = kdsl.ops.rms_norm(x, weight, 1e-5)
    assert again.data_ptr() != first.data_ptr() and torch.equal(again, first)
    other_eps = kdsl.ops.rms_norm(x, weight, 0.25)  # eps is part of the plan's key: not the first call's launch
    check_y(other_eps, x, weight, 0.25)
    check_y(kdsl.ops.rms_norm(x, weight, 1e-5, True), x, weight, 1e-5, round_normalized=True)  # nor the rounding


def test_registry_serves_it():
    entry = kdsl.registry.select("rms_norm", arch="sm_80")
    assert entry.name == "rms_norm__e4m3_w128x128_a128_f32__rowwise_sm80"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
@pytest.mark.parametrize("hidden", [4096, 7168, 8192])  # Llama-3-8B, DeepSeek-V3, Llama-3-70B
def test_gpu_model_shapes(m, hidden):
    for dtype in (torch.float16, torch.bfloat16):
        x = hidden_states((m, hidden), dtype, "cuda", seed=m)
        weight = norm_weight(hidden, dtype, "cuda")
        check_y(kdsl.ops.rms_norm(x, weight, 1e-5), x, weight, 1e-5)
        check_y(kdsl.ops.rms_norm(x, weight, 1e-5, True), x, weight, 1e-5, round_normalized=True)
