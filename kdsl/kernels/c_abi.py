"""What an op exports (OpAbi, in the op's kdsl.ops family module, on its OpSpec) and how a kernel implementation is
launched (ImplLaunch, beside the unit's KernelImpl): one launch description, which Python evaluates for every launch
it makes (kdsl.kernels.described) and the AOT C dispatcher compiles.

Expressions (an ImplLaunch's `params`, `grid`, `runtime_constexprs`, an OpAbi's `m` and checks) are written once in
the subset both C and Python evaluate (kdsl.kernels.expressions).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kdsl.kernels.expressions import DTYPE_CODES, DTYPES  # noqa: F401  (the ABI's dtypes, named here with the ABI)


@dataclass(frozen=True)
class CArg:
    name: str
    ctype: str  # "ptr" (a device pointer), "i64" (a size or stride), "dtype" (kdsl_dtype)
    doc: str
    const: bool = True  # for pointers: read only


@dataclass(frozen=True)
class Check:
    """A refusal: when the C condition `fails` holds, return `status` with the message (printf format)."""
    fails: str
    message: str
    values: tuple[str, ...] = ()
    status: str = "KDSL_ERR_INVALID_ARGUMENT"



def fits_in_32_bits(op: str, names) -> Check:
    """The refusal of sizes and strides a launch passes as 32-bit integers."""
    return Check(" || ".join(f"{name} > 2147483647" for name in names), f"{op}: sizes and strides must fit in 32 bits")


def not_null(op: str, sizes, pointers, optional: str = "") -> Check:
    """The refusal of a NULL pointer where the call has work (every size in `sizes` above 0); `optional` names the
    pointer that may be NULL."""
    named = ", ".join(pointers[:-1]) + f" and {pointers[-1]}"
    return Check(" && ".join(f"{size} > 0" for size in sizes) + " && (" + " || ".join(f"{p} == 0" for p in pointers)
                 + ")", f"{op}: {named} must not be NULL" + (f" ({optional} may be)" if optional else ""))

@dataclass(frozen=True)
class TmaDescriptor:
    """A kernel parameter passed as a host TMA descriptor over `base` (Triton's `TensorDescriptor(base, shape,
    strides, block)`, or Gluon's with the block's default NVMMA shared layout for a Gluon kernel). The C side
    encodes it with cuTensorMapEncodeTiled; the box, swizzle and element type come from the compiled kernel's
    metadata (tensordesc_meta), and the kernel parameters it expands to from the compiled kernel's PTX (Triton
    3.6 and 3.9: the CUtensorMap by value, then the shape as int32s and the strides as int64s)."""
    base: str  # the op's pointer argument
    element: str  # Triton element type, or "dtype:ARG"
    shape: tuple  # expressions, outermost dimension first (elements)
    strides: tuple  # expressions in elements, the last one 1
    block: tuple  # expressions (the tile): the descriptor's block_shape


@dataclass(frozen=True)
class ImplLaunch:
    """How one kernel implementation of the op is launched, from the op's C arguments (`values` gives them for a
    Python call): kdsl.kernels.described evaluates it for each launch, the AOT C dispatcher compiles it."""
    params: tuple[tuple[str, str], ...]  # (kernel parameter, expression); pointers are the op's "ptr" args
    pointer_types: dict  # kernel pointer parameter -> Triton element type, or "dtype:ARG" (varies with ARG)
    grid: tuple[str, str, str]
    constexprs: callable  # (tile params, scheme fields) -> {name: value}
    options: callable  # (tile params) -> {num_warps: .., num_stages: ..}: the launch options
    # (the op's launch arguments, as its units' launch functions take them, before the tile) -> {C argument: value}:
    # tensors for pointers (None for NULL), integers for sizes and strides, kdsl_dtype codes for dtypes.
    values: callable = None
    kernel: str = "{module}"  # the @triton.jit function in the implementation's module ({module}, {entry}, {impl})
    # Constexprs computed from the call's arguments: (name, expression, the values it can take).
    # Each value is a separate compile; the dispatcher computes the expression and matches it. The values
    # SPLIT (at most one entry, the last) are a K split: the expression is the split Python launches with,
    # the exporter compiles the splits the op's problems reach (and 1), and the dispatcher takes the largest
    # exported split not above the one asked for; the grid and the scratch sizes may name it as `split`.
    # The values EXACT: the value itself, compiled for each value the problems reaching the tile give it; other
    # values are refused by the tile (kdsl.aot.plan.exact_values).
    runtime_constexprs: tuple = ()
    # Constexprs that follow the dtype arguments: (dtypes {argument: name}) -> {name: value}.
    dtype_constexprs: callable = None
    # Constexprs that differ under Triton's CPU interpreter (where C never runs): {name: value}, e.g. fp32 math
    # where the GPU takes fp16 instructions the interpreter does not model.
    interpreted: dict = field(default_factory=dict)
    # Pointer parameters Python passes as a view of the argument's memory in another element type (C passes the
    # address): {parameter: Triton element type}, e.g. the (scale, zero) pairs read as int32 over fp16 scales.
    views: dict = field(default_factory=dict)
    # Split-K scratch: (kernel pointer parameter of the fp32 workspace, of the int32 counters, workspace
    # elements, counters) -- expressions that may name `split`. With split 1 the parameters' own expressions
    # (`scratch_alias`, the output) are passed, so no scratch is taken.
    scratch: tuple | None = None
    scratch_alias: str = ""
    # Parameters passed as host TMA descriptors: {parameter: TmaDescriptor}; in `params` they appear as
    # (parameter, "desc").
    descriptors: dict = field(default_factory=dict)
    # A condition (expression, non-zero = refused) under which the kernel cannot take the call, and where the
    # call then goes: "tile" -- the registry's refusal function says the same, so the next tile serving the call
    # (its alternative), else the entry's last tile, as KernelEntry.tile_for(m, n, call) picks; "entry" -- a
    # condition Python meets by copying the operands (kdsl.ops makes them contiguous and aligned), which C
    # cannot: the call goes to the kernel the registry picks with this entry disabled. (Python's launches follow
    # the registry's choice, which has refused such calls already.)
    refuses: str = ""
    refused_to: str = "tile"
    # Calls the kernel would compute wrongly, which Python refuses even where a caller launches the unit directly:
    # ((condition expression, ValueError message), ...).
    raises: tuple = ()
    # The kernel takes a RELEASE constexpr (False in `constexprs`) under which its programs let the next kernel on
    # the stream launch at once (griddepcontrol.launch_dependents): a kernel launched dependent after it (one that
    # waits for it, gdc_wait, before reading anything) is placed while this one's last programs run. True where
    # the device can launch dependents: sm_90 and later (Python: kdsl.kernels.host.dependent_launches; the
    # exporter: the specialization's arch).
    releases: bool = False


SPLIT = "split"  # ImplLaunch.runtime_constexprs: the values of a K split (see there)
# ImplLaunch.runtime_constexprs: a constexpr taking the call's exact value (a Gluon kernel's K, which it unrolls):
# the values the op's representative problems give it on that tile are compiled, and a call with any other value
# is refused by the tile (it goes to the next serving tile, its alternative, as a registry refusal sends it).
EXACT = "exact"


@dataclass(frozen=True)
class OpAbi:
    op: str
    function: str  # the C function, e.g. kdsl_fp8_gemm
    summary: str
    args: tuple[CArg, ...]
    dtype_choices: dict  # dtype argument -> allowed dtype names
    checks: tuple[Check, ...]
    nothing_to_do: str  # C condition: return KDSL_OK without launching
    # What the registry buckets by M: an argument's name (rows), or an expression of the launch subset (the grouped
    # GEMMs bucket by rows per expert, as kdsl.ops computes it); then `with_m` moves a problem to a given bucket M.
    m: str
    n: str | None  # and by N (an argument's name), for definitions that tile by N
    problems: callable  # () -> iterable of {arg: value}: the calls whose specializations are compiled
    # impl name -> why it is not exported (a unit without a C launch is not exported either).
    unexportable: dict = field(default_factory=dict)
    # Arguments whose values select constexprs ({argument: values}): the assumption-free specializations
    # cover every combination of them (with no K split), so any call finds a cubin.
    call_flags: dict = field(default_factory=dict)
    # Bench shape files (kdsl.bench.shapes) this op exports for: {bench op: (case) -> {exported op: problems}}.
    bench_problems: dict = field(default_factory=dict)
    in_forward: bool = True  # a model's forward runs it (False: a load-time conversion, exported when named)
    # (problem, m) -> the problem with `m` evaluating to the given value, where `m` is an expression (None: `m` is
    # an argument's name, which is set): kdsl.aot.plan compiles a tile that no problem reaches on such problems.
    with_m: callable = None

