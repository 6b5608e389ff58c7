"""The launcher's compiled-kernel cache (kdsl/runtime/launcher.py) and kdsl.ops' launch plans, on the CPU.

A repeat launch skips Triton's JIT call and runs the kernel that call returned, so the cache key must
change wherever Triton could specialize differently. Here the JIT is a stand-in that records what it
is called with; tests/test_gpu_fp8.py runs the real kernels through the cache.
"""
from __future__ import annotations

import types

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import kdsl
from conftest import wrap_launch
from kdsl.kernels.base import Launch
from kdsl.kernels import host
from kdsl.kernels.host import gluon_descriptor
from kdsl.ops import w4a16
from kdsl.runtime import launcher, manifest


def module(op: str, arch: str):
    return kdsl.registry.select(op, kdsl.BlockFP8().name, arch=arch).load()


class FakeCompiled:
    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("cached", grid, args))


class FakeKernel:
    """A JIT function with signature (x, n, BLOCK, num_warps): Gluon kernels take num_warps as a constexpr."""

    arg_names = ["x", "n", "BLOCK", "num_warps"]

    def __init__(self, returns_kernel: bool = True):
        self.calls: list = []
        self.returns_kernel = returns_kernel

    def __getitem__(self, grid):
        def jit(*args, **options):
            self.calls.append(("jit", grid, args, options))
            return FakeCompiled(self.calls) if self.returns_kernel else None
        return jit


@pytest.fixture
def compiling(monkeypatch):
    """The launcher as on a GPU (the cache only runs for compiled kernels), its cache empty."""
    monkeypatch.setattr(launcher, "_INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_COMPILED", {})
    return launcher


def run(kernel, grid, params, options) -> None:
    launcher.run(Launch(kernel, grid, params, options))


def aligned_and_not() -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.zeros(68, dtype=torch.float32)
    base = 0 if flat.data_ptr() % 16 == 0 else (16 - flat.data_ptr() % 16) // 4
    return flat[base:base + 64], flat[base + 1:base + 65]


def test_repeat_launch_runs_the_compiled_kernel_with_every_argument(compiling):
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    options = dict(BLOCK=64, num_warps=8)
    run(kernel, (2, 1, 1), (x, 64), options)
    run(kernel, (3, 1, 1), (x, 64), options)
    assert [c[0] for c in kernel.calls] == ["jit", "cached"]
    assert kernel.calls[0][2:] == ((x, 64), options)
    # Constexprs and Gluon's num_warps follow the leading arguments, in signature order; the grid is this call's.
    assert kernel.calls[1][1:] == ((3, 1, 1), (x, 64, 64, 8))


@pytest.mark.parametrize("change", ["size", "alignment", "dtype", "constexpr", "launch option", "device"])
def test_what_triton_specializes_on_misses_the_cache(change, compiling, monkeypatch):
    kernel = FakeKernel()
    aligned, misaligned = aligned_and_not()
    run(kernel, (1, 1, 1), (aligned, 64), dict(BLOCK=64, num_warps=4))
    params, options = (aligned, 64), dict(BLOCK=64, num_warps=4)
    if change == "size":
        params = (aligned, 80)
    elif change == "alignment":
        params = (misaligned, 64)
    elif change == "dtype":
        params = (aligned.view(torch.int32), 64)
    elif change == "constexpr":
        options = dict(BLOCK=128, num_warps=4)
    elif change == "launch option":
        options = dict(BLOCK=64, num_warps=8)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    run(kernel, (1, 1, 1), params, options)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]
    assert len(launcher._COMPILED) == 2


def test_descriptors_key_on_their_tensor_sizes_and_block(compiling):
    spec = launcher._specialization
    t = torch.zeros(256, 128)
    desc = TensorDescriptor(t, [256, 128], [128, 1], [64, 64])
    assert spec(desc) == spec(TensorDescriptor(torch.zeros(256, 128), [256, 128], [128, 1], [64, 64]))
    assert spec(desc) != spec(TensorDescriptor(t, [256, 128], [128, 1], [128, 64]))
    assert spec(desc) != spec(TensorDescriptor(t[:192], [192, 128], [128, 1], [64, 64]))
    assert spec(desc) != spec(TensorDescriptor(t.to(torch.bfloat16), [256, 128], [128, 1], [64, 64]))


def test_gluon_descriptors_key_on_their_block():
    spec = launcher._specialization
    t = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    whole, edge = gluon_descriptor(t, (128, 128)), gluon_descriptor(t, (64, 128))
    assert spec(whole) == spec(gluon_descriptor(t.clone(), (128, 128)))
    assert spec(whole) != spec(edge)


def test_a_jit_call_that_returns_no_kernel_is_not_cached(compiling):
    kernel = FakeKernel(returns_kernel=False)
    x, _ = aligned_and_not()
    for _ in range(2):
        run(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit", "jit"] and not launcher._COMPILED


def test_the_cache_is_bounded(compiling, monkeypatch):
    monkeypatch.setattr(launcher, "_COMPILED_LIMIT", 3)
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    for n in range(5):
        run(kernel, (1, 1, 1), (x, n), dict(BLOCK=64, num_warps=4))
        assert len(launcher._COMPILED) <= 3
    run(kernel, (1, 1, 1), (x, 4), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit"] * 5 + ["cached"]


def test_the_interpreter_always_takes_the_jit_call(monkeypatch):
    monkeypatch.setattr(launcher, "_INTERPRETING", True)
    monkeypatch.setattr(launcher, "_COMPILED", {})
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    for _ in range(2):
        run(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit", "jit"] and not launcher._COMPILED


def test_a_backend_that_runs_a_launch_takes_it_from_the_jit(compiling):
    """A registered backend (kdsl.aot.runtime's exported cubins) is asked first; where it declines, the JIT runs."""
    served, kernel = [], FakeKernel()
    x, _ = aligned_and_not()

    def backend(launch):
        served.append(launch.params[1])
        return launch.params[1] == 64
    launcher.add_backend(backend)
    try:
        run(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
        run(kernel, (1, 1, 1), (x, 32), dict(BLOCK=64, num_warps=4))
    finally:
        launcher.remove_backend(backend)
    assert served == [64, 32] and [c[2] for c in kernel.calls] == [(x, 32)]


def test_recording_collects_the_launches_made_inside(compiling):
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    with launcher.recording() as launches:
        with launcher.recording() as nested:  # one recording at a time: the outer one records
            run(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
        run(kernel, (2, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    run(kernel, (3, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    assert nested is None and [(grid, compiled) for _, grid, _, _, compiled in launches] == [
        ((1, 1, 1), True), ((2, 1, 1), True)]


# --- launch plans (kdsl/ops/_plan.py): a repeat call signature replays its recorded launch -------------

from kdsl.ops import _plan, block_fp8  # noqa: E402
from kdsl.ops.gptq import gptq_prepare, gptq_quantize  # noqa: E402
from kdsl.registry import SchemeNotServedError  # noqa: E402


@pytest.fixture
def sm90(monkeypatch):
    """The sm_90 modules (fp8_gemm's TMA module has the launch cache; the interpreter runs its Triton kernel)."""
    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    kdsl.registry.reset()
    yield
    monkeypatch.delenv("KDSL_ARCH")
    kdsl.registry.reset()


def plans(op: str) -> list:
    return [plan for key, plan in kdsl.registry.plans.items() if key[0] == op]


def fp8_operands(m=3, n=256, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=g, dtype=torch.bfloat16)
    return x, w


def no_plan(fn):
    """fn() on the ordinary path, with no plan recorded or replayed."""
    saved = dict(kdsl.registry.plans)
    kdsl.registry.plans.clear()
    _plan.RECORD = False
    try:
        return fn()
    finally:
        _plan.RECORD = True
        kdsl.registry.plans.clear()
        kdsl.registry.plans.update(saved)


def test_a_plan_hit_launches_what_the_ordinary_path_does(sm90):
    ops = kdsl.ops
    x, w = fp8_operands()
    b, b_s = ops.weight_quant(w)
    q0, s0 = no_plan(lambda: ops.act_quant(x))
    c0 = no_plan(lambda: ops.fp8_gemm(q0, s0, b, b_s))
    for call in range(3):  # miss (records), hit, hit
        q, s = ops.act_quant(x)
        c = ops.fp8_gemm(q, s, b, b_s)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
        assert torch.equal(c, c0) and c.stride() == c0.stride() and c.dtype == c0.dtype
        assert len(plans("act_quant")) == 1 and plans("act_quant")[0]
        assert len(plans("fp8_gemm")) == 1 and plans("fp8_gemm")[0]
    # New data through the same plan: still the ordinary path's result.
    x2, _ = fp8_operands(seed=1)
    q2, s2 = ops.act_quant(x2)
    assert torch.equal(ops.fp8_gemm(q2, s2, b, b_s), no_plan(lambda: ops.fp8_gemm(q2, s2, b, b_s)))
    assert len(plans("fp8_gemm")) == 1


def test_fp8_bmm_plan_matches_the_ordinary_path(sm90):
    """MLA's views (a and a_s transposes of [M, B, ...] tensors): the second call on replays the first's launch,
    on new data too; a call with out= keeps a plan of its own that writes into the out it is given (MLA's second
    BMM writes o's input in place), and one whose a needs a copy keeps no plan."""
    ops = kdsl.ops
    g = torch.Generator().manual_seed(3)
    heads, m, n, k = 3, 5, 128, 256
    q, s = ops.act_quant(torch.randn(m, heads, k, generator=g, dtype=torch.bfloat16))
    a, a_s = q.transpose(0, 1), s.transpose(0, 1)
    wq, ws = zip(*(ops.weight_quant(torch.randn(n, k, generator=g, dtype=torch.bfloat16)) for _ in range(heads)))
    b, b_s = torch.stack(wq), torch.stack(ws)
    kdsl.registry.plans.clear()
    c0 = no_plan(lambda: ops.fp8_bmm(a, a_s, b, b_s))
    for call in range(3):  # miss (records), hit, hit
        c = ops.fp8_bmm(a, a_s, b, b_s)
        assert torch.equal(c, c0) and c.stride() == c0.stride() and c.dtype == c0.dtype
        assert len(plans("fp8_bmm")) == 1 and plans("fp8_bmm")[0]
    q2, s2 = ops.act_quant(torch.randn(m, heads, k, generator=g, dtype=torch.bfloat16))
    a2, a_s2 = q2.transpose(0, 1), s2.transpose(0, 1)
    assert torch.equal(ops.fp8_bmm(a2, a_s2, b, b_s), no_plan(lambda: ops.fp8_bmm(a2, a_s2, b, b_s)))
    out = torch.empty(m, heads, n, dtype=torch.bfloat16).transpose(0, 1)
    assert ops.fp8_bmm(a, a_s, b, b_s, out=out) is out and torch.equal(out, c0)
    assert len(plans("fp8_bmm")) == 2 and all(plans("fp8_bmm"))
    for inputs, want in (((a, a_s), c0), ((a2, a_s2), no_plan(lambda: ops.fp8_bmm(a2, a_s2, b, b_s)))):
        other = torch.full((m, heads, n), float("nan"), dtype=torch.bfloat16).transpose(0, 1)  # a replay's out
        assert ops.fp8_bmm(*inputs, b, b_s, out=other) is other and torch.equal(other, want)
    assert len(plans("fp8_bmm")) == 2
    strided = torch.empty(heads, m, 2 * k, dtype=a.dtype)[:, :, ::2]  # a copy makes it unit-stride along K
    strided.copy_(a)
    assert torch.equal(ops.fp8_bmm(strided, a_s, b, b_s), c0)
    assert sorted(map(bool, plans("fp8_bmm"))) == [False, True, True]


def test_a_hit_does_not_run_the_modules_launch(sm90, monkeypatch):
    x, _ = fp8_operands()
    _, s0 = no_plan(lambda: kdsl.ops.act_quant(x))
    kdsl.ops.act_quant(x)
    entry = kdsl.registry.dispatch("act_quant", kdsl.BlockFP8().name, x.device)
    calls = []
    wrap_launch(monkeypatch, entry.modules[entry.impl], lambda original: lambda *args: calls.append(args))
    q, s = kdsl.ops.act_quant(x)
    assert not calls and torch.equal(s, s0)


def test_prepared_w4a16_plan_matches_the_ordinary_path():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g, dtype=torch.float16)
    ck = gptq_quantize(w)
    prepared = gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None)
    x = torch.randn(2, 256, generator=g, dtype=torch.float16)
    y0 = no_plan(lambda: kdsl.ops.w4a16_gemm(x, prepared))
    for _ in range(2):
        assert torch.equal(kdsl.ops.gptq_gemm(x, prepared), y0)
    assert len(plans("w4a16_gemm")) == 1 and plans("w4a16_gemm")[0]
    # The module's W4A16Linear rebuilds its prepared object on every call: same tensors, same plan.
    rebuilt = kdsl.ops.w4a16.prepared_from_args(*kdsl.ops.w4a16.prepared_args(prepared))
    assert torch.equal(kdsl.ops.w4a16_gemm(x, rebuilt), y0) and len(plans("w4a16_gemm")) == 1


def test_act_order_w4a16_plan_allocates_the_gathered_x_and_matches_the_ordinary_path():
    """Act-order gathers x into a buffer the plan allocates like an output: the plan is kept, returns y alone, and
    a later call with other values gathers them (not the recorded call's)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g, dtype=torch.float16)
    g_idx = (torch.randperm(256, generator=g) // 128).to(torch.int32)  # desc_act: groups through a permutation
    ck = gptq_quantize(w)
    prepared = gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], g_idx)
    assert prepared.perm is not None
    xs = [torch.randn(2, 256, generator=g, dtype=torch.float16) for _ in range(3)]
    expected = [no_plan(lambda x=x: kdsl.ops.w4a16_gemm(x, prepared)) for x in xs]
    for x, y0 in zip(xs, expected):
        y = kdsl.ops.w4a16_gemm(x, prepared)
        assert isinstance(y, torch.Tensor) and torch.equal(y, y0)
    assert len(plans("w4a16_gemm")) == 1 and plans("w4a16_gemm")[0]


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values with a row stride one element longer (unit stride along K kept)."""
    wide = t.new_zeros(t.shape[0], t.shape[1] + 16)
    wide[:, :t.shape[1]] = t
    return wide[:, :t.shape[1]]


def misaligned(t: torch.Tensor) -> torch.Tensor:
    flat = t.new_zeros(t.numel() + 1)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("change", ["stride", "dtype", "alignment", "current device", "group size type"])
def test_what_the_key_holds_misses_and_gives_the_ordinary_result(change, sm90, monkeypatch):
    x, _ = fp8_operands(m=4)
    kdsl.ops.act_quant(x)
    group_size = 128
    if change == "stride":
        x = strided(x)
    elif change == "dtype":
        x = x.to(torch.float16)
    elif change == "alignment":
        x = misaligned(x)
        assert x.data_ptr() % 16
    elif change == "current device":
        monkeypatch.setattr(block_fp8, "_device", lambda: 5)
    else:
        group_size = 128.0  # equal and of equal hash to 128, but refused: it must not hit 128's plan
        with pytest.raises(ValueError, match="group_size: expected a positive power of two, got 128.0"):
            kdsl.ops.act_quant(x, group_size)
        return
    q, s = kdsl.ops.act_quant(x, group_size)
    assert len(plans("act_quant")) == 2
    q0, s0 = no_plan(lambda: kdsl.ops.act_quant(x, group_size))
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)


def test_errors_are_the_same_with_plans_kept(sm90):
    ops = kdsl.ops
    x, w = fp8_operands()
    b, b_s = ops.weight_quant(w)
    q, s = ops.act_quant(x)
    ops.fp8_gemm(q, s, b, b_s)
    ops.fp8_gemm(q, s, b, b_s)
    bad_calls = [
        lambda: ops.fp8_gemm(q, s, b[:, :128], b_s),  # K of b
        lambda: ops.fp8_gemm(q.view(torch.uint8), s, b, b_s),  # dtype of a
        lambda: ops.fp8_gemm(q, s[:, :1], b, b_s),  # a_s shape
        lambda: ops.fp8_gemm(q, s, b, b_s, out_dtype=torch.int32),
        lambda: ops.fp8_gemm(q, s, b, "b_s"),
        lambda: ops.act_quant(x, 64),  # a group size no kernel serves
        lambda: ops.act_quant(x.to(torch.int32)),
    ]
    for bad in bad_calls:
        with pytest.raises(Exception) as with_plans:
            bad()
        with pytest.raises(Exception) as without:
            no_plan(bad)
        assert type(with_plans.value) is type(without.value) and str(with_plans.value) == str(without.value)
    assert isinstance(no_plan(lambda: pytest.raises(SchemeNotServedError, ops.act_quant, x, 64)).value,
                      SchemeNotServedError)
    assert len(plans("fp8_gemm")) == 1  # a refused call keeps nothing


def test_reset_and_add_generated_forget_the_plans(sm90, tmp_path):
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)
    assert plans("act_quant")
    kdsl.registry.reset()
    assert not kdsl.registry.plans
    kdsl.ops.act_quant(x)
    assert plans("act_quant")
    kdsl.registry.add_generated(kdsl.runtime.manifest.shipped_dir())
    try:
        assert not kdsl.registry.plans
    finally:
        kdsl.registry.remove_generated(kdsl.runtime.manifest.shipped_dir())


def test_a_launch_the_plan_cannot_reproduce_is_not_replayed(sm90):
    x, _ = fp8_operands(m=4)
    cols = x.t().contiguous().t()  # unit stride along M, not K: the op copies x into rows first
    q, s = kdsl.ops.act_quant(cols)
    assert plans("act_quant") == [_plan.NO_PLAN]
    q2, s2 = kdsl.ops.act_quant(cols)
    q0, s0 = no_plan(lambda: kdsl.ops.act_quant(cols))
    assert torch.equal(s2, s0) and torch.equal(q2.view(torch.uint8), q0.view(torch.uint8))


def test_the_interpreter_plan_declines_without_triton_interpret(sm90, monkeypatch):
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)
    (plan,) = plans("act_quant")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert plan(x) is None


def test_the_plan_cache_is_bounded(sm90, monkeypatch):
    monkeypatch.setattr(_plan, "LIMIT", 2)
    for m in (1, 2, 3):
        kdsl.ops.act_quant(fp8_operands(m=m)[0])
        assert len(kdsl.registry.plans) <= 2


# On the GPU a plan launches the compiled kernel itself; here the JIT and the compiled kernel are stand-ins
# that record their arguments and report each launch to Triton's launch hook, as Triton's launcher does.

class Compiled:
    function, packed_metadata = "function", ("metadata",)

    def __init__(self, log: list, per_call: dict):
        self.log, self.per_call = log, per_call  # per_call["n"]: launches each call reports

    def run(self, *args):
        self.log.append(("run", args))

    def __getitem__(self, grid):
        def runner(*args):
            for _ in range(self.per_call["n"]):
                knobs.runtime.launch_enter_hook(None)
            self.log.append(("runner", grid, args))
        return runner


@pytest.fixture
def compiled_act_quant(monkeypatch):
    """act_quant's module as on a GPU (compiled, launch cache on), over stand-in kernels."""
    log: list = []
    mod = module("act_quant", "sm_89")
    kernel = mod.act_quant__e4m3_w128x128_a128_f32__rowwise_sm89
    per_call = {"n": 1}

    def jit(grid):
        def call(*args, **options):
            knobs.runtime.launch_enter_hook(None)
            log.append(("jit", grid, args, options))
            return Compiled(log, per_call)
        return call

    monkeypatch.setattr(launcher, "_INTERPRETING", False)
    monkeypatch.setattr(launcher, "_COMPILED", {})
    monkeypatch.setattr(mod, "act_quant__e4m3_w128x128_a128_f32__rowwise_sm89", FakeJit(jit, kernel.arg_names))
    monkeypatch.setattr(manifest, "_LAUNCHES", {})  # the unit's launch binds to the module's kernels afresh
    monkeypatch.setattr(manifest, "_GENERATED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_plan, "_triton_stream", lambda: (lambda device: "stream"))
    monkeypatch.setattr(kdsl.ops._checks, "use_kernels", lambda device: True)
    kdsl.registry.plans.clear()
    yield log, per_call
    kdsl.registry.plans.clear()


class FakeJit:
    def __init__(self, jit, arg_names):
        self.jit, self.arg_names = jit, arg_names

    def __getitem__(self, grid):
        return self.jit(grid)


from triton import knobs  # noqa: E402


def test_a_compiled_plan_runs_the_kernel_with_the_calls_pointers(compiled_act_quant):
    log, _ = compiled_act_quant
    x, _ = fp8_operands()
    q1, s1 = kdsl.ops.act_quant(x)  # miss: the JIT call, recorded
    q2, s2 = kdsl.ops.act_quant(x)  # hit
    (plan,) = plans("act_quant")
    assert plan and [entry[0] for entry in log] == ["jit", "run"]
    jit_args, run_args = log[0][2], log[1][1]
    grid = log[0][1]
    # Triton's runner: run(grid..., stream, function, packed metadata, launch metadata, hooks, *arguments).
    assert run_args[:9] == (*grid, "stream", "function", ("metadata",), None, None, None)
    x_ptr, q_ptr, s_ptr = run_args[9:12]
    assert (x_ptr, q_ptr, s_ptr) == (x.data_ptr(), q2.data_ptr(), s2.data_ptr())
    assert run_args[12:15] == jit_args[3:6]  # M, K, stride: this signature's, as recorded
    assert q2.shape == q1.shape and s2.stride() == s1.stride() and q2.data_ptr() != q1.data_ptr()
    assert "i0.data_ptr(), o0.data_ptr(), o1.data_ptr()" in plan.describe()


def test_a_compiled_plan_calls_tritons_c_launcher_as_cuda_launcher_does(compiled_act_quant, monkeypatch):
    """Where _direct_launcher finds Triton 3.6's C launcher, the plan calls it with CudaLauncher.__call__'s
    arguments: grid, stream, function, cooperative, pdl, two scratch, packed metadata, three None, kernel's."""
    log, _ = compiled_act_quant
    raw_calls = []
    monkeypatch.setattr(_plan, "_direct_launcher",
                        lambda compiled: (lambda *args: raw_calls.append(args), {}, None, False, True))
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)
    q, s = kdsl.ops.act_quant(x)
    (plan,) = plans("act_quant")
    assert plan and [entry[0] for entry in log] == ["jit"] and len(raw_calls) == 1
    grid, jit_args = log[0][1], log[0][2]
    args = raw_calls[0]
    assert args[:13] == (*grid, "stream", "function", False, True, None, None, ("metadata",), None, None, None)
    assert args[13:16] == (x.data_ptr(), q.data_ptr(), s.data_ptr()) and args[16:19] == jit_args[3:6]
    assert "by its C launcher" in plan.describe()


def test_a_compiled_plan_declines_while_a_launch_hook_is_set(compiled_act_quant):
    log, _ = compiled_act_quant
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)
    (plan,) = plans("act_quant")
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert plan(x) is None
        kdsl.ops.act_quant(x)  # the ordinary path: the launch cache's runner, which calls the hook
        assert log[-1][0] == "runner"
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def test_a_compiled_plan_declines_inside_a_cuda_graph_capture(compiled_act_quant, monkeypatch):
    """A captured graph's replays cost no host time, so a capture takes the ordinary path: the launches the
    kernels were measured with (a replayed Gluon TMA launch measured slower inside a graph)."""
    log, _ = compiled_act_quant
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)
    (plan,) = plans("act_quant")
    assert plan(x) is not None and log[-1][0] == "run"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert plan(x) is None
    kdsl.ops.act_quant(x)
    assert log[-1][0] == "runner"


def test_launches_that_go_around_the_launch_cache_leave_no_plan(compiled_act_quant):
    log, per_call = compiled_act_quant
    x, _ = fp8_operands()
    kdsl.ops.act_quant(x)  # the JIT call compiles; the plan records the one launch it saw
    kdsl.registry.plans.clear()
    per_call["n"] = 2  # from now on each launch through the cache reports two launches to the hook
    kdsl.ops.act_quant(x)
    assert plans("act_quant") == [_plan.NO_PLAN]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512, 4096])
def test_gpu_plans_match_the_ordinary_path(m):
    """On the GPU, a plan launches the compiled kernels directly (Triton 3.6: its C launcher, descriptors
    expanded per base address): on fresh data each call, every tile kind (split-K wgmma, Gluon deferred
    rescale, persistent) and the prepared int4 GEMM (mma.sync GEMV, MMA tiles) give the ordinary path's bits."""
    cuda = torch.device("cuda")
    ops = kdsl.ops
    n, k = 2112, 7168
    g = torch.Generator(device=cuda).manual_seed(m)
    w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16, generator=g)
    b, b_s = ops.weight_quant(w)
    wh = torch.randn(4096, 4096, device=cuda, dtype=torch.float16, generator=g)
    ck = gptq_quantize(wh)
    prepared = gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None)
    kdsl.registry.plans.clear()
    for call in range(4):
        x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16, generator=g)
        q, s = ops.act_quant(x)
        c = ops.fp8_gemm(q, s, b, b_s)
        xh = torch.randn(m, 4096, device=cuda, dtype=torch.float16, generator=g)
        y = ops.gptq_gemm(xh, prepared)
        q0, s0 = no_plan(lambda: ops.act_quant(x))
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
        assert torch.equal(c, no_plan(lambda: ops.fp8_gemm(q, s, b, b_s)))
        assert torch.equal(y, no_plan(lambda: ops.gptq_gemm(xh, prepared)))
    kept = {key[0]: bool(plan) for key, plan in kdsl.registry.plans.items()}
    assert kept["act_quant"] and kept["fp8_gemm"], kept
    # The Gluon kernels it launches itself (overlap, mma.sync GEMV) included; decode-sized calls only.
    assert kept.get("w4a16_gemm", False) == (m <= w4a16.PLAN_MAX_ROWS), kept


@pytest.mark.gpu
@pytest.mark.parametrize("heads, m, n, k", [(16, 1, 512, 128), (128, 1, 512, 128), (16, 64, 128, 512),
                                            (128, 128, 128, 512), (16, 4096, 512, 128)])
def test_gpu_fp8_bmm_plans_match_the_ordinary_path(heads, m, n, k):
    """fp8_bmm's plan on the GPU (3-D TMA descriptors expanded per base address, pdl launches, the 16-head
    tiles): on fresh activations each call, the ordinary path's bits."""
    cuda = torch.device("cuda")
    ops = kdsl.ops
    g = torch.Generator(device=cuda).manual_seed(m + heads)
    wq, ws = zip(*(ops.weight_quant(torch.randn(n, k, device=cuda, dtype=torch.bfloat16, generator=g))
                   for _ in range(heads)))
    b, b_s = torch.stack(wq), torch.stack(ws)
    kdsl.registry.plans.clear()
    for call in range(4):
        q, s = ops.act_quant(torch.randn(m, heads, k, device=cuda, dtype=torch.bfloat16, generator=g))
        a, a_s = q.transpose(0, 1), s.transpose(0, 1)
        c = ops.fp8_bmm(a, a_s, b, b_s)
        assert torch.equal(c, no_plan(lambda: ops.fp8_bmm(a, a_s, b, b_s)))
    assert [bool(p) for p in plans("fp8_bmm")] == [True]


def test_a_compiled_plan_fills_each_launchs_pointers_and_descriptors(monkeypatch):
    """Two launches: a tensor passed twice in one launch (w4a16's qweight where perm is None) and to both,
    a TMA descriptor expanded as Triton's make_tensordesc_arg does, the split-K scratch by address."""
    calls = []

    class Compiled:
        function, packed_metadata = "function", ("metadata",)

        def __init__(self, descriptors: dict):
            self.descriptors = descriptors

    def expand(desc, meta):
        return [meta, desc.base.data_ptr(), *desc.block_shape]

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_plan, "_triton_stream", lambda: (lambda device: "stream"))
    monkeypatch.setattr(_plan, "_direct_launcher", lambda compiled: (
        lambda *args: calls.append(args), compiled.descriptors, expand, False, True))
    x, w, y, scratch = torch.randn(4, 16), torch.randn(16, 16), torch.empty(4, 16), torch.zeros(8)
    module = types.SimpleNamespace(__name__="fake")
    monkeypatch.setitem(host.SPLITK_SCRATCH, ("kernel", "device"), (scratch,))
    launches = [(Compiled({}), (3,), (x, w, w, scratch, y, 5), (True,), True),
                (Compiled({0: "meta"}), (2, 2), (TensorDescriptor.from_tensor(w, [8, 8]), x, 7), (), True)]
    plan = _plan._build(types.SimpleNamespace(module=module, launches=launches, count=2, interpreting=False), (x, w),
                        (y,))
    x2 = torch.randn(4, 16)
    y2 = plan(x2, w)
    assert y2.shape == y.shape and y2.data_ptr() != y.data_ptr()

    def head(*grid):
        return (*grid, "stream", "function", False, True, None, None, ("metadata",), None, None, None)
    assert calls == [
        (*head(3, 1, 1), x2.data_ptr(), w.data_ptr(), w.data_ptr(), scratch.data_ptr(), y2.data_ptr(), 5, True),
        (*head(2, 2, 1), "meta", w.data_ptr(), 8, 8, x2.data_ptr(), 7)]
    assert "*expand(i1)" in plan.describe()
