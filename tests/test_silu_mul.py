"""kdsl.ops.silu_mul and silu_mul_quant (the gated MLP's activation, issue 45) against references written here
from the maths: h = silu(gate) * up in float64 rounded to fp32, then act_quant_ref (tests/reference.py) or a cast.

Each test runs on the generated kernels in Triton's interpreter (CPU tensors, as conftest sets it up), on kdsl's
torch fallback (interpreter off), and, marked gpu, on CUDA (KDSL_TEST_GPU=1 python -m pytest -m gpu
tests/test_silu_mul.py). h in fp32 is a few ulps from the float64 reference on every path (exp and the division
round), so the comparisons allow what a few ulps of h can change: one step of the output dtype, the neighbouring
e4m3 code where h sits on a rounding boundary, a scale a few fp32 ulps off.
"""
from __future__ import annotations

import re

import pytest
import torch
from conftest import interpreting, kernel_paths
from reference import FP8, assert_group_codes

import kdsl

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One unit in the last place of each dtype, relative to the value (bf16: 8 significant bits, fp16: 11).
# fp32: h itself is a few ulps off on every path
RELATIVE_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
# Below about the smallest normal, h may come out 0: exp(-gate) overflows fp32 for gate < -88 on every path.
TINY = {torch.bfloat16: 1e-37, torch.float16: 6e-8, torch.float32: 1e-37}


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 h = silu(gate) * up, gate_up's first half then its second: in float64, rounded once to fp32."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].double(), gate_up[..., inter:].double()
    return (gate / (1.0 + torch.exp(-gate)) * up).float()


# The kernels in the interpreter, the torch fallback, and CUDA; only silu_mul's and act_quant's launched.
device = kernel_paths(("silu_mul", "act_quant"))


def activations(shape, dtype, device, seed=0) -> torch.Tensor:
    """gate_up as a GEMM leaves it: normal values with a few outliers."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3.0
    if x.numel():
        x.view(-1)[::97] *= 20.0
    return x.to(dtype).to(device)


def check_h(h: torch.Tensor, gate_up: torch.Tensor):
    """h is the reference rounded to gate_up's dtype, to within one unit in its last place (the interpreter
    truncates fp32 -> bf16, and a few ulps of fp32 h move a value across a rounding boundary)."""
    ref = silu_mul_ref(gate_up.cpu())
    assert h.dtype == gate_up.dtype and h.shape == ref.shape and h.is_contiguous()
    got = h.cpu().float()
    assert torch.equal(got.isnan(), ref.isnan())
    ref = torch.where(ref.abs() > torch.finfo(h.dtype).max, ref * torch.inf, ref)  # past the dtype's range: +-inf
    finite = ref.isfinite()
    assert torch.equal(got[~finite & ~ref.isnan()], ref[~finite & ~ref.isnan()])  # +-inf where the reference's
    error = (got - ref)[finite].abs()
    relative = RELATIVE_ULP[h.dtype]
    if h.dtype == torch.float32 and h.device.type == "cuda":
        # The GPU's exp is exp2(gate * log2(e)) on an approximate exp2: the product's rounding, |gate| * 2^-24 at
        # most, becomes exp's relative error, and h's when gate is very negative (h ~ gate * exp(gate)).
        gate = gate_up[..., : gate_up.shape[-1] // 2].cpu().float().abs()[finite]
        relative = relative + gate * 2.0 ** -22
    bound = relative * ref[finite].abs() * 1.001 + TINY[h.dtype]
    assert (error <= bound).all(), f"{int((error > bound).sum())} of {error.numel()} values over one ulp"


def check_quant(q: torch.Tensor, s: torch.Tensor, gate_up: torch.Tensor, group: int = 128):
    """q, s are act_quant_ref of the reference h (reference.assert_group_codes: scales within a few fp32 ulps, codes
    equal or the neighbouring code, NaN codes where act_quant's rule puts them); a group holding an inf codes its
    finite elements 0."""
    h = silu_mul_ref(gate_up.cpu())
    q, s = q.cpu(), s.cpu()
    assert_group_codes(q, s, h, group, scale_rtol=1e-6, off_by_one_share=2e-3)
    element_group = s.isinf().repeat_interleave(group, -1)
    assert q.float()[element_group & h.isfinite()].eq(0).all()


# ---------------------------------------------------------------------------------------------
# values

@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 512), (9, 768), (2, 3, 256)], ids=["decode", "rows", "3d"])
def test_silu_mul_quant_matches_reference(device, shape, dtype):
    gate_up = activations(shape, dtype, device)
    q, s = kdsl.ops.silu_mul_quant(gate_up)
    assert q.device.type == s.device.type == device.type
    check_quant(q, s, gate_up)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 512), (9, 2 * 300), (2, 3, 256), (5, 2)], ids=["decode", "ragged", "3d", "I=1"])
def test_silu_mul_matches_reference(device, shape, dtype):
    gate_up = activations(shape, dtype, device)
    h = kdsl.ops.silu_mul(gate_up)
    assert h.device.type == device.type
    check_h(h, gate_up)


def test_the_same_h_either_way(device):
    """silu_mul_quant(gate_up) quantizes what silu_mul(gate_up) would have kept in fp32: on fp32 inputs, act_quant
    of silu_mul's output gives the same codes and scales (both round h once, from the same fp32 arithmetic)."""
    gate_up = activations((4, 512), torch.float32, device, seed=3)
    q, s = kdsl.ops.silu_mul_quant(gate_up)
    q2, s2 = kdsl.ops.act_quant(kdsl.ops.silu_mul(gate_up))
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_strided_inputs(device):
    """A column slice of a wider tensor (row stride over 2I: read in place), a transposed one and every other
    token of a batch (copied into rows first)."""
    big = activations((6, 1024), torch.bfloat16, device, seed=4)
    sliced = big[:, 256:768]
    check_quant(*kdsl.ops.silu_mul_quant(sliced), sliced)
    check_h(kdsl.ops.silu_mul(sliced), sliced)
    transposed = activations((256, 5), torch.float16, device, seed=5).T
    check_quant(*kdsl.ops.silu_mul_quant(transposed), transposed)
    check_h(kdsl.ops.silu_mul(transposed), transposed)
    every_other = activations((3, 6, 512), torch.float32, device, seed=6)[:, ::2]
    check_quant(*kdsl.ops.silu_mul_quant(every_other), every_other)
    check_h(kdsl.ops.silu_mul(every_other), every_other)


def test_all_zero_group(device):
    """A group of h that is all zeros (up = 0, or a whole token of zeros) gets act_quant's finite floor scale and
    zero codes, never NaN."""
    gate_up = activations((4, 512), torch.bfloat16, device, seed=7)
    gate_up[:, 256 + 128:] = 0  # up's second group: h's second group is 0 on every row
    gate_up[2] = 0
    q, s = kdsl.ops.silu_mul_quant(gate_up)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q[:, 128:].float() == 0).all() and (q[2].float() == 0).all()
    check_quant(q, s, gate_up)


# (row, column, value) of special elements of gate_up [3, 512] (I = 256: gate is columns 0-255, up 256-511).
SPECIALS = {
    "nan_gate": [(0, 5, NAN)],                               # h NaN: left out of its group's amax, coded NaN
    "nan_up": [(1, 256 + 140, NAN)],
    "inf_up": [(1, 256 + 3, INF), (1, 3, 2.0)],              # h = +inf: the group's scale inf, its finite codes 0
    "inf_gate": [(2, 200, INF), (2, 456, -1.5)],             # silu(inf) * -1.5 = -inf
    "minus_inf_gate": [(0, 130, -INF)],                      # silu(-inf) = -inf / inf: NaN, as in torch
    "inf_times_zero": [(2, 7, INF), (2, 256 + 7, 0.0)],      # inf * 0: NaN
    "mixed": [(0, 9, NAN), (0, 100, INF), (0, 356, 1.0)],    # a NaN and an inf in one group
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(SPECIALS))
def test_nan_and_inf_follow_act_quant(device, case, dtype):
    gate_up = activations((3, 512), torch.float32, device, seed=8)
    for row, col, value in SPECIALS[case]:
        gate_up[row, col] = value
    gate_up = gate_up.to(dtype)
    h = silu_mul_ref(gate_up.cpu())
    assert not h.isfinite().all(), "the case makes no special value of h"
    q, s = kdsl.ops.silu_mul_quant(gate_up)
    check_quant(q, s, gate_up)
    check_h(kdsl.ops.silu_mul(gate_up), gate_up)


@pytest.mark.parametrize("shape", [(0, 256), (3, 0), (2, 0, 512), (0, 0)])
def test_empty(device, shape):
    gate_up = torch.empty(shape, dtype=torch.bfloat16, device=device)
    h = kdsl.ops.silu_mul(gate_up)
    q, s = kdsl.ops.silu_mul_quant(gate_up)
    inter = shape[-1] // 2
    assert h.shape == (*shape[:-1], inter) and h.dtype == torch.bfloat16
    assert q.shape == (*shape[:-1], inter) and q.dtype == FP8
    assert s.shape == (*shape[:-1], inter // 128) and s.dtype == torch.float32
    assert h.device.type == q.device.type == s.device.type == device.type


# ---------------------------------------------------------------------------------------------
# refusals: a ValueError or TypeError naming the argument, on every path, before any launch

def names(message: str, name: str) -> bool:
    return bool(re.match(rf"{re.escape(name)}\s*[:=(]", message))


@pytest.mark.parametrize("op", ["silu_mul", "silu_mul_quant"])
def test_refusals_name_the_argument(device, op):
    fn = getattr(kdsl.ops, op)
    good = activations((2, 512), torch.bfloat16, device)
    bad = {
        "an int tensor": good.to(torch.int32),
        "an fp8 tensor": good.to(FP8),
        "float64": good.double(),
        "a 0-d tensor": good[0, 0],
        "an odd width": good[:, :511],
        "not a tensor": good.tolist(),
    }
    for what, gate_up in bad.items():
        with pytest.raises((TypeError, ValueError)) as info:
            fn(gate_up)
        assert names(str(info.value), "gate_up"), f"{what}: {info.value}"
    if op == "silu_mul_quant":
        with pytest.raises(ValueError, match=r"^gate_up: .*I = 200 must be a multiple of group_size = 128"):
            fn(activations((2, 400), torch.bfloat16, device))
        for group in (100, 0, -128, 128.0):
            with pytest.raises(ValueError, match=r"^group_size: expected a positive power of two"):
                fn(good, group)
        with pytest.raises(kdsl.SchemeNotServedError, match="group_size = 64"):
            fn(good, 64)  # a power of two no generated kernel serves: refused on the fallback too
    grad = good.float().requires_grad_()
    with pytest.raises(RuntimeError, match="^gate_up: requires grad"):
        fn(grad)
    with torch.no_grad():
        fn(grad)  # grad mode off: served


# ---------------------------------------------------------------------------------------------
# torch.library and launch plans

def test_custom_ops():
    gate_up = activations((3, 512), torch.bfloat16, "cpu", seed=9)
    torch.library.opcheck(torch.ops.kdsl.silu_mul.default, (gate_up,))
    # fp8 outputs: opcheck's schema test compares them with ops torch lacks for float8 on the CPU
    torch.library.opcheck(torch.ops.kdsl.silu_mul_quant.default, (gate_up, 128),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    q, s = torch.ops.kdsl.silu_mul_quant(gate_up, 128)
    check_quant(q, s, gate_up)
    compiled = torch.compile(lambda x: kdsl.ops.silu_mul_quant(kdsl.ops.silu_mul(x).repeat(1, 2)),
                             fullgraph=True, backend="eager")
    q2, s2 = compiled(gate_up)
    q3, s3 = kdsl.ops.silu_mul_quant(kdsl.ops.silu_mul(gate_up).repeat(1, 2))
    assert torch.equal(s2, s3) and torch.equal(q2.view(torch.uint8), q3.view(torch.uint8))


def test_repeat_calls_replay_a_plan():
    """A second call of the same signature replays the first one's launches (kdsl/ops/_plan.py) and gives the
    same result into new outputs."""
    if not interpreting():
        pytest.skip("plans record the generated kernels' launches")
    gate_up = activations((5, 512), torch.float16, "cpu", seed=10)
    first = kdsl.ops.silu_mul_quant(gate_up), kdsl.ops.silu_mul(gate_up)
    assert any(key[0] == "silu_mul_quant" for key in kdsl.registry.plans)
    assert any(key[0] == "silu_mul" for key in kdsl.registry.plans)
    (q, s), h = kdsl.ops.silu_mul_quant(gate_up), kdsl.ops.silu_mul(gate_up)
    (q0, s0), h0 = first
    assert q.data_ptr() != q0.data_ptr() and h.data_ptr() != h0.data_ptr()
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0) and torch.equal(h, h0)


def test_registry_serves_both():
    assert kdsl.registry.select("silu_mul", arch="sm_80").name == "silu_mul__e4m3_w128x128_a128_f32__rowwise_sm80"
    entry = kdsl.registry.select("silu_mul_quant", kdsl.BlockFP8(), arch="sm_90")
    assert entry.name == "silu_mul_quant__e4m3_w128x128_a128_f32__rowwise_sm89"
    with pytest.raises(kdsl.NoKernelError, match="needs sm_89 or newer"):
        kdsl.registry.select("silu_mul_quant", kdsl.BlockFP8(), arch="sm_86")


# ---------------------------------------------------------------------------------------------
# GPU: the shapes of the MLPs the issue measures

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
@pytest.mark.parametrize("inter", [9216, 14336])  # DeepSeek-V3 dense I = 18432 and Llama-3-70B 28672 at TP = 2
def test_gpu_mlp_shapes(m, inter):
    gate_up = activations((m, 2 * inter), torch.bfloat16, "cuda", seed=m)
    check_quant(*kdsl.ops.silu_mul_quant(gate_up), gate_up)
    check_h(kdsl.ops.silu_mul(gate_up.half()), gate_up.half())
