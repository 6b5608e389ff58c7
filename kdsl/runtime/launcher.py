"""The one launcher: runs the launches kernel implementations describe as data (kdsl.kernels.base.Launch).

An implementation's host code (its unit under kdsl/kernels/<family>/) works out a call's grid, arguments and
constexprs and returns them; everything that happens to a launch after that happens here, in one place:

- backends first: a function registered with add_backend (kdsl.aot.runtime registers one that runs exported
  cubins) is asked about each launch and returns True where it ran it; the runtime imports none of them;
- else Triton's JIT, with a cache of the compiled kernels: Triton's JIT call works out the kernel's
  specialization from every argument on each launch, about 20 us of host time per call on the lent H100's
  host, which a short eager launch waits for. The cache keys the compiled kernel that call returns on
  everything that specialization reads, and launches it directly next time;
- while kdsl.ops records a launch plan (kdsl/ops/_plan.py, begin_recording), each launch is appended to the
  recording: (kernel or compiled kernel, grid, params, options or the constexpr values, compiled?), or None
  for one a plan cannot replay (a backend ran it, or the JIT returned no compiled kernel).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from kdsl.kernels.base import Launch
from kdsl.kernels.host import INTERPRETING as _INTERPRETING  # read once, where the units read it

_COMPILED: dict = {}
_COMPILED_LIMIT = 1024  # keys hold exact sizes: a server's many prefill lengths must not grow it forever
_BACKENDS: list = []  # launch -> True where the backend ran it
_recording: list | None = None


def interpreting() -> bool:
    """Whether launches go to Triton's CPU interpreter (TRITON_INTERPRET=1 when kdsl was imported)."""
    return _INTERPRETING


def _specialization(arg):
    """What Triton can specialize a kernel on, of one argument: a superset of its rules (exact integers,
    dtypes, 16-byte alignment of every base, descriptors' sizes and blocks), so equal keys share a kernel."""
    if type(arg) is int or type(arg) is bool:
        return arg
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    block_shape = getattr(arg, "block_shape", None)
    if block_shape is None:
        return arg
    # A TMA descriptor; a Gluon one's shared layout is a function of its block and dtype.
    return _specialization(arg.base), tuple(arg.shape), tuple(arg.strides), tuple(block_shape), arg.padding


def run(launch: Launch) -> None:
    """kernel[grid](*params, **constexprs), through a backend, the compiled-kernel cache or Triton's JIT.
    params are the kernel's leading arguments in signature order, constexprs the keyword rest (constexprs and
    launch options such as num_warps); grid has three entries."""
    kernel, grid, params, options = launch
    if _BACKENDS:
        for backend in _BACKENDS:
            if backend(launch):
                if _recording is not None:
                    _recording.append(None)  # not a Triton launch: nothing to replay
                return
    if _INTERPRETING:
        kernel[grid](*params, **options)
        if _recording is not None:
            _recording.append((kernel, grid, params, options, False))
        return
    # Every constexpr is in the key, the scheme's numbers (GROUP_SIZE, ZERO_OFFSET) too: the schemes sharing a
    # generated module each get their own compiled kernel.
    key = (kernel, torch.cuda.current_device(), *options.items(), *map(_specialization, params))
    cached = _COMPILED.get(key)
    if cached is not None:
        compiled, keyword_params = cached
        compiled[grid](*params, *keyword_params)
        if _recording is not None:
            _recording.append((compiled, grid, params, keyword_params, True))
        return
    compiled = kernel[grid](*params, **options)
    if compiled is None:
        if _recording is not None:
            _recording.append(None)  # nothing to replay: the plan is not kept
        return
    try:  # the compiled kernel takes every signature argument positionally, constexprs included
        keyword_params = tuple(options[name] for name in kernel.arg_names[len(params):])
    except KeyError:  # a default left out: launched through the JIT call each time, not replayed
        if _recording is not None:
            _recording.append(None)
        return
    if len(_COMPILED) >= _COMPILED_LIMIT:
        _COMPILED.clear()
    _COMPILED[key] = compiled, keyword_params
    if _recording is not None:
        _recording.append((compiled, grid, params, keyword_params, True))


def run_all(described) -> None:
    """Run what an implementation's launch function returned: one Launch, or an iterable of them (a generator
    where the host work between launches needs the earlier ones enqueued, as MoE routing does)."""
    if type(described) is Launch:
        run(described)
    else:
        for launch in described:
            run(launch)


def add_backend(backend) -> None:
    """Ask backend(launch) about each launch from now on, before Triton's JIT: it returns True where it ran the
    launch (a backend added twice is asked once)."""
    if backend not in _BACKENDS:
        _BACKENDS.append(backend)


def remove_backend(backend) -> None:
    if backend in _BACKENDS:
        _BACKENDS.remove(backend)


def begin_recording() -> list | None:
    """Start recording launches: the list they are appended to, or None where a recording is open already."""
    global _recording
    if _recording is not None:
        return None
    _recording = []
    return _recording


def end_recording() -> None:
    global _recording
    _recording = None


@contextmanager
def recording():
    """`with launcher.recording() as launches:` the launches made inside (None where a recording is open)."""
    launches = begin_recording()
    try:
        yield launches
    finally:
        if launches is not None:
            end_recording()
