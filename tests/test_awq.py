"""AWQ ("gemm" checkpoints): the ops against an integer reference written here, apart from kdsl's unpacking.

The reference packs random integer weights and zeros the way AutoAWQ does (nibble i of word j
holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]) and dequantizes them in fp32. CPU tensors run
the generated w4a16 kernels through Triton's interpreter, and the torch fallback without it.
"""
import pytest
import torch

import kdsl

AUTOAWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
K, N = 256, 80


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 16) -> int32 [R, C / 8], AutoAWQ's packing, one nibble at a time."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for nibble, column in enumerate(AUTOAWQ_ORDER):
            words[:, j] |= values[:, 8 * j + column].long() << (4 * nibble)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def checkpoint(group_size: int, dtype=torch.float16):
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(0, 16, (K // group_size, N))
    scales = (torch.rand(K // group_size, N) * 0.02 + 0.001).to(dtype)
    groups = torch.arange(K) // group_size
    w = (q - zeros[groups]).double() * scales.double()[groups]  # [K, N], exact
    return pack_awq(q), pack_awq(zeros), scales, w


@pytest.fixture(params=[True, False], ids=["kernels", "fallback"])
def path(request, monkeypatch):
    if not request.param:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequant_matches_the_integer_reference(group_size, path):
    qweight, qzeros, scales, w = checkpoint(group_size)
    out = kdsl.ops.awq_dequant(qweight, qzeros, scales, group_size=group_size)
    assert out.shape == (N, K) and out.dtype == torch.float16
    assert torch.equal(out, w.T.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gemm_and_prepared_gemm_match_fp32(group_size, dtype, path):
    qweight, qzeros, scales, w = checkpoint(group_size, dtype)
    prepared = kdsl.ops.awq_prepare(qweight, qzeros, scales, group_size=group_size)
    assert prepared.scheme == f"w4a16.int4.g{group_size}" and prepared.source == "awq"
    for m in (1, 5, 33):
        x = torch.randn(m, K).to(dtype)
        ref = x.double() @ w
        tol = 2e-2 * ref.norm()
        assert (kdsl.ops.awq_gemm(x, qweight, qzeros, scales, group_size=group_size).double() - ref).norm() < tol
        assert (kdsl.ops.w4a16_gemm(x, prepared).double() - ref).norm() < tol
    y = kdsl.ops.w4a16_gemm(torch.randn(2, 3, K).to(dtype), prepared)
    assert y.shape == (2, 3, N) and y.dtype == dtype


def test_prepared_awq_runs_the_kernels_prepared_gptq_runs(launched):
    qweight, qzeros, scales, _ = checkpoint(128)
    x = torch.randn(3, K).half()
    kdsl.ops.w4a16_gemm(x, kdsl.ops.awq_prepare(qweight, qzeros, scales))
    gptq = kdsl.ops.gptq_quantize(torch.randn(N, K).half())
    kdsl.ops.gptq_gemm(x, kdsl.ops.gptq_prepare(gptq["qweight"], gptq["qzeros"], gptq["scales"]))
    assert len(launched) == 2 and launched[0] == launched[1] and launched[0].startswith("w4a16_gemm__int4_g128__")


BAD = [
    (lambda q, z, s: dict(qweight=q.float()), TypeError, "qweight: expected dtype int32"),
    (lambda q, z, s: dict(qzeros=z[:, :-1]), ValueError, r"qzeros: expected shape \(2, 10\)"),
    (lambda q, z, s: dict(scales=s[:1]), ValueError, r"scales: expected shape \(2, 80\)"),
    (lambda q, z, s: dict(scales=s.float()), TypeError, "scales: expected dtype float16 or bfloat16"),
    (lambda q, z, s: dict(group_size=96), ValueError, "group_size: expected a power of two"),
    (lambda q, z, s: dict(group_size=16), kdsl.SchemeNotServedError, "AWQ group_size = 16 selects scheme w4a16.int4.g16"),
]


@pytest.mark.parametrize("change, error, message", BAD, ids=[b[2][:24] for b in BAD])
@pytest.mark.parametrize("op", ["awq_dequant", "awq_prepare", "awq_gemm"])
def test_bad_inputs_are_named_the_same_on_every_op(op, change, error, message, path):
    qweight, qzeros, scales, _ = checkpoint(128)
    args = dict(qweight=qweight, qzeros=qzeros, scales=scales, group_size=128)
    args.update(change(qweight, qzeros, scales))
    call = getattr(kdsl.ops, op)
    if op == "awq_gemm":
        args["x"] = torch.randn(2, K).half()
    with pytest.raises(error, match=message):
        call(**args)


def test_gemm_names_x_with_the_wrong_k():
    qweight, qzeros, scales, _ = checkpoint(128)
    with pytest.raises(ValueError, match=r"x: expected K = 256"):
        kdsl.ops.awq_gemm(torch.randn(2, 128).half(), qweight, qzeros, scales)


def test_scheme_from_hf():
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    scheme = kdsl.scheme_from_hf(config)
    assert scheme == kdsl.AWQ(bits=4, group_size=128, zero_point=True) and scheme.name == "awq.int4.g128"
    assert kdsl.scheme_from_hf({**config, "version": "GEMM"}).group_size == 128
    symmetric = kdsl.scheme_from_hf({**config, "zero_point": False})  # GPTQModel's default AWQ
    assert symmetric.zero_point is False and symmetric.name == "awq.int4.g128.sym"
    for key, value, message in (("version", "gemv", "version = 'gemv' is not supported"),
                                ("backend", "llm-awq", "backend = 'llm-awq' is not supported"),
                                ("bits", 8, "bits = 8 is not supported"),
                                ("group_size", -1, "group_size = -1 must be a power of two")):
        with pytest.raises(ValueError, match=message):
            kdsl.scheme_from_hf({**config, key: value})
    with pytest.raises(kdsl.SchemeNotServedError, match=r"w4a16\.int4\.g16"):
        kdsl.scheme_from_hf({**config, "group_size": 16})


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [32, 128])
def test_prepared_awq_on_the_gpu(group_size):
    """The GPU's w4a16 kernels (k_planes on sm_90: GEMVs at M <= 8, MMAs above) on AWQ weights."""
    qweight, qzeros, scales, w = checkpoint(group_size)
    prepared = kdsl.ops.awq_prepare(qweight.cuda(), qzeros.cuda(), scales.cuda(), group_size=group_size)
    for m in (1, 4, 16, 64, 300):
        x = torch.randn(m, K).half()
        ref = x.double() @ w
        y = kdsl.ops.w4a16_gemm(x.cuda(), prepared).cpu().double()
        assert (y - ref).norm() < 2e-2 * ref.norm(), m
