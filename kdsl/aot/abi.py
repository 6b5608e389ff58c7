"""What `kdsl aot` reads of the ops and kernel units: each op's C ABI (its OpSpec's c_abi, kdsl.kernels.c_abi.OpAbi)
and how each kernel unit is launched from it (the unit's KernelImpl.c_launches), and the evaluator of the
expressions they are written in.

One description per op and per unit serves three readers: the exporter (which specializations to compile), the
C emitter (the dispatcher's checks, tile choice, kernel arguments and grid) and the tests (which compare each
unit's C launch with what its Python launch() computes, so the two cannot drift apart unnoticed).

Expressions (`params`, `grid`, `runtime_constexprs`) are written once in a subset both C and Python evaluate
(Python through evaluate(), which walks the parsed tree and refuses anything else):
names of the op's C arguments, integer literals, the dtype codes (KDSL_F16, ...), + - * %, one comparison
(== != < <= > >=), and the helpers
cdiv(a, b), div(a, b) (floor division of non-negative numbers), nonzero(p) (1 if p is not 0/NULL), either(p, q)
(p unless it is NULL, then q), split_cap and split_for (the generated modules' K split, below; `sms` is the
device's SM count), least(a, b), addr(p) (a pointer's address), dtype_size(d) (bytes of a kdsl_dtype),
programs(work, persistent, per_sm, sms) (a persistent grid: min(work, per_sm * sms) where persistent, else work),
tma_stride(size, stride, cols, esize) and bad_tma_stride(size, stride, esize) (a TMA descriptor's stride of a
dimension, and whether it breaks TMA's 16-byte rule; see below). `{NAME}` fields are filled from the tile
(BLOCK_M, ...) and the scheme (act_group, group_rows, ...) before either language sees them.
"""
from __future__ import annotations

import ast
import functools
import operator

from kdsl.kernels import find_impl
from kdsl.kernels.c_abi import (DTYPE_CODES, DTYPES, EXACT, SPLIT, CArg, Check, ImplLaunch, OpAbi,  # noqa: F401
                                TmaDescriptor)
from kdsl.schema.scheme import group_rows

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
    return unit.c_launches.get(weights or "") or unit.c_launches.get("")


def split_cap(k_steps: int, split_k: int, min_steps: int) -> int:
    return max(1, min(split_k, k_steps // (min_steps or 1)))


def split_for(k_steps: int, tiles: int, split_k: int, min_steps: int, fill: int, sms: int) -> int:
    """kdsl/kernels/host.py's split_for (its constants: SPLIT_FILL 2, PROGRAM_COST_STEPS 6); C has the same."""
    cap = split_cap(k_steps, split_k, min_steps)
    slots = (fill or 2) * sms
    if tiles >= slots:
        return 1
    return min(range(1, cap + 1), key=lambda s: ((-(-tiles * s // slots)) * (-(-k_steps // s) + 6), s))


def dtype_size(code: int) -> int:
    """Bytes of an element of a kdsl_dtype (its code)."""
    return {"bf16": 2, "f16": 2, "f32": 4}[list(DTYPES)[code]]


def programs(work: int, persistent: int, per_sm: int, sms: int) -> int:
    """A persistent grid: per_sm programs per SM loop over the work (_programs in the generated modules)."""
    return min(work, per_sm * sms) if persistent else work


def tma_stride(size: int, stride: int, cols: int, esize: int) -> int:
    """_tma_strides in fp8_bmm_tma_sm90.py.j2: a dimension of size 1 is never stepped, so TMA gets the row padded
    to 16 bytes (in elements) instead of whatever stride it has."""
    return stride if size > 1 else -(-cols * esize // 16) * 16 // esize


def bad_tma_stride(size: int, stride: int, esize: int) -> int:
    """1 where a stepped dimension's stride (in bytes) is 0 or not a multiple of 16 (kdsl.ops.check.alignment)."""
    return int(size > 1 and (stride == 0 or stride * esize % 16 != 0))


def scheme_values(entry) -> dict:
    """Scheme fields an expression may name: act_group, block_n, block_k, group_size."""
    fields = entry.scheme_fields
    values = {}
    if "act_group" in fields:
        values["act_group"] = fields["act_group"]
    if "weight_block" in fields:
        values["block_n"], values["block_k"] = fields["weight_block"]
    if "group_size" in fields:
        values["group_size"] = fields["group_size"]
        # The kernels' GROUP_SIZE constexpr (group_size -1, one group over all of K, is 2**30).
        values["group_rows"] = group_rows(fields["group_size"])
    return values


def fill(expression: str, tile: dict, scheme: dict) -> str:
    """An expression with its {FIELD}s replaced by the tile's and the scheme's values (split options left
    unset are 0: the modules' defaults)."""
    values = {"split_min_steps": 0, "split_fill": 0, **scheme,
              **{k: int(v or 0) for k, v in tile.items() if isinstance(v, int) or v is None}}
    return expression.format(**values)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _div(a: int, b: int) -> int:
    return a // b


def _nonzero(p: int) -> int:
    return int(p != 0)


def _either(p: int, q: int) -> int:
    return p if p else q


def _addr(p: int) -> int:
    return p


# The helpers an expression may call, as the C dispatcher has them (kdsl__<name> in kdsl_aot_internal.h).
HELPERS = {"cdiv": _cdiv, "div": _div, "nonzero": _nonzero, "either": _either, "split_cap": split_cap,
           "split_for": split_for, "least": min, "addr": _addr, "dtype_size": dtype_size, "programs": programs,
           "tma_stride": tma_stride, "bad_tma_stride": bad_tma_stride}
_CONSTANTS = {code: DTYPE_CODES[name] for name, (code, *_) in DTYPES.items()}  # KDSL_F16, ...
# The operators both languages read alike on the subset's integers. Floor division is div(): `//` opens a C
# comment, and C's `/` is not Python's.
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}


class ExpressionError(ValueError):
    """An expression outside the subset both C and Python read alike, or naming a value it was not given."""


@functools.lru_cache(maxsize=4096)
def _parse(expression: str) -> ast.expr:
    """The expression's tree, checked once to hold only what the subset allows."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as error:
        raise ExpressionError(f"{expression!r} is not an expression of the launch subset: {error.msg}") from None
    for node in ast.walk(tree):
        if not _in_subset(node):
            shown = ast.unparse(node) if isinstance(node, ast.expr) else f"the operator {type(node).__name__}"
            raise ExpressionError(f"{expression!r}: {shown} is outside the launch subset (names, integers, "
                                  f"+ - * %, one comparison, calls of {', '.join(HELPERS)})")
    return tree


def _in_subset(node: ast.AST) -> bool:
    if isinstance(node, (ast.Name, ast.Load, ast.BinOp, ast.USub, *_BINARY, *_COMPARE)):
        return True  # a BinOp's or UnaryOp's operator is a node of its own, checked on its own
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub)
    if isinstance(node, ast.Compare):
        return len(node.ops) == 1  # C would read a < b < c as (a < b) < c
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in HELPERS and not node.keywords
    return False


def _value(node: ast.expr, values: dict) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in values:
            return values[node.id]
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise ExpressionError(f"{node.id} has no value (given: {', '.join(sorted(values)) or 'nothing'})")
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, values), _value(node.right, values))
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand, values)
    if isinstance(node, ast.Compare):
        return int(_COMPARE[type(node.ops[0])](_value(node.left, values), _value(node.comparators[0], values)))
    return HELPERS[node.func.id](*(_value(arg, values) for arg in node.args))


def evaluate(expression: str, values: dict) -> int:
    """Evaluate a filled expression in Python (the C dispatcher compiles the same text): its tree, parsed once
    and held to the subset, is walked here; nothing is executed."""
    tree = _parse(expression)
    try:
        return int(_value(tree, values))
    except ExpressionError as error:
        raise ExpressionError(f"{expression!r}: {error}") from None
