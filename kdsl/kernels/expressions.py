"""The expressions a launch description (kdsl.kernels.c_abi.ImplLaunch) is written in, which both Python and the AOT C
dispatcher evaluate: the same text, so the two cannot compute different launches.

The subset: names of the op's C arguments (kdsl.kernels.c_abi.OpAbi; in Python a pointer argument is the tensor, or
None), integer literals, the dtype codes (KDSL_F16, ...), + - * %, one comparison (== != < <= > >=), and the helpers
cdiv(a, b), div(a, b) (floor division of non-negative numbers), nonzero(p) (1 if p is not 0/NULL), either(p, q)
(p unless it is NULL, then q), split_cap and split_for (the K split, below; `sms` is the device's SM count, none
under the interpreter), least(a, b), addr(p) (a pointer's address), dtype_size(d) (bytes of a kdsl_dtype),
programs(work, persistent, per_sm, sms) (a persistent grid: min(work, per_sm * sms) where persistent, else work),
tma_stride(size, stride, cols, esize) and bad_tma_stride(size, stride, esize) (a TMA descriptor's stride of a
dimension, and whether it breaks TMA's 16-byte rule). `{NAME}` fields are filled from the tile (BLOCK_M, ...) and
the scheme (act_group, group_rows, ...: kdsl.schema.scheme.launch_values) before either language reads them.

Python reads an expression's parsed tree, held to the subset, and evaluates it by walking it (evaluate) or through
closures built from it once (compile_expression, for launches); nothing is executed.
"""
from __future__ import annotations

import ast
import functools
import operator

import torch


# The dtypes the ABI names (kdsl_dtype in kdsl_aot.h): C enum name, Triton pointer type, torch dtype name.
DTYPES = {
    "bf16": ("KDSL_BF16", "bf16", "bfloat16"),
    "f16": ("KDSL_F16", "fp16", "float16"),
    "f32": ("KDSL_F32", "fp32", "float32"),
}
DTYPE_CODES = {name: index for index, name in enumerate(DTYPES)}
DTYPE_NAMES = list(DTYPES)  # code -> name
TORCH_DTYPE_CODES = {getattr(torch, torch_name): DTYPE_CODES[name] for name, (_, _, torch_name) in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A torch dtype as the ABI's kdsl_dtype code."""
    return TORCH_DTYPE_CODES[dtype]


def fill(expression: str, tile: dict, scheme: dict) -> str:
    """An expression with its {FIELD}s replaced by the tile's and the scheme's values (split options left
    unset are 0: the defaults)."""
    values = {"split_min_steps": 0, "split_fill": 0, **scheme,
              **{k: int(v or 0) for k, v in tile.items() if isinstance(v, int) or v is None}}
    return expression.format(**values)


# ---- the helpers, as the C dispatcher has them (kdsl__<name> in kdsl_aot_internal.h) --------------------------------

SPLIT_FILL = 2  # programs per SM the K split plans for, unless a tile's split_fill says otherwise
INTERPRETER_SMS = 4  # a persistent grid under Triton's interpreter (no SM count): a few programs still loop
# What a program costs beyond its K steps (launch, pipeline fill, split-K store), in K steps. From an H200 table of
# every split on the bench shapes: it keeps a tile from splitting into programs of a few steps each, or into a
# partial extra wave.
PROGRAM_COST_STEPS = 6


def split_cap(k_steps: int, split_k: int, min_steps: int) -> int:
    """The largest K split a tile allows: at most split_k, each split at least min_steps K steps (0: one)."""
    return max(1, min(split_k, k_steps // (min_steps or 1)))


def split_for(k_steps: int, tiles: int, split_k: int, min_steps: int, fill_per_sm: int, sms: int | None) -> int:
    """The K split a tile launches with: with an SM count, the split whose programs finish soonest, counted in waves
    of fill_per_sm (0: SPLIT_FILL) programs per SM times each program's K steps plus its fixed cost, and no split
    once the tiles alone fill a wave; without one (sms None: the interpreter), the largest split allowed."""
    cap = split_cap(k_steps, split_k, min_steps)
    if sms is None:
        return cap
    slots = (fill_per_sm or SPLIT_FILL) * sms
    if tiles >= slots:
        return 1
    return min(range(1, cap + 1),
               key=lambda s: ((-(-tiles * s // slots)) * (-(-k_steps // s) + PROGRAM_COST_STEPS), s))


def dtype_size(code: int) -> int:
    """Bytes of an element of a kdsl_dtype (its code)."""
    return {"bf16": 2, "f16": 2, "f32": 4}[DTYPE_NAMES[code]]


def programs(work: int, persistent: int, per_sm: int, sms: int | None) -> int:
    """A persistent grid: per_sm programs per SM loop over the work (sms None: the interpreter's nominal few)."""
    return min(work, per_sm * (sms or INTERPRETER_SMS)) if persistent else work


def tma_stride(size: int, stride: int, cols: int, esize: int) -> int:
    """A dimension of size 1 is never stepped, so TMA gets the row padded to 16 bytes (in elements) instead of
    whatever stride it has."""
    return stride if size > 1 else -(-cols * esize // 16) * 16 // esize


def bad_tma_stride(size: int, stride: int, esize: int) -> int:
    """1 where a stepped dimension's stride (in bytes) is 0 or not a multiple of 16 (kdsl.ops.check.alignment)."""
    return int(size > 1 and (stride == 0 or stride * esize % 16 != 0))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _div(a: int, b: int) -> int:
    return a // b


def _is_null(p) -> bool:
    """A pointer argument's NULL: None in Python, 0 as an address."""
    return p is None or (type(p) is int and p == 0)


def _nonzero(p) -> int:
    return 0 if _is_null(p) else 1


def _either(p, q):
    return q if _is_null(p) else p


def _addr(p) -> int:
    return p if type(p) is int else p.data_ptr()


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
def parse(expression: str) -> ast.expr:
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


def _value(node: ast.expr, values: dict):
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


def evaluate(expression: str, values: dict):
    """Evaluate a filled expression by walking its tree: an integer, or (a pointer's expression in Python) the
    argument it names."""
    tree = parse(expression)
    try:
        value = _value(tree, values)
    except ExpressionError as error:
        raise ExpressionError(f"{expression!r}: {error}") from None
    return int(value) if isinstance(value, int) else value


@functools.lru_cache(maxsize=4096)
def compile_expression(expression: str):
    """A filled expression as a function of the values it names, built once from its tree (closures over the
    subset's operators and helpers, with the parts that name no value computed here): a launch evaluates its
    expressions on every call it describes. A name with no value raises KeyError."""
    constant, compiled = _compiled(parse(expression))
    if constant:
        return lambda values: compiled
    return compiled


# The helpers computed at compile time where their arguments are constants (all but the ones a test may stand in for).
_FOLDED = frozenset(HELPERS) - {"split_for", "split_cap"}


def _compiled(node: ast.expr) -> tuple[bool, object]:
    """(True, its value) for a subtree that names no value, else (False, a function of the values)."""
    if isinstance(node, ast.Constant):
        return True, node.value
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return True, _CONSTANTS[node.id]
        return False, operator.itemgetter(node.id)
    if isinstance(node, ast.UnaryOp):
        constant, operand = _compiled(node.operand)
        return (True, -operand) if constant else (False, lambda values: -operand(values))
    if isinstance(node, (ast.BinOp, ast.Compare)):
        if isinstance(node, ast.BinOp):
            op, pair = _BINARY[type(node.op)], (node.left, node.right)
        else:
            compare = _COMPARE[type(node.ops[0])]
            op, pair = (lambda a, b: int(compare(a, b))), (node.left, node.comparators[0])
        (left_constant, left), (right_constant, right) = map(_compiled, pair)
        if left_constant and right_constant:
            return True, op(left, right)
        if left_constant:
            return False, lambda values: op(left, right(values))
        if right_constant:
            return False, lambda values: op(left(values), right)
        return False, lambda values: op(left(values), right(values))
    # A helper call. Looked up on each call, so a test can stand in for one (the K split an export lacks).
    name = node.func.id
    args = [_compiled(arg) for arg in node.args]
    if name in _FOLDED and all(constant for constant, _ in args):
        return True, HELPERS[name](*(value for _, value in args))
    getters = tuple((lambda values, v=value: v) if constant else value for constant, value in args)
    if len(getters) == 1:
        [only] = getters
        return False, lambda values: HELPERS[name](only(values))
    if len(getters) == 2:
        first, second = getters
        return False, lambda values: HELPERS[name](first(values), second(values))
    return False, lambda values: HELPERS[name](*(arg(values) for arg in getters))
