"""Launch plans: what one call signature of an op launches, recorded on its first call and replayed after.

An op's host time is mostly Python: argument checks, the scheme and kernel lookup, the tile choice, the
implementation's launch (grid, split, descriptors: its unit under kdsl/kernels) and Triton's launch
wrappers. All of it is a
function of the call's signature, so a plan keyed on that signature can skip it:

  key: the op, each tensor argument's type, shape, strides, dtype, device, data_ptr() % 16 and requires_grad
       (kdsl.ops.block_fp8: no plan is kept for inputs that require grad, see store), the op's
       other arguments (with their types: 128 and 128.0 hash alike), and the current CUDA device. The ops
       build it inline (kdsl.ops.block_fp8, kdsl.ops.w4a16); everything their checks and the launch read
       is in it, so a key that was once checked and launched is checked and launched the same way again.
  value: a function of the call's tensors that allocates the outputs (torch.empty_like of a one-element
       template: the cheapest allocation torch offers from Python) and launches the recorded kernels on
       them: on the GPU through the compiled kernel's launcher (CompiledKernel.run, as Triton's own
       CompiledKernel.__getitem__ runner does, with pointers passed as integers so the launcher does not
       ask the driver about each one), under the interpreter through kernel[grid](...). It is built from
       data, not from source text: each launch's argument list is kept with its constants in place, and a
       call copies it and fills in the stream, its own pointers (each data_ptr() read once a launch) and
       descriptors. plan.describe() says what a plan launches, in words.

A miss runs the op's ordinary path, which raises the same errors as ever, and records the launches
kdsl.runtime.launcher makes. The plan is
kept only where replaying it is the same launch: on the GPU, Triton's launch hook counted as many launches
as were recorded (none went around the launcher); every tensor a launch reads is one of the call's tensors, a view
starting at one of them (same dtype under the interpreter), or the persistent split-K scratch; no
two of the call's tensors start at one address; no CUDA graph is being captured. Otherwise the key maps to
NO_PLAN and every call takes the ordinary path.

A plan declines (returns None, and the op takes the ordinary path) while Triton's launch hooks are set (a
profiler sees every launch as Triton reports it), while a CUDA graph is being captured (the graph's replays have
no host time to save, and a replayed launch of the Gluon TMA W4A16 kernel measured 3% slower on the GPU inside a
graph than the ordinary path's: a probe on an H200, removed; see git log) and, for CPU tensors, when TRITON_INTERPRET
is unset.
Plans live in kdsl.runtime.registry.plans: registry.reset() and add_generated() empty it; at most LIMIT
are kept (the dict is emptied when full, like the launcher's compiled-kernel cache).
"""
from __future__ import annotations

import os

import torch

from kdsl.kernels import host
from kdsl.runtime import launcher, registry

PLANS = registry.plans
LIMIT = 512
NO_PLAN = False  # a key recorded once and found not replayable
RECORD = True  # False: nothing new is recorded (tests that watch the implementations' launches turn it off)

if torch.cuda.is_available():
    current_device = torch._C._cuda_getDevice
else:
    def current_device() -> int:
        return -1


class Recorder:
    """`with Recorder(module) as rec: entry.launch(...)` collects that call's launches (rec.launches) from
    kdsl.runtime.launcher; module is the generated module launched (it names the plan), None to record nothing."""

    def __init__(self, module):
        self.module = module
        self.launches: list | None = None
        self.count = 0
        self.chain = None
        self.interpreting = launcher.interpreting()

    def __enter__(self) -> "Recorder":
        if not RECORD or self.module is None:
            return self
        if not self.interpreting:
            self.chain = _hook_chain()
            if self.chain is None:
                return self  # this Triton cannot count launches: no plan
        self.launches = launcher.begin_recording()
        if self.launches is None:
            self.chain = None
            return self  # a recording is open already (an op called inside another's): that one records
        if self.chain is not None:
            self.chain.add(self._counted)
        return self

    def _counted(self, *_) -> None:
        self.count += 1

    def __exit__(self, *_) -> bool:
        if self.launches is not None:
            launcher.end_recording()
        if self.chain is not None:
            self.chain.remove(self._counted)
        return False


def store(key, rec: Recorder, inputs: tuple, outputs: tuple) -> None:
    """Keep under key the plan that launches what rec recorded: inputs are the op's tensors in the order the
    op passes them to the plan (None for an absent optional one), outputs the tensors it allocated."""
    if key is None or rec.launches is None:
        return
    if any(t is not None and t.requires_grad for t in inputs):
        return  # checked with grad mode off: a replay with it on would skip the checks' no-backward refusal
    if not rec.interpreting and torch.cuda.is_current_stream_capturing():
        return  # scratch grown inside a capture is zeroed when the graph replays, not now
    plan = _build(rec, inputs, outputs)
    if len(PLANS) >= LIMIT:
        PLANS.clear()
    PLANS[key] = NO_PLAN if plan is None else plan


def _hook_chain():
    """Triton's launch_enter_hook chain, where it is one (Triton >= 3.4); None where it is not."""
    from triton import knobs

    chain = getattr(knobs.runtime, "launch_enter_hook", None)
    return chain if hasattr(chain, "calls") and hasattr(chain, "add") and hasattr(chain, "remove") else None


def _rebase(proto, base):
    """A copy of the recorded tensor descriptor proto over base (same sizes, strides and block)."""
    desc = object.__new__(type(proto))
    desc.__dict__.update(proto.__dict__)
    desc.base = base
    return desc


def _template(out: torch.Tensor):
    """A one-element tensor whose torch.empty_like has out's shape, strides, dtype and device; None if none."""
    one = out.new_empty((1,))
    template = one.expand(out.shape) if out.numel() > 1 else one.view(out.shape)
    probe = torch.empty_like(template)
    if (probe.shape, probe.stride(), probe.dtype, probe.device) != (out.shape, out.stride(), out.dtype, out.device):
        return None
    return template


def _build(rec: Recorder, inputs: tuple, outputs: tuple):
    """The replay function of what rec recorded, or None where a replay would not be the same launch.

    Everything a call does not change is worked out here: each launch's argument list, with the constants in
    place and a placeholder where a call's own tensor goes (its pointer on the GPU, the tensor itself under the
    interpreter), or where its TMA descriptor goes. Tensors are named by slot: their index in
    (*inputs, *outputs), the order a call passes its tensors in and allocates its outputs in."""
    launches = rec.launches
    if not launches or any(launch is None for launch in launches):
        return None
    compiled = not rec.interpreting
    if any(launch[4] is not compiled for launch in launches):
        return None
    if compiled and rec.count != len(launches):
        return None  # a launch went around the launcher: replaying the recorded ones would miss it
    by_ptr = {}
    for slot, t in enumerate((*inputs, *outputs)):
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.numel() == 0 or t.data_ptr() in by_ptr:
            return None  # aliasing arguments: which of them a launch reads is not in the key
        by_ptr[t.data_ptr()] = slot, t
    names = [f"i{j}" for j in range(len(inputs))] + [f"o{j}" for j in range(len(outputs))]

    def slot_of(p: torch.Tensor) -> int | None:
        """The call tensor p starts at (p itself, or a view such as x.reshape(-1, K) of it). A launch reads
        its pointer only (the interpreter also its dtype), so the same call tensor of a later call serves."""
        slot, t = by_ptr.get(p.data_ptr(), (None, None))
        return slot if t is not None and (compiled or p.dtype == t.dtype) else None
    scratch = {id(t) for pair in host.SPLITK_SCRATCH.values() for t in pair}

    templates = tuple(_template(out) for out in outputs)
    if any(template is None for template in templates):
        return None
    held: list = []  # scratch a compiled plan passes by address: held, so its memory stays the scratch's
    steps, described = [], []
    for kernel, grid, params, extra, _ in launches:
        direct = _direct_launcher(kernel) if compiled else None
        descriptors = direct[1] if direct is not None else {}
        grid = (*grid, 1, 1)[:3]  # Triton's runner reads three entries; a shorter grid means 1 for the rest
        if direct is not None:
            launch_fn, _, make, cooperative, pdl = direct
            # CudaLauncher.__call__'s arguments: grid, stream (filled per call), function, cooperative, pdl,
            # (global and profile scratch: none), packed metadata, (launch metadata, hooks: none), kernel's.
            head = [*grid, None, kernel.function, cooperative, pdl, None, None, kernel.packed_metadata,
                    None, None, None]
        elif compiled:
            launch_fn = kernel.run  # CompiledKernel.run(grid..., stream, function, metadata, None x3, kernel's)
            head = [*grid, None, kernel.function, kernel.packed_metadata, None, None, None]
        else:
            head = []
        args, fills, splices, words = list(head), [], [], []
        for position, p in enumerate((*params, *extra) if compiled else params):
            at = len(head) + position
            if isinstance(p, torch.Tensor):
                if id(p) in scratch:
                    held.append(p)
                    args.append(p.data_ptr() if compiled else p)
                    words.append(f"scratch@{p.data_ptr():#x}")
                    continue
                slot = slot_of(p)
                if slot is None:
                    return None
                words.append(f"{names[slot]}.data_ptr()" if compiled else names[slot])
                fills.append((at, slot))
                args.append(None)
                continue
            base = getattr(p, "base", None)
            if getattr(p, "block_shape", None) is not None and isinstance(base, torch.Tensor):
                slot = slot_of(base)
                if slot is None or not hasattr(p, "__dict__"):
                    return None
                if direct is not None:
                    if position not in descriptors:
                        return None
                    # Triton's own expansion of the descriptor, kept per base address (a weight's is fixed).
                    splices.append((at, _expander(p, descriptors[position], make), slot))
                    words.append(f"*expand({names[slot]})")
                else:
                    splices.append((at, _rebaser(p), slot))
                    words.append(f"rebase(descriptor, {names[slot]})")
                args.append(None)
                continue
            if not (p is None or type(p) is bool or type(p) is int or isinstance(p, (float, str))
                    or not hasattr(p, "data_ptr")):
                return None  # holds memory the plan cannot follow
            args.append(p)
            words.append(repr(p))
        if direct is not None and len(splices) != len(descriptors):
            return None  # a descriptor the launcher expands was not passed as one
        splices.reverse()  # spliced from the last, so the places of those before stay as recorded
        if compiled:
            steps.append((launch_fn, args, tuple(fills), tuple(splices)))
            words[:0] = [*map(repr, grid), "stream", *map(repr, head[4:])]
            by = "its C launcher" if direct is not None else "CompiledKernel.run"
            described.append(f"{getattr(kernel, 'name', kernel)!r} by {by}({', '.join(words)})")
        else:
            steps.append((kernel, grid, args, tuple(fills), tuple(splices), extra))
            described.append(f"{getattr(kernel, '__name__', kernel)}[{grid}]({', '.join(words)}, **{extra!r})")
    how = f"compiled, device {current_device()}" if compiled else "interpreted"
    description = "\n".join([
        f"plan of {rec.module.__name__} ({how}): ({', '.join(names[:len(inputs)])}) -> "
        f"({', '.join(names[len(inputs):])}), each output torch.empty_like of a template",
        *(f"  {line}" for line in described)])
    if compiled:
        replay = _compiled_replay(steps, templates, tuple(held))
    else:
        replay = _interpreted_replay(tuple(steps), templates)
    replay.describe = description.__str__  # what it launches, for reading (benchmarks/host_time.py)
    return replay


def _compiled_replay(steps: list, templates: tuple, held: tuple):
    """A compiled plan's replay: steps are (launcher, argument list, pointer fills, descriptor splices), a
    fill (place, slot) being where a call tensor's data_ptr() goes."""
    from triton import knobs

    steps = tuple((launch_fn, recorded, *_reads_and_copies(fills), splices)
                  for launch_fn, recorded, fills, splices in steps)

    chain_type, stream_of, device = type(_hook_chain()), _triton_stream(), current_device()
    cuda, empty_like, count = torch.cuda, torch.empty_like, len(templates)
    first, second = (*templates, None, None)[:2]

    def replay(*inputs):
        runtime = knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if ((enter is not None and (type(enter) is not chain_type or enter.calls))
                or (leave is not None and (type(leave) is not chain_type or leave.calls))
                or cuda.is_current_stream_capturing()):
            return None
        # An op returns one or two tensors: a call per template is cheaper than a loop's or map's.
        if count == 1:
            outputs = (empty_like(first),)
        elif count == 2:
            outputs = (empty_like(first), empty_like(second))
        else:
            outputs = tuple([empty_like(template) for template in templates])
        tensors = inputs + outputs
        stream = stream_of(device)
        for launch_fn, recorded, reads, copies, splices in steps:
            args = recorded.copy()
            args[3] = stream
            for at, slot in reads:
                args[at] = tensors[slot].data_ptr()
            if copies:
                for at, source in copies:
                    args[at] = args[source]
            if splices:
                for at, expand, slot in splices:
                    args[at:at + 1] = expand(tensors[slot])
            launch_fn(*args)
        return outputs[0] if count == 1 else outputs
    replay.held = held
    return replay


def _reads_and_copies(fills: list) -> tuple:
    """A launch's pointer fills (place, slot) as the places where a call reads a pointer, (place, slot), and
    those that repeat one read in the same launch, (place, place read): w4a16's qweight where perm is None.
    Each launch reads its pointers once; two launches that take one tensor each read it, which costs less
    than keeping it across launches would."""
    first: dict = {}
    reads, copies = [], []
    for at, slot in fills:
        if slot in first:
            copies.append((at, first[slot]))
        else:
            first[slot] = at
            reads.append((at, slot))
    return tuple(reads), tuple(copies)


def _interpreted_replay(steps: tuple, templates: tuple):
    """An interpreted plan's replay: steps are (kernel, grid, argument list, tensor fills, descriptor
    splices, keyword options), launched as kernel[grid](*arguments, **options)."""
    environ, empty_like, single = os.environ, torch.empty_like, len(templates) == 1

    def replay(*inputs):
        if environ.get("TRITON_INTERPRET") != "1":
            return None
        outputs = tuple(map(empty_like, templates))
        tensors = inputs + outputs
        for kernel, grid, recorded, fills, splices, options in steps:
            args = recorded.copy()
            for at, slot in fills:
                args[at] = tensors[slot]
            for at, rebase, slot in splices:
                args[at:at + 1] = rebase(tensors[slot])
            kernel[grid](*args, **options)
        return outputs[0] if single else outputs
    return replay


def _direct_launcher(compiled):
    """(the C launcher, {kernel argument index: descriptor metadata}, make_tensordesc_arg, cooperative, pdl)
    of a compiled kernel whose launcher is Triton 3.6's CudaLauncher with no scratch memory to allocate, for
    the plan to call as CudaLauncher.__call__ and its descriptor wrapper would; None for any other launcher
    (the plan then calls CompiledKernel.run, which every Triton version has)."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    c_launcher = compiled.run
    if (type(c_launcher) is not getattr(nvidia, "CudaLauncher", None)
            or getattr(nvidia, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"
            or getattr(c_launcher, "global_scratch_size", 1) or getattr(c_launcher, "profile_scratch_size", 1)):
        return None
    launch, make = c_launcher.launch, getattr(nvidia, "make_tensordesc_arg", None)
    code = getattr(launch, "__code__", None)
    if code is None:  # the C launcher itself: the kernel takes no descriptors
        return launch, {}, make, c_launcher.launch_cooperative_grid, c_launcher.launch_pdl
    # wrap_handle_tensordesc's inner(*args): its closure holds the C launcher and the descriptors' places.
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
    if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or make is None:
        return None
    indices = sorted(cells["tensordesc_indices"])
    meta = cells["tensordesc_meta"]
    if len(meta) != len(indices) or any(m is None for m in meta):
        return None
    return (cells["launcher"], dict(zip(indices, meta)), make, c_launcher.launch_cooperative_grid,
            c_launcher.launch_pdl)


def _rebaser(proto):
    """base -> (proto's descriptor over base,): one argument, spliced as an expander's are."""
    return lambda base: (_rebase(proto, base),)


def _expander(proto, meta, make, limit: int = 64):
    """base -> Triton's launcher arguments for proto's descriptor over base (make_tensordesc_arg), kept per
    base address: the TMA descriptor is a function of the address, the sizes, strides and block (fixed)."""
    kept: dict = {}

    def expand(base):
        ptr = base.data_ptr()
        args = kept.get(ptr)
        if args is None:
            if len(kept) >= limit:
                kept.clear()
            args = kept[ptr] = make(_rebase(proto, base), meta)
        return args
    return expand


def _triton_stream():
    """The function Triton's launches get the current stream from (torch's raw CUDA stream)."""
    from triton.runtime import driver

    return driver.active.get_current_stream
