"""NaN and inf through the block-FP8 quantizers and GEMM (the rule in kdsl.ops.act_quant's docstring).

A group's amax leaves NaN elements out; a NaN element's code is NaN (byte 0x7F) and the rest of
its group is quantized as if it were absent. A group holding +-inf gets scale +inf, NaN codes for
its infs (inf / inf) and 0 for the rest. In fp8_gemm a NaN code makes every output that reads it
NaN, an inf scale every output that reads it non-finite; the other outputs are unaffected.

Each test runs three ways: the generated kernels in Triton's interpreter (CPU tensors, as conftest
sets it up), kdsl's torch fallback (CPU, interpreter off), and the kernels on CUDA (marked gpu:
KDSL_TEST_GPU=1 python -m pytest tests/test_nan_inf.py -m gpu).
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import kernel_paths
from reference import BLOCK, GROUP, act_quant_ref, expand_block_scales, fp8_gemm_ref, rel_fro_error, weight_quant_ref

import kdsl
from kdsl import registry
from kdsl.ops._checks import use_kernels

# inf / inf and inf * 0 are the point here: numpy (the interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")
NAN_CODE = 0x7F


# The generated kernels in the interpreter, the torch fallback, and CUDA: one of them launched, or (fallback) none.
device = kernel_paths(must_launch=True)


def with_specials(shape, specials, device, dtype):
    """Random values with x[row, col] = value for each (row, col, value) in specials."""
    x = torch.randn(*shape, device=device) * 3.0
    for row, col, value in specials:
        x[row, col] = value
    return x.to(dtype)


def check_quant(q, s, x, ref, element_scales):
    """q and s by the rule: the reference quantizer's on x with its NaNs as 0 (torch's arithmetic gives
    its inf groups scale inf, NaN codes for inf / inf and 0 codes), plus NaN codes where x is NaN."""
    q_ref, s_ref = ref(torch.where(x.isnan(), 0.0, x))
    codes, nan = q.float(), q_ref.float().isnan() | x.isnan()
    assert torch.equal(s, s_ref)
    assert torch.equal(codes.isnan(), nan)
    assert (q.view(torch.uint8)[nan] == NAN_CODE).all()
    assert torch.equal(codes[~nan], q_ref.float()[~nan])
    # The same, spelled out for the groups that hold inf (element_scales: each element's group scale).
    in_inf_group = element_scales(s).isinf()
    assert in_inf_group[x.isinf()].all()
    assert codes[in_inf_group & x.isfinite()].eq(0).all() and codes[in_inf_group & ~x.isfinite()].isnan().all()


# (row, column, value) of the special elements. x [3, 256]: two groups of 128 per row.
ACT_CASES = {
    "nan": [(1, 5, NAN)],
    "inf": [(1, 130, INF), (1, 200, -INF), (2, 7, -INF)],
    "nan_and_inf": [(0, 9, NAN), (0, 100, INF)],
}
# w [200, 260]: 2 x 3 blocks of 128 x 128, the last row and column of blocks partial.
WEIGHT_CASES = {
    "nan": [(3, 4, NAN)],
    "inf": [(150, 10, INF), (130, 100, -INF), (20, 259, -INF)],
    "nan_and_inf": [(3, 4, NAN), (100, 50, INF)],
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@DTYPES
@pytest.mark.parametrize("case", ACT_CASES)
def test_act_quant(case, dtype, device):
    x = with_specials((3, 256), ACT_CASES[case], device, dtype)
    q, s = kdsl.ops.act_quant(x)
    assert s.isfinite().all() == (case == "nan")
    check_quant(q, s, x, act_quant_ref, lambda s: s.repeat_interleave(GROUP, -1))


@DTYPES
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_weight_quant(case, dtype, device):
    w = with_specials((200, 260), WEIGHT_CASES[case], device, dtype)
    q, s = kdsl.ops.weight_quant(w)
    assert s.isfinite().all() == (case == "nan")
    check_quant(q, s, w, weight_quant_ref, lambda s: expand_block_scales(s, *w.shape))


# ---------------------------------------------------------------------------------------------
# fp8_gemm on operands from the quantizers: what to poison before quantizing (x [M, K], w [N, K]) or
# after (a_s), where (row -1: the last) and with what.
GEMM_CASES = {
    "nan_in_x": ("x", (-1, 130), NAN),  # a NaN code in a's last row: that output row is NaN
    "inf_in_x": ("x", (-1, 130), INF),  # that row's a_s inf, its codes 0 and NaN: the row is non-finite
    "nan_in_w": ("w", (70, 200), NAN),  # a NaN code in b's row 70: output column 70 is NaN
    "inf_in_w": ("w", (140, 10), INF),  # b_s inf for b's rows 128-255: those output columns non-finite
    "inf_in_a_s": ("a_s", (-1, 1), INF),  # an inf scale over finite codes: the row is non-finite
}
def gemm_operands(m, n, k, poison, device):
    name, index, value = poison
    inputs = dict(x=torch.randn(m, k, device=device) * 3.0, w=torch.randn(n, k, device=device))
    if name in inputs:
        inputs[name][index] = value
    (a, a_s), (b, b_s) = kdsl.ops.act_quant(inputs["x"]), kdsl.ops.weight_quant(inputs["w"])
    if name == "a_s":
        a_s[index] = value
    return a, a_s, b, b_s


def poisoned_outputs(poison, m, n, device):
    """The outputs that read the poisoned value: a row of C for x or a_s, a column for a NaN in w,
    a weight block's columns for an inf in w (its scale)."""
    name, (i, _), value = poison
    bad = torch.zeros(m, n, dtype=torch.bool, device=device)
    if name != "w":
        bad[i] = True
    elif math.isnan(value):
        bad[:, i] = True
    else:
        bad[:, i // BLOCK[0] * BLOCK[0]:(i // BLOCK[0] + 1) * BLOCK[0]] = True
    return bad


def gemm_runs(device):
    """(arch or None for the device's own, M, N) to run through kdsl.ops.fp8_gemm."""
    if device.type == "cpu":
        if not use_kernels(device):
            return [(None, 4, 256), (None, 1, 256)]
        return [("sm_89", 4, 256), ("sm_90", 4, 256), ("sm_90", 1, 256)]
    return [(None, m, n) for m in (1, 64, 512) for n in (256, 4096)]


@pytest.mark.parametrize("case", GEMM_CASES)
def test_fp8_gemm(case, device, monkeypatch):
    poison = GEMM_CASES[case]
    for arch, m, n in gemm_runs(device):
        if arch:
            monkeypatch.setenv(registry.FORCE_ARCH_ENV, arch)
            registry.reset()
        operands = gemm_operands(m, n, 256, poison, device)
        c = kdsl.ops.fp8_gemm(*operands).float()
        expected = fp8_gemm_ref(*operands)
        bad = poisoned_outputs(poison, m, n, device)
        where = f"{arch or device}, M={m}, N={n}"
        assert torch.equal(~expected.isfinite(), bad), "the reference disagrees with the rule"
        assert (c[bad].isnan() if math.isnan(poison[2]) else ~c[bad].isfinite()).all(), where
        assert c[~bad].isfinite().all(), where
        assert rel_fro_error(c[~bad], expected[~bad]) < 1e-2, where


def test_weight_dequant_keeps_a_nan_code_nan(device):
    w = torch.randn(200, 260, device=device)
    w[70, 200] = NAN
    q, s = kdsl.ops.weight_quant(w)
    out = kdsl.ops.weight_dequant(q, s, out_dtype=torch.float32)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[70, 200] = True
    assert torch.equal(out.isnan(), nan)
