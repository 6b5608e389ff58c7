"""A kernel implementation's launch from its launch description (kdsl.kernels.c_abi.ImplLaunch): the one place the
description is read for Python, as the AOT C dispatcher reads it for C.

A unit declares `launch=described(C_LAUNCH)` (or one description per prepared weights layout) instead of writing a
launch function: a call's launch is the description evaluated on the op's C arguments (its `values`), with what only
Python has added here, the same way for every unit:
- pointers are the call's tensors, as they are or as a view of their memory in another element type
  (ImplLaunch.views);
- descriptors are Triton's host TMA descriptors (Gluon's, with the block's default shared layout, for a Gluon kernel);
- split-K scratch comes from kdsl.kernels.host's buffers, kept per kernel and device;
- under Triton's interpreter (tensors on the CPU) there is no SM count, `interpreted` constexprs replace the GPU's,
  and a PDL kernel launches as an ordinary one; on the GPU a PDL kernel gets its launch attribute, and a kernel
  that releases its dependents (ImplLaunch.releases) does so on sm_90+;
- a call the kernel would compute wrongly (ImplLaunch.raises) raises ValueError.

The expressions are filled with a tile's and the scheme's numbers and compiled once per (description, module,
tile); a call then evaluates closures (kdsl.kernels.expressions.compile_expression).
"""
from __future__ import annotations

import torch

from kdsl.kernels import host
from kdsl.kernels.base import Launch
from kdsl.kernels.c_abi import SPLIT, ImplLaunch
from kdsl.kernels.expressions import DTYPE_NAMES, compile_expression, fill

# Triton element types, as torch dtypes: of ImplLaunch.views and of descriptors' bases.
_ELEMENTS = {"fp8e4nv": torch.float8_e4m3fn, "fp32": torch.float32, "i32": torch.int32, "bf16": torch.bfloat16,
             "fp16": torch.float16}
_BOUND: dict = {}  # (id(description), id(generated), id(tile)) -> _Bound, with the three kept alive in it
_BOUND_LIMIT = 4096


class DescribedLaunch:
    """A unit's launch function, launch(generated, *op_args, tile) -> Launch, evaluating its description for the
    generated module's prepared weights layout ("" where the unit has one description for every layout)."""

    def __init__(self, descriptions: dict):
        self.descriptions = descriptions

    def __call__(self, generated, *args) -> Launch:
        *op_args, tile = args
        description = self.descriptions.get(generated.layout) or self.descriptions[""]
        return evaluate(description, generated, description.values(*op_args), tile)


def described(description: ImplLaunch | None = None, **by_layout: ImplLaunch) -> DescribedLaunch:
    """The launch function of a unit with one description (every layout) or one per prepared weights layout
    (keyword: the layout's name)."""
    descriptions = dict(by_layout)
    if description is not None:
        descriptions[""] = description
    return DescribedLaunch(descriptions)


class _Bound:
    """A description with one tile's and one scheme's numbers filled in and its expressions compiled."""

    __slots__ = ("keep", "kernel", "gluon", "constexprs", "runtime", "split", "params", "grid", "scratch",
                 "dtype_constexprs", "interpreted", "raises", "device_arg")

    def __init__(self, description: ImplLaunch, generated, tile: dict):
        self.keep = (description, generated, tile)
        scheme = generated.scheme

        def compiled(expression: str):
            return compile_expression(fill(expression, tile, scheme))

        suffix = description.kernel.format(module="", entry="", impl="")
        self.kernel = generated.kernels[suffix]
        self.gluon = bool(getattr(self.kernel, "is_gluon", lambda: False)())
        self.constexprs = {**generated.constexprs, **description.constexprs(tile, scheme), **description.options(tile)}
        self.runtime = tuple((name, compiled(expression), kind) for name, expression, kind in
                             description.runtime_constexprs)
        self.split = next((name for name, _, kind in description.runtime_constexprs if kind == SPLIT), None)
        self.dtype_constexprs = description.dtype_constexprs
        self.interpreted = description.interpreted
        scratch = {}
        if description.scratch is not None:
            workspace, counters, workspace_elems, counter_count = description.scratch
            scratch = {workspace: 0, counters: 1}
            self.scratch = (compiled(workspace_elems), compiled(counter_count))
        else:
            self.scratch = None
        params = []
        for name, expression in description.params:
            if name in description.descriptors:
                params.append((name, "desc", self._descriptor(description.descriptors[name], compiled)))
            elif name in scratch:
                params.append((name, "scratch", (scratch[name], compiled(expression))))
            elif name in description.views:
                params.append((name, "view", (compiled(expression), _ELEMENTS[description.views[name]])))
            else:
                params.append((name, "value", compiled(expression)))
        self.params = tuple(params)
        # The argument whose device the launch is on: the first pointer the parameters pass.
        self.device_arg = next(expression for name, expression in description.params
                               if name in description.pointer_types and expression.isidentifier())
        self.grid = tuple(compiled(expression) for expression in description.grid)
        self.raises = tuple((compiled(condition), message) for condition, message in description.raises)

    def _descriptor(self, tma, compiled):
        base = compile_expression(tma.base)
        element = _ELEMENTS.get(tma.element)  # None: "dtype:ARG", the base's own dtype
        shape = tuple(compiled(e) for e in tma.shape)
        strides = tuple(compiled(e) for e in tma.strides)
        block = tuple(compiled(e) for e in tma.block)
        gluon = self.gluon

        def build(values):
            t = _as_element(base(values), element)
            dims = [e(values) for e in shape]
            steps = [e(values) for e in strides]
            box = [e(values) for e in block]
            if gluon:
                return host.gluon_descriptor(t, box, dims, steps)
            return host.tma_descriptor(t, dims, steps, box)
        return build


def _bound(description: ImplLaunch, generated, tile: dict) -> _Bound:
    key = (id(description), id(generated), id(tile))
    bound = _BOUND.get(key)
    if bound is None or bound.keep[2] is not tile or bound.keep[1] is not generated:
        if len(_BOUND) >= _BOUND_LIMIT:
            _BOUND.clear()
        bound = _BOUND[key] = _Bound(description, generated, tile)
    return bound


def _as_element(t, element):
    """t, or a view of its memory from its first element as `element` (what the kernel's pointer reads) where the
    two differ in size: an argument of another dtype of the same size goes as it is, for the op's checks and
    Triton's typing to see."""
    if element is None or t is None or t.element_size() == element.itemsize:
        return t
    size = max(1, element.itemsize // t.element_size())
    return t.as_strided((size,), (1,)).view(element)


def evaluate(description: ImplLaunch, generated, values: dict, tile: dict) -> Launch:
    """The launch `description` makes for a call (`values`: the op's C arguments, kdsl.kernels.c_abi.ImplLaunch's
    `values`) on `generated`'s kernel with the tile."""
    bound = _bound(description, generated, tile)
    device = values[bound.device_arg].device
    interpreted = device.type == "cpu"
    values["sms"] = None if interpreted else host.sm_count(device)
    try:
        for condition, message in bound.raises:
            if condition(values):
                raise ValueError(message)
        constexprs = bound.constexprs.copy()
        if description.releases:
            constexprs["RELEASE"] = host.dependent_launches(device)
        for name, compute, kind in bound.runtime:
            value = compute(values)
            constexprs[name] = bool(value) if type(kind) is tuple and type(kind[0]) is bool else value
        split = values["split"] = constexprs[bound.split] if bound.split else 1
        if bound.dtype_constexprs is not None:
            constexprs.update(bound.dtype_constexprs(
                {name: DTYPE_NAMES[value] for name, value in values.items() if name.endswith("_dtype")}))
        if split > 1:
            workspace_elems, counters = bound.scratch
            buffers = host.scratch_buffers(bound.kernel, device, workspace_elems(values), counters(values))
        params = []
        for _, kind, how in bound.params:
            if kind == "value":
                params.append(how(values))
            elif kind == "view":
                compute, element = how
                params.append(_as_element(compute(values), element))
            elif kind == "desc":
                params.append(how(values))
            else:
                which, alias = how
                params.append(buffers[which] if split > 1 else alias(values))
        grid = tuple(compute(values) for compute in bound.grid)
    except KeyError as error:
        raise KeyError(f"{generated.name}: the launch description names {error}, which the call's values "
                       f"({', '.join(sorted(values))}) do not give") from None
    if interpreted:
        constexprs.update(bound.interpreted)
    if constexprs.get("PDL"):
        if interpreted or host.INTERPRETING:  # Triton's interpreter has no grid dependency control
            constexprs["PDL"] = False
        else:
            constexprs["launch_pdl"] = True
    return Launch(bound.kernel, grid, tuple(params), constexprs)
