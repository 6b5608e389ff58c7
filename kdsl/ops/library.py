"""kdsl's ops as PyTorch custom operators, torch.ops.kdsl.*, so torch.compile(fullgraph=True) traces a
model that calls them without a graph break.

Every op is declared once, as an OpSpec beside its public function (a module-level SPECS in its family file,
kdsl/ops/<family>.py; kdsl.ops.spec says what a spec holds: schema, implementation, fake kernel, whether it
syncs with the host). This module finds the declared specs and registers each the same way: the implementation
for every device, recording no launch plans while torch.compile's graphs run it; the fake kernel; the
cudagraph_unsafe tag where the spec says host_syncing; and an autograd formula that refuses inputs requiring
grad with the eager message. It keeps no list of ops: OPS is what it registered.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

import torch

from kdsl.ops import _checks as check
from kdsl.ops import _plan
from kdsl.ops.spec import OpSpec

# The tag is missing from older torch, which then has no way to be told that an op cannot be captured.
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


def declared_specs() -> tuple[OpSpec, ...]:
    """Every OpSpec the modules of kdsl.ops declare in a module-level SPECS, in module order. The private modules
    (helpers) and this one declare none."""
    package = importlib.import_module(__package__)
    specs: list[OpSpec] = []
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.startswith("_") or f"{__package__}.{module.name}" == __name__:
            continue
        specs += getattr(importlib.import_module(f"{__package__}.{module.name}"), "SPECS", ())
    names = [spec.name for spec in specs]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise RuntimeError(f"kdsl.ops: more than one spec declares {', '.join(duplicated)}")
    return tuple(specs)


def _recording_no_plans(impl):
    """impl, recording no launch plan (kdsl/ops/_plan.py) while it runs: compiled graphs call the op, and under
    mode="reduce-overhead" Inductor's CUDA graph trees own the memory of what it allocates then; a plan recorded
    there would keep its output templates alive in their pool, which they refuse. Plans recorded by eager calls
    still replay (their templates live outside any pool)."""
    @functools.wraps(impl)
    def run(*args):
        if not _plan.RECORD:
            return impl(*args)
        _plan.RECORD = False
        try:
            return impl(*args)
        finally:
            _plan.RECORD = True
    return run


def _no_backward(spec: OpSpec):
    """An autograd formula for the spec's op that refuses, in forward, an input that requires grad with the message
    the ops' eager checks give (kdsl.ops._checks.inference_only). The checks cannot say it under torch.compile:
    the fake kernel runs below autograd, where torch's own "no autograd formula" error would come first."""
    arguments = [argument.name for argument in torch._C.parse_schema(f"{spec.qualified_name}{spec.schema}").arguments]

    def setup_context(ctx, inputs, output):
        for argument, value in zip(arguments, inputs):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                check.inference_only(argument)

    def backward(ctx, *grads):  # never reached: setup_context refused the inputs that would need it
        raise AssertionError(f"{spec.qualified_name} has no backward")
    return backward, setup_context


def register(spec: OpSpec):
    """Register the spec's op: its implementation (every device), its fake kernel, the cudagraph_unsafe tag if it
    syncs with the host, and an autograd formula that refuses inputs requiring grad (_no_backward)."""
    tags = (_CUDAGRAPH_UNSAFE,) if spec.host_syncing and _CUDAGRAPH_UNSAFE is not None else ()
    op = torch.library.custom_op(spec.qualified_name, _recording_no_plans(spec.impl), mutates_args=(),
                                 schema=spec.schema, tags=tags)
    op.register_fake(spec.fake)
    backward, setup_context = _no_backward(spec)
    op.register_autograd(backward, setup_context=setup_context)
    return op


SPECS = {spec.name: spec for spec in declared_specs()}
OPS = {name: register(spec) for name, spec in SPECS.items()}
