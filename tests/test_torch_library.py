"""kdsl's ops as torch.library custom ops (their specs in kdsl/ops/<family>.py, registered by kdsl/ops/library.py),
and torch.compile over them.

- torch.library.opcheck on every op (schema, fake kernel against the real outputs' sizes, strides and
  dtypes, autograd registration, AOT dispatch with dynamic shapes), through Triton's interpreter and
  through the torch fallback, plus our own check that no op mutates or aliases its inputs.
- Routing: eagerly the public functions call the implementations without the dispatcher; under
  torch.compile the graph holds the torch.ops.kdsl ops.
- torch.compile(fullgraph=True, dynamic=True) of two blocks, silu(fp8_gemm(*act_quant(x), b, b_s))
  and an elementwise op on w4a16_gemm(x, prepared), with the eager, aot_eager and inductor backends:
  one graph for several M (no recompile), outputs equal to eager calls (the same kernels run).
- Every public op, compiled alone, equals its eager call; bad arguments raise the eager message.
- On a GPU (marked gpu): the same blocks under mode="reduce-overhead" (CUDA graphs) on "cuda".
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import interpreting

import kdsl
import reference_gptq as ref
from kdsl import ops
from kdsl.ops import library
from kdsl.ops.w4a16 import prepared_args

FP8 = torch.float8_e4m3fn
# torch's own schema check (SchemaCheckMode) compares inputs before and after with torch.allclose, which has
# no CPU kernel for float8_e4m3fn: for ops that take fp8 tensors, test_schema is replaced by assert_functional.
WITHOUT_SCHEMA_CHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(params=["kernels", "fallback"])
def path(request, monkeypatch):
    """kernels: the generated kernels in Triton's interpreter; fallback: kdsl's torch fallback."""
    if request.param == "fallback":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif not interpreting():
        pytest.skip("Triton's interpreter is off (a GPU run): CPU tensors take the fallback")
    return request.param


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def use_layout(monkeypatch, layout: str):
    """Select the w4a16 variant that reads this prepared layout (as tests/test_gptq_prepare.py does)."""
    monkeypatch.setenv("KDSL_ARCH", {"checkpoint": "sm_89", "k_planes": "sm_90"}[layout])
    kdsl.registry.reset()


def fp8_weights(n=72, k=256):
    w = torch.randn(n, k, dtype=torch.bfloat16)
    return ops.weight_quant(w)


def gptq_checkpoint(group_size=64, g_idx="perm", fmt="gptq", k=256, n=40):
    return ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)


def prepared_weights(group_size=64, g_idx="perm"):
    ck = gptq_checkpoint(group_size, g_idx)
    return ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size)


def awq_checkpoint(group_size=64, k=256, n=80, dtype=torch.float16):
    """Random AWQ tensors: any int32 words are valid packed nibbles."""
    g = k // group_size
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (g, n // 8), dtype=torch.int32)
    scales = (torch.rand(g, n) * 0.02 + 0.001).to(dtype)
    return qweight, qzeros, scales


# ---------------------------------------------------------------------------------------------
# opcheck: one sample per line, (op name, id, arguments as torch.ops.kdsl.<op> takes them)

def _samples():
    def act_quant_strided():
        return (torch.randn(256, 5).T, 128)  # [5, 256], column stride 5

    def fp8(m_shape, n=72, k=256, out=torch.bfloat16):
        b, b_s = fp8_weights(n, k)
        a, a_s = ops.act_quant(torch.randn(*m_shape, k, dtype=torch.bfloat16))
        return (a, a_s, b, b_s, out)

    def linear(m_shape, n=72, k=256, dtype=torch.bfloat16, bias=True, out=None):
        b, b_s = fp8_weights(n, k)
        bias = torch.randn(n, dtype=dtype) if bias else None
        return (torch.randn(*m_shape, k, dtype=dtype), b, b_s, bias, out)

    def bmm(batch, m, n=128, k=256, out=torch.bfloat16):
        # a and a_s as MLA passes them: transpose(0, 1) views of [M, B, ...] tensors
        a, a_s = ops.act_quant(torch.randn(m, batch, k, dtype=torch.bfloat16))
        b, b_s = zip(*(ops.weight_quant(torch.randn(n, k)) for _ in range(batch)))
        return (a.transpose(0, 1), a_s.transpose(0, 1), torch.stack(b), torch.stack(b_s), out)

    def dequant(n, k, out):
        q, s = ops.weight_quant(torch.randn(n, k))
        return (q, s, 128, 128, out)

    def gptq_gemm(m_shape, group_size, g_idx, fmt):
        ck = gptq_checkpoint(group_size, g_idx, fmt)
        x = torch.randn(*m_shape, 256, dtype=torch.float16)
        return (x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 4, group_size, fmt)

    def gptq_dequant(group_size, g_idx, fmt):
        ck = gptq_checkpoint(group_size, g_idx, fmt)
        return (ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 4, group_size, fmt)

    def w4a16(m_shape, g_idx):
        return (torch.randn(*m_shape, 256, dtype=torch.float16), *prepared_args(prepared_weights(64, g_idx)))

    def w4a16_dequant(g_idx):
        return prepared_args(prepared_weights(64, g_idx))

    def awq(m_shape, dtype):
        qweight, qzeros, scales = awq_checkpoint(64, dtype=dtype)
        return (torch.randn(*m_shape, 256).to(dtype), qweight, qzeros, scales, 64)

    return [
        ("act_quant", "bf16-2d", lambda: (torch.randn(3, 256, dtype=torch.bfloat16), 128)),
        ("act_quant", "fp16-3d", lambda: (torch.randn(2, 3, 384, dtype=torch.float16), 128)),
        ("act_quant", "fp32-strided", act_quant_strided),
        ("act_quant", "empty-m", lambda: (torch.randn(0, 256, dtype=torch.bfloat16), 128)),
        ("weight_quant", "bf16", lambda: (torch.randn(72, 256, dtype=torch.bfloat16), 128, 128)),
        ("weight_quant", "fp32-ragged", lambda: (torch.randn(40, 200), 128, 128)),
        ("weight_dequant", "bf16", lambda: dequant(72, 256, torch.bfloat16)),
        ("weight_dequant", "fp32-ragged", lambda: dequant(40, 200, torch.float32)),
        ("fp8_gemm", "2d", lambda: fp8((3,))),
        ("fp8_gemm", "3d-fp16", lambda: fp8((2, 3), out=torch.float16)),
        ("fp8_gemm", "empty-m", lambda: fp8((0,))),
        ("fp8_linear", "2d-bias", lambda: linear((3,))),
        ("fp8_linear", "3d-fp16-no-bias", lambda: linear((2, 3), dtype=torch.float16, bias=False)),
        ("fp8_linear", "fp32-to-bf16", lambda: linear((5,), dtype=torch.float32, out=torch.bfloat16)),
        ("fp8_linear", "empty-m", lambda: linear((0,))),
        ("fp8_bmm", "mla-views", lambda: bmm(3, 5)),
        ("fp8_bmm", "fp32-empty-m", lambda: bmm(2, 0, out=torch.float32)),
        ("gptq_gemm", "act-order", lambda: gptq_gemm((3,), 64, "perm", "gptq")),
        ("gptq_gemm", "no-g_idx-v2-3d", lambda: gptq_gemm((2, 3), 128, "none", "gptq_v2")),
        ("gptq_dequant", "act-order", lambda: gptq_dequant(64, "perm", "gptq")),
        ("gptq_dequant", "no-g_idx", lambda: gptq_dequant(32, "none", "gptq_v2")),
        ("w4a16_gemm", "act-order", lambda: w4a16((3,), "perm")),
        ("w4a16_gemm", "sorted-3d", lambda: w4a16((2, 3), "none")),
        ("w4a16_gemm", "act-order-k_planes", lambda: w4a16((3,), "perm")),
        ("w4a16_gemm", "sorted-3d-k_planes", lambda: w4a16((2, 3), "none")),
        # 1024 rows: the definition's dequant_min_m, so the op dequantizes and runs torch.matmul inside
        ("w4a16_gemm", "prefill-act-order", lambda: w4a16((1024,), "perm")),
        ("w4a16_gemm", "prefill-act-order-k_planes", lambda: w4a16((1024,), "perm")),
        ("w4a16_dequant", "act-order", lambda: w4a16_dequant("perm")),
        ("w4a16_dequant", "sorted-k_planes", lambda: w4a16_dequant("none")),
        ("awq_gemm", "fp16", lambda: awq((3,), torch.float16)),
        ("awq_gemm", "bf16-k_planes", lambda: awq((5,), torch.bfloat16)),
        ("awq_dequant", "g64", lambda: awq_checkpoint(64) + (64,)),
    ]


SAMPLES = _samples()


def assert_functional(op, args):
    """What test_schema checks, also for fp8 inputs: inputs unchanged (bit for bit), outputs new and contiguous."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    out = op(*args)
    outs = out if isinstance(out, tuple) else (out,)
    for old, new in zip(before, tensors):
        assert torch.equal(_bits(old), _bits(new)), "an input changed"
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    for o in outs:
        assert o.is_contiguous()
        assert not o.numel() or o.untyped_storage().data_ptr() not in storages, "an output aliases an input"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("name, sample, builder", SAMPLES, ids=[f"{n}-{i}" for n, i, _ in SAMPLES])
def test_opcheck(name, sample, builder, path, monkeypatch):
    # "k_planes": int4 weights prepared for the sm_90 variant (scales and zeros paired in one tensor)
    use_layout(monkeypatch, "k_planes" if sample.endswith("k_planes") else "checkpoint")
    op = getattr(torch.ops.kdsl, name).default
    args = builder()
    fp8_inputs = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    utils = WITHOUT_SCHEMA_CHECK if fp8_inputs else ("test_schema", *WITHOUT_SCHEMA_CHECK)
    torch.library.opcheck(op, args, test_utils=utils)
    assert_functional(op, args)


def test_paired_scales_and_zeros_may_come_as_copies(monkeypatch):
    """The k_planes kernels read (scale, zero) pairs through scales' pointer; the op pairs copies again, so its
    result depends on its inputs' values only (what opcheck and torch.compile assume of every op)."""
    use_layout(monkeypatch, "k_planes")
    args = [torch.randn(3, 256, dtype=torch.float16), *prepared_args(prepared_weights(64, "perm"))]
    assert args[3].stride(-1) == 2 and args[2].stride(-1) == 2  # scales and zeros: views of one [G, N, 2]
    want = torch.ops.kdsl.w4a16_gemm(*args)
    args[2], args[3] = args[2].clone(), args[3].clone()
    assert torch.equal(torch.ops.kdsl.w4a16_gemm(*args), want)


def test_every_public_op_is_registered():
    assert sorted(library.OPS) == sorted(library.SPECS)
    assert set(library.SPECS) >= {name for name, _, _ in SAMPLES}
    for name, spec in library.SPECS.items():
        op = getattr(torch.ops.kdsl, name).default
        assert str(op._schema) == f"kdsl::{name}{spec.schema}"
        assert torch.Tag.pt2_compliant_tag in op.tags
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            assert (torch.Tag.cudagraph_unsafe in op.tags) == spec.host_syncing
    assert "ScalarType out_dtype" in library.SPECS["fp8_gemm"].schema  # a torch.dtype argument
    assert [n for n, spec in library.SPECS.items() if spec.host_syncing] == [
        "awq_gemm", "awq_dequant", "gptq_gemm", "gptq_dequant"]


# ---------------------------------------------------------------------------------------------
# routing

class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    """Eagerly kdsl.ops.fp8_gemm runs its implementation directly; torch.ops.kdsl.fp8_gemm goes through
    the dispatcher. (The fallback, so that the recorder sees torch ops only, not the interpreter's.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b, b_s = fp8_weights()
    a, a_s = ops.act_quant(torch.randn(3, 256, dtype=torch.bfloat16))
    with _Recorder() as direct:
        eager = ops.fp8_gemm(a, a_s, b, b_s)
    with _Recorder() as dispatched:
        through_op = torch.ops.kdsl.fp8_gemm(a, a_s, b, b_s, torch.bfloat16)
    assert direct.ops and not any("kdsl" in name for name in direct.ops)
    assert "kdsl.fp8_gemm.default" in dispatched.ops
    assert torch.equal(eager, through_op)


# ---------------------------------------------------------------------------------------------
# torch.compile

def fp8_block(x, b, b_s):
    c = ops.fp8_gemm(*ops.act_quant(x), b, b_s)
    return c, F.silu(c)


def w4a16_block(x, prepared):
    y = ops.w4a16_gemm(x, prepared)
    return y, F.gelu(y) + 1


BACKENDS = ["eager", "aot_eager", "inductor"]


def _compile_and_compare(fn, inputs_for_m, backend, ms=(3, 5, 17)):
    """Compile fn(fullgraph, dynamic); call it for each M; outputs equal eager calls, one graph for every M."""
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for i, m in enumerate(ms):
        inputs = inputs_for_m(m)
        # After the first compile, a recompile (say M specialized) would raise here.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*inputs)
        want = fn(*inputs)
        kdsl_out, elementwise = got
        assert torch.equal(kdsl_out, want[0]), f"M = {m}: the kdsl op's output differs from eager"
        assert kdsl_out.stride() == want[0].stride()
        if backend == "inductor":  # inductor generates its own elementwise code: rounding may differ
            torch.testing.assert_close(elementwise, want[1])
        else:
            assert torch.equal(elementwise, want[1]), f"M = {m}"
    assert counter.frame_count == 1
    return counter.graphs[0]


def _kdsl_targets(graph: torch.fx.GraphModule) -> list[str]:
    """The kdsl ops Dynamo's graph calls, by name ("kdsl.fp8_gemm")."""
    targets = (str(node.target) for node in graph.graph.nodes if node.op == "call_function")
    return [target.removesuffix(".default") for target in targets if target.startswith("kdsl.")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_block_compiles_whole(backend, path):
    b, b_s = fp8_weights()
    graph = _compile_and_compare(
        fp8_block, lambda m: (torch.randn(m, 256, dtype=torch.bfloat16), b, b_s), backend)
    assert _kdsl_targets(graph) == ["kdsl.act_quant", "kdsl.fp8_gemm"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout, g_idx", [("checkpoint", "perm"), ("k_planes", "none")])
def test_w4a16_block_compiles_whole(backend, layout, g_idx, path, monkeypatch):
    use_layout(monkeypatch, layout)
    prepared = prepared_weights(64, g_idx)
    assert prepared.layout["weights"] == layout and (prepared.perm is not None) == (g_idx == "perm")
    graph = _compile_and_compare(
        w4a16_block, lambda m: (torch.randn(m, 256, dtype=torch.float16), prepared), backend)
    assert _kdsl_targets(graph) == ["kdsl.w4a16_gemm"]


def _public_call(name: str):
    """(function of the public API, its inputs, the op it must compile to) for each public op, alone."""
    b, b_s = fp8_weights()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    a, a_s = ops.act_quant(x)
    ck = gptq_checkpoint(64, "perm")
    xh = torch.randn(4, 256, dtype=torch.float16)
    checkpoint = (ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    awq = awq_checkpoint(64)
    calls = {
        "act_quant": (lambda x: ops.act_quant(x, group_size=128), (x,), "act_quant"),
        "weight_quant": (lambda w: ops.weight_quant(w, block_size=(128, 128)), (torch.randn(72, 256),), "weight_quant"),
        "weight_dequant": (lambda q, s: ops.weight_dequant(q, s, out_dtype=torch.float32), (b, b_s), "weight_dequant"),
        "fp8_gemm": (lambda *t: ops.fp8_gemm(*t, out_dtype=torch.float16), (a, a_s, b, b_s), "fp8_gemm"),
        "fp8_linear": (lambda *t: ops.fp8_linear(*t), (x, b, b_s, torch.randn(b.shape[0], dtype=torch.bfloat16)),
                       "fp8_linear"),
        "gptq_gemm": (lambda x, *t: ops.gptq_gemm(x, *t, group_size=64), (xh, *checkpoint), "gptq_gemm"),
        "gptq_dequant": (lambda *t: ops.gptq_dequant(*t, group_size=64), checkpoint, "gptq_dequant"),
        "awq_gemm": (lambda x, *t: ops.awq_gemm(x, *t, group_size=64), (xh, *awq), "awq_gemm"),
        "awq_dequant": (lambda *t: ops.awq_dequant(*t, group_size=64), awq, "awq_dequant"),
    }
    if name == "w4a16_dequant":
        prepared = ops.gptq_prepare(*checkpoint, group_size=64)
        return (lambda qweight: ops.w4a16_dequant(prepared)), (prepared.qweight,), "w4a16_dequant"
    if name in ("w4a16_gemm", "gptq_gemm-prepared"):
        prepared = ops.gptq_prepare(*checkpoint, group_size=64)
        public = ops.w4a16_gemm if name == "w4a16_gemm" else ops.gptq_gemm
        return (lambda x: public(x, prepared)), (xh,), "w4a16_gemm"
    return calls[name]


PUBLIC = ["act_quant", "weight_quant", "weight_dequant", "fp8_gemm", "fp8_linear", "gptq_gemm", "gptq_gemm-prepared",
          "gptq_dequant", "w4a16_gemm", "w4a16_dequant", "awq_gemm", "awq_dequant"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_op_compiles_alone(name, path):
    fn, inputs, op = _public_call(name)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)(*inputs)
    want = fn(*inputs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(_bits(g), _bits(w))
    assert counter.frame_count == 1
    assert _kdsl_targets(counter.graphs[0]) == [f"kdsl.{op}"]


# ---------------------------------------------------------------------------------------------
# errors

def test_bad_arguments_raise_the_eager_message_while_tracing():
    """The fake kernel runs the implementation's checks: Dynamo reports them while it traces (as
    TorchRuntimeError, its message holding the eager exception's)."""
    b, b_s = fp8_weights(n=20)  # N must be a multiple of 8
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    message = "b: N = 20 must be a multiple of 8"
    with pytest.raises(ValueError, match=message):
        fp8_block(x, b, b_s)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=message):
        torch.compile(fp8_block, backend="eager", fullgraph=True)(x, b, b_s)

    prepared = prepared_weights()
    message = "x: expected K = 256 in the last dimension"
    with pytest.raises(ValueError, match=message):
        w4a16_block(torch.randn(3, 128, dtype=torch.float16), prepared)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=message):
        torch.compile(w4a16_block, backend="aot_eager", fullgraph=True)(torch.randn(3, 128, dtype=torch.float16), prepared)


def test_data_dependent_check_raises_when_the_compiled_op_runs():
    """g_idx's values are not known while tracing: the compiled gptq_gemm raises the eager ValueError when it runs."""
    ck = gptq_checkpoint(64, "perm")
    g_idx = ck["g_idx"].clone()
    g_idx[0] = 7  # 4 groups
    x = torch.randn(3, 256, dtype=torch.float16)

    def fn(x, g_idx):
        return ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], g_idx, group_size=64) * 2

    message = r"g_idx: values must lie in \[0, 4\), got \[0, 7\]"
    with pytest.raises(ValueError, match=message):
        fn(x, g_idx)
    with pytest.raises(ValueError, match=message):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(x, g_idx)


# ---------------------------------------------------------------------------------------------
# GPU: CUDA graphs

@pytest.mark.gpu
@pytest.mark.parametrize("block", ["fp8", "w4a16"])
def test_reduce_overhead_on_cuda(block):
    """mode="reduce-overhead": inductor with CUDA graphs; the kdsl ops are captured (none of these syncs)."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    if block == "fp8":
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8 kernels need sm_89 or newer")
        w = torch.randn(2112, 1024, dtype=torch.bfloat16, device=cuda)
        weights = ops.weight_quant(w)
        fn, dtype = fp8_block, torch.bfloat16
    else:
        ck = ref.make_checkpoint(1024, 512, group_size=128, g_idx="perm", device=cuda)
        weights = (ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=128),)
        fn, dtype = w4a16_block, torch.float16
    counters.clear()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for m in (1, 16, 48):
        x = torch.randn(m, 1024, device=cuda).to(dtype)
        want = fn(x, *weights)
        for _ in range(3):  # warm-up, record, replay
            got = [t.clone() for t in compiled(x, *weights)]
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]), m
        torch.testing.assert_close(got[1], want[1])
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
