"""The generated modules' launch cache (common/launch_cache.py.j2), on the CPU.

A repeat launch skips Triton's JIT call and runs the kernel that call returned, so the cache key must
change wherever Triton could specialize differently. Here the JIT is a stand-in that records what it
is called with; tests/test_gpu_fp8.py runs the real kernels through the cache.
"""
from __future__ import annotations

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import kdsl


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
def act_quant_module(monkeypatch):
    mod = module("act_quant", "sm_89")
    monkeypatch.setattr(mod, "_INTERPRETING", False)  # the cache only runs for compiled kernels
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mod, "_COMPILED", {})
    return mod


def aligned_and_not() -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.zeros(68, dtype=torch.float32)
    base = 0 if flat.data_ptr() % 16 == 0 else (16 - flat.data_ptr() % 16) // 4
    return flat[base:base + 64], flat[base + 1:base + 65]


def test_repeat_launch_runs_the_compiled_kernel_with_every_argument(act_quant_module):
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    options = dict(BLOCK=64, num_warps=8)
    act_quant_module._launch(kernel, (2, 1, 1), (x, 64), options)
    act_quant_module._launch(kernel, (3, 1, 1), (x, 64), options)
    assert [c[0] for c in kernel.calls] == ["jit", "cached"]
    assert kernel.calls[0][2:] == ((x, 64), options)
    # Constexprs and Gluon's num_warps follow the leading arguments, in signature order; the grid is this call's.
    assert kernel.calls[1][1:] == ((3, 1, 1), (x, 64, 64, 8))


@pytest.mark.parametrize("change", ["size", "alignment", "dtype", "constexpr", "launch option", "device"])
def test_what_triton_specializes_on_misses_the_cache(change, act_quant_module, monkeypatch):
    kernel = FakeKernel()
    aligned, misaligned = aligned_and_not()
    act_quant_module._launch(kernel, (1, 1, 1), (aligned, 64), dict(BLOCK=64, num_warps=4))
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
    act_quant_module._launch(kernel, (1, 1, 1), params, options)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]
    assert len(act_quant_module._COMPILED) == 2


def test_descriptors_key_on_their_tensor_sizes_and_block(act_quant_module):
    spec = act_quant_module._specialization
    t = torch.zeros(256, 128)
    desc = TensorDescriptor(t, [256, 128], [128, 1], [64, 64])
    assert spec(desc) == spec(TensorDescriptor(torch.zeros(256, 128), [256, 128], [128, 1], [64, 64]))
    assert spec(desc) != spec(TensorDescriptor(t, [256, 128], [128, 1], [128, 64]))
    assert spec(desc) != spec(TensorDescriptor(t[:192], [192, 128], [128, 1], [64, 64]))
    assert spec(desc) != spec(TensorDescriptor(t.to(torch.bfloat16), [256, 128], [128, 1], [64, 64]))


def test_gluon_descriptors_key_on_their_block():
    mod = module("fp8_gemm", "sm_90")
    t = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    whole, edge = mod._gluon_descriptor(t, (128, 128)), mod._gluon_descriptor(t, (64, 128))
    assert mod._specialization(whole) == mod._specialization(mod._gluon_descriptor(t.clone(), (128, 128)))
    assert mod._specialization(whole) != mod._specialization(edge)


def test_a_jit_call_that_returns_no_kernel_is_not_cached(act_quant_module):
    kernel = FakeKernel(returns_kernel=False)
    x, _ = aligned_and_not()
    for _ in range(2):
        act_quant_module._launch(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit", "jit"] and not act_quant_module._COMPILED


def test_the_cache_is_bounded(act_quant_module, monkeypatch):
    monkeypatch.setattr(act_quant_module, "_COMPILED_LIMIT", 3)
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    for n in range(5):
        act_quant_module._launch(kernel, (1, 1, 1), (x, n), dict(BLOCK=64, num_warps=4))
        assert len(act_quant_module._COMPILED) <= 3
    act_quant_module._launch(kernel, (1, 1, 1), (x, 4), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit"] * 5 + ["cached"]


def test_the_interpreter_always_takes_the_jit_call(monkeypatch):
    mod = module("act_quant", "sm_89")
    monkeypatch.setattr(mod, "_INTERPRETING", True)
    monkeypatch.setattr(mod, "_COMPILED", {})
    kernel = FakeKernel()
    x, _ = aligned_and_not()
    for _ in range(2):
        mod._launch(kernel, (1, 1, 1), (x, 64), dict(BLOCK=64, num_warps=4))
    assert [c[0] for c in kernel.calls] == ["jit", "jit"] and not mod._COMPILED
