"""What `kdsl aot` reads of the ops and kernel units: each op's C ABI (its OpSpec's c_abi, kdsl.kernels.c_abi.OpAbi)
and how each kernel unit is launched (the launch descriptions its launch evaluates, KernelImpl.launch_descriptions),
with the evaluator of the expressions they are written in (kdsl.kernels.expressions).

One description per op and per unit serves four readers: Python's launches (kdsl.kernels.described), the exporter
(which specializations to compile), the C emitter (the dispatcher's checks, tile choice, kernel arguments and grid)
and the tests (which compare the compiled C dispatcher's launches with Python's).
"""
from __future__ import annotations

import functools

from kdsl.kernels import find_impl
from kdsl.kernels.c_abi import EXACT, SPLIT, CArg, Check, ImplLaunch, OpAbi, TmaDescriptor  # noqa: F401
from kdsl.kernels.expressions import (DTYPE_CODES, DTYPES, HELPERS, ExpressionError, bad_tma_stride,  # noqa: F401
                                      dtype_size, evaluate, fill, programs, split_cap, split_for, tma_stride)
from kdsl.schema.scheme import launch_values

SPLIT_SMS = (108, 132)  # SM counts the exporter compiles K splits for (A100, H100/H200); other counts: see SPLIT


@functools.cache
def _op_abis() -> dict:
    from kdsl.ops.library import declared_specs  # kdsl/__init__ imports kdsl.aot before kdsl.ops: read when asked

    return {spec.name: spec.c_abi for spec in declared_specs() if spec.c_abi is not None}


def __getattr__(name: str):
    """OPS: {op name: OpAbi} of every op whose OpSpec carries a C ABI, in the ops' declaration order."""
    if name == "OPS":
        return _op_abis()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def launch_for(abi: OpAbi, entry, impl: str) -> ImplLaunch | None:
    """The C launch of a tile's implementation in this entry: the unit's one for the entry's prepared weights
    layout where it has one, else its layout-independent one; None where the unit has no C launch."""
    unit = find_impl(abi.op, impl)
    if unit is None:
        return None
    weights = (entry.layout or {}).get("weights")
    return unit.launch_descriptions.get(weights or "") or unit.launch_descriptions.get("")


def scheme_values(entry) -> dict:
    """Scheme fields an expression may name: act_group, block_n, block_k, group_size, group_rows."""
    return launch_values(entry.scheme_fields)
