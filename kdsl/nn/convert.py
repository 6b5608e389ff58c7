"""Put kdsl's quantized linears into a model from float weights: quantize_ (checkpoints: kdsl.checkpoint).

It checks everything before it changes anything, so a refusal leaves the model as it was.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from kdsl.nn.schemes import handler_for

FilterFn = Callable[[nn.Module, str], bool]


def _swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put new where name is; returns what was there."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


FILTERED_OUT = "filter_fn returned False"


@dataclass
class QuantizeReport:
    """What kdsl.quantize_ did, by module name ("" is the model itself): `replaced` maps each replaced nn.Linear
    to its new module's class name, `skipped` each nn.Linear left as it is to the reason. `unservable` is the
    part of skipped quantize_ warns about (strict=True raises on it): layers filter_fn kept but the scheme's
    kernels cannot take; layers filter_fn left out are skipped with the reason FILTERED_OUT, silently."""

    scheme: str
    replaced: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def unservable(self) -> dict[str, str]:
        return {name: why for name, why in self.skipped.items() if why != FILTERED_OUT}

    def __str__(self) -> str:
        lines = [f"quantize_ to {self.scheme}: {len(self.replaced)} replaced, {len(self.skipped)} skipped"]
        lines += [f"  replaced {_label(name)}: {cls}" for name, cls in self.replaced.items()]
        lines += [f"  skipped {_label(name)}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def quantize_(model: nn.Module, scheme, filter_fn: FilterFn | None = None, *, strict: bool = False,
              return_report: bool = False):
    """Replace, in place, each nn.Linear of model for which filter_fn(module, name) holds (default: every
    nn.Linear) and whose shapes the scheme's kernels take with FP8Linear (BlockFP8) or W4A16Linear (GPTQ, AWQ),
    as torchao's quantize_ does. GPTQ and AWQ weights come from round-to-nearest (kdsl.ops.gptq_quantize), not
    from a calibrated GPTQ/AWQ run.

    Layers filter_fn keeps but the kernels cannot take (say in_features = 200 for 128-wide activation groups)
    are left as they are, and one warning (UserWarning) lists each with the reason; strict=True raises a
    ValueError naming them instead. A scheme with no generated kernel for an op its module calls raises
    kdsl.SchemeNotServedError naming the op. Every replacement is built before any is put in: an error changes
    nothing.

    Returns model (the replacement itself when model is an nn.Linear), or with return_report=True the pair
    (model, QuantizeReport): what was replaced, what was skipped and why (as load_state_dict(strict=False)
    reports keys)."""
    handler = handler_for(scheme)  # a scheme type with no handler is refused here, before anything is looked at
    report = QuantizeReport(scheme.name)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        why = FILTERED_OUT if filter_fn is not None and not filter_fn(module, name) else handler.unservable(
            scheme, module.in_features, module.out_features)
        if why is None:
            chosen.append((name, module))
        else:
            report.skipped[name] = why
    unservable = report.unservable
    listed = "; ".join(f"{_label(name)} ({_shape(model.get_submodule(name))}): {why}"
                       for name, why in unservable.items())
    if unservable and strict:
        raise ValueError(f"quantize_(strict=True): {len(unservable)} nn.Linear layer(s) cannot be quantized to "
                         f"{scheme.name}: {listed}; nothing was changed")
    built = [(name, handler.from_float(scheme, module)) for name, module in chosen]
    if unservable:  # after the builds: a scheme refused outright raises without this warning first
        warnings.warn(f"kdsl.quantize_: left {len(unservable)} nn.Linear layer(s) unquantized, their shapes do not "
                      f"fit {scheme.name}'s kernels: {listed} (strict=True raises instead; return_report=True "
                      f"returns the report)", stacklevel=2)
    report.replaced = {name: type(new).__name__ for name, new in built}
    for name, new in built:
        if name == "":
            model = new
            break
        _swap(model, name, new)
    return (model, report) if return_report else model


def _label(name: str) -> str:
    return repr(name) if name else "the model itself"


def _shape(linear: nn.Linear) -> str:
    return f"Linear({linear.in_features}, {linear.out_features})"
