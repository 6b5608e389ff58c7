"""The C ABI of each exported op, and how each exportable kernel of that op is launched from it.

One description serves three readers: the exporter (which specializations to compile), the C emitter (the
dispatcher's checks, tile choice, kernel arguments and grid) and the tests (which compare it with what the
generated module's launch() computes, so the two cannot drift apart unnoticed).

Expressions (`params`, `grid`, `runtime_constexprs`) are written once in a subset both C and Python evaluate
(Python through evaluate(), which walks the parsed tree and refuses anything else):
names of the op's C arguments, integer literals, the dtype codes (KDSL_F16, ...), + - * %, one comparison
(== != < <= > >=), and the helpers
cdiv(a, b), div(a, b) (floor division of non-negative numbers), nonzero(p) (1 if p is not 0/NULL), either(p, q)
(p unless it is NULL, then q), split_cap and split_for (the generated modules' K split, below; `sms` is the
device's SM count), least(a, b), addr(p) (a pointer's address), dtype_size(d) (bytes of a kdsl_dtype),
programs(work, persistent, per_sm, sms) (a persistent grid: min(work, per_sm * sms) where persistent, else work),
tma_stride(size, stride, cols, esize) and bad_tma_stride(size, stride, esize) (a TMA descriptor's stride of a
dimension, and whether it breaks TMA's 16-byte rule; see below). `{NAME}` fields are filled from the tile (BLOCK_M, ...) and the scheme (act_group, group_rows, ...)
before either language sees them.
"""
from __future__ import annotations

import ast
import functools
import operator
from dataclasses import dataclass, field

from kdsl.schema.scheme import group_rows

# The dtypes the ABI names (kdsl_dtype in kdsl_aot.h): C enum name, Triton pointer type, torch dtype name.
DTYPES = {
    "bf16": ("KDSL_BF16", "bf16", "bfloat16"),
    "f16": ("KDSL_F16", "fp16", "float16"),
    "f32": ("KDSL_F32", "fp32", "float32"),
}
DTYPE_CODES = {name: index for index, name in enumerate(DTYPES)}


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


@dataclass(frozen=True)
class TmaDescriptor:
    """A kernel parameter that launch() passes as a host `TensorDescriptor(base, shape, strides, block)`. The C side
    encodes it with cuTensorMapEncodeTiled; the box, swizzle and element type come from the compiled kernel's
    metadata (tensordesc_meta), and the kernel parameters it expands to from the compiled kernel's PTX (Triton
    3.6 and 3.9: the CUtensorMap by value, then the shape as int32s and the strides as int64s)."""
    base: str  # the op's pointer argument
    element: str  # Triton element type, or "dtype:ARG"
    shape: tuple  # expressions, outermost dimension first (elements)
    strides: tuple  # expressions in elements, the last one 1
    block: tuple  # expressions (the tile), as launch() passes block_shape


@dataclass(frozen=True)
class ImplLaunch:
    """How the dispatcher launches one kernel implementation of the op (mirrors the module's launch())."""
    params: tuple[tuple[str, str], ...]  # (kernel parameter, expression); pointers are the op's "ptr" args
    pointer_types: dict  # kernel pointer parameter -> Triton element type, or "dtype:ARG" (varies with ARG)
    grid: tuple[str, str, str]
    constexprs: callable  # (tile params, scheme fields) -> {name: value}, as launch() passes them
    options: callable  # (tile params) -> {num_warps: .., num_stages: ..}, only those launch() passes
    kernel: str = "{module}"  # the @triton.jit function in the implementation's module ({module}, {entry}, {impl})
    # Constexprs launch() computes from the call's arguments: (name, expression, the values it can take).
    # Each value is a separate compile; the dispatcher computes the expression and matches it. The values
    # SPLIT (at most one entry, the last) are a K split: the expression is the split launch() would choose,
    # the exporter compiles the splits the op's problems reach (and 1), and the dispatcher takes the largest
    # exported split not above the one asked for; the grid and the scratch sizes may name it as `split`.
    # The values EXACT: the value itself, compiled for each value the problems reaching the tile give it; other
    # values are refused by the tile (kdsl.aot.plan.exact_values).
    runtime_constexprs: tuple = ()
    # Constexprs that follow the dtype arguments: (dtypes {argument: name}) -> {name: value}.
    dtype_constexprs: callable = None
    # Split-K scratch: (kernel pointer parameter of the fp32 workspace, of the int32 counters, workspace
    # elements, counters) -- expressions that may name `split`. With split 1, launch() passes the output
    # (`scratch_alias`) for both, so no scratch is taken.
    scratch: tuple | None = None
    scratch_alias: str = ""
    # Parameters launch() passes as host TMA descriptors: {parameter: TmaDescriptor}; in `params` they appear as
    # (parameter, "desc").
    descriptors: dict = field(default_factory=dict)
    # A condition (expression, non-zero = refused) under which the kernel cannot take the call, and where the
    # call then goes: "tile" -- the registry's refusal function says the same, so the next tile serving the call
    # (its alternative), else the entry's last tile, as KernelEntry.tile_for(m, n, call) picks; "entry" -- a
    # condition Python meets by copying the operands (kdsl.ops makes them contiguous and aligned), which C
    # cannot: the call goes to the kernel the registry picks with this entry disabled.
    refuses: str = ""
    refused_to: str = "tile"


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
    impls: dict  # impl name -> ImplLaunch
    problems: callable  # () -> iterable of {arg: value}: the calls whose specializations are compiled
    unexportable: dict = field(default_factory=dict)  # impl name -> why it is not exported
    # Arguments whose values select constexprs ({argument: values}): the assumption-free specializations
    # cover every combination of them (with no K split), so any call finds a cubin.
    call_flags: dict = field(default_factory=dict)
    # Bench shape files (kdsl.bench.shapes) this op exports for: {bench op: (case) -> {exported op: problems}}.
    bench_problems: dict = field(default_factory=dict)
    in_forward: bool = True  # a model's forward runs it (False: a load-time conversion, exported when named)
    # (problem, m) -> the problem with `m` evaluating to the given value, where `m` is an expression (None: `m` is
    # an argument's name, which is set): kdsl.aot.plan compiles a tile that no problem reaches on such problems.
    with_m: callable = None


# The representative problems of each op: its M values (the shipped definitions' tile buckets, each reached at
# least once, and their edges) times the sizes given. The full export uses the sizes of DeepSeek-V3 and Llama
# layers below; `kdsl aot --model` passes one model's (kdsl.aot.model).
ACT_QUANT_MS = (1, 2, 7, 16, 17, 32, 100, 128, 4096, 4097)
FP8_GEMM_MS = (1, 2, 7, 16, 17, 32, 100, 128, 129, 1024, 4096, 4097)
FP8_BMM_MS = (1, 4, 16, 17, 64, 128, 1024, 4096)
W4A16_MS = (1, 4, 16, 64, 128, 256, 1024)
# w4a16_gemm's (perm, contiguous_groups): no act-order; sorted act-order groups (contiguous); a v1 checkpoint's
# uneven act-order groups (not).
W4A16_ORDERS = ((0, 1), (1, 1), (1, 0))


def act_quant_problems(ks, ms=ACT_QUANT_MS, dtypes=tuple(DTYPES)):
    for m in ms:
        for k in ks:
            for dtype in dtypes:
                yield dict(M=m, K=k, ldx=k, x_dtype=dtype)


def _act_quant_problems():
    return act_quant_problems((512, 1536, 2048, 7168))


def fp8_gemm_problems(nks, ms=FP8_GEMM_MS, dtypes=tuple(DTYPES)):
    """nks: the (N, K) of the weights."""
    for m in ms:
        for n, k in nks:
            for dtype in dtypes:
                yield dict(M=m, N=n, K=k, lda=k, ldb=k, ldc=n, lda_s=k // 128, ldb_s=k // 128, out_dtype=dtype)


def _fp8_gemm_problems():
    return fp8_gemm_problems([(n, k) for n in (2112, 7168, 576, 24) for k in (2048, 7168)])


def _portable_constexprs(tile: dict, scheme: dict) -> dict:
    """The portable block-FP8 GEMMs' constexprs (fp8_gemm_portable.portable_constexprs, less the launch options)."""
    return {"BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
            "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major"}


def _portable_options(tile: dict) -> dict:
    return {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]}


# fp8_gemm / tma_persistent (launch() of fp8_gemm_tma_persistent.py.j2): tiles, K split and persistent grid.
_FP8_TILES = "cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
_FP8_SPLIT = f"split_for(cdiv(K, {{BLOCK_K}}), {_FP8_TILES}, {{SPLIT_K}}, {{split_min_steps}}, {{split_fill}}, sms)"
_FP8_PROGRAMS = (f"programs({_FP8_TILES} * split, {{persistent}}, {{split_fill}} + 2 * ({{split_fill}} == 0), sms)")


ACT_QUANT = OpAbi(
    op="act_quant",
    function="kdsl_act_quant",
    summary="Per-token, per-group activation quantization to e4m3: s = amax(|group|) / 448, q = e4m3(x / s).",
    args=(
        CArg("x", "ptr", "x [M, K] of x_dtype, row stride ldx elements, unit stride along K"),
        CArg("x_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("ldx", "i64", "row stride of x in elements (>= K)"),
        CArg("q", "ptr", "q [M, K] float8_e4m3fn, contiguous (output)", const=False),
        CArg("s", "ptr", "s [M, K / act_group] float32, contiguous (output)", const=False),
        CArg("M", "i64", "rows (tokens), >= 0"),
        CArg("K", "i64", "columns, a multiple of act_group"),
    ),
    dtype_choices={"x_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || K < 0", "act_quant: M = %lld and K = %lld must be >= 0", ("M", "K")),
        Check("K % {act_group} != 0", "act_quant: K = %lld must be a multiple of the group size {act_group}", ("K",)),
        Check("ldx < K", "act_quant: ldx = %lld must be >= K = %lld", ("ldx", "K")),
        Check("M > 2147483647 || K > 2147483647 || ldx > 2147483647",
              "act_quant: M, K and ldx must fit in 32 bits (M = %lld, K = %lld, ldx = %lld)", ("M", "K", "ldx")),
        Check("M > 0 && K > 0 && (x == 0 || q == 0 || s == 0)", "act_quant: x, q and s must not be NULL"),
    ),
    nothing_to_do="M == 0 || K == 0",
    m="M",
    n=None,
    impls={
        "rowwise": ImplLaunch(
            params=(("x_ptr", "x"), ("q_ptr", "q"), ("s_ptr", "s"), ("M", "M"), ("K", "K"), ("stride_xm", "ldx")),
            pointer_types={"x_ptr": "dtype:x_dtype", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
            grid=("cdiv(M, {BLOCK_M})", "div(K, {act_group})", "1"),
            constexprs=lambda tile, scheme: {"BLOCK_M": tile["BLOCK_M"], "ROUND_FIRST": False},
            options=lambda tile: {"num_warps": tile["num_warps"]},
        ),
    },
    problems=_act_quant_problems,
    bench_problems={"act_quant": lambda case: {"act_quant": act_quant_problems([case.k], ms=(case.m,))}},
)

FP8_GEMM = OpAbi(
    op="fp8_gemm",
    function="kdsl_fp8_gemm",
    summary="C = (a * a_s) @ (b * b_s)^T with DeepSeek-V3 block scaling, fp32 accumulation.",
    args=(
        CArg("a", "ptr", "a [M, K] float8_e4m3fn, row stride lda, unit stride along K"),
        CArg("lda", "i64", "row stride of a in elements (>= K)"),
        CArg("a_s", "ptr", "a_s [M, K / act_group] float32, row stride lda_s, unit stride along K"),
        CArg("lda_s", "i64", "row stride of a_s in elements (>= K / act_group)"),
        CArg("b", "ptr", "b [N, K] float8_e4m3fn, row stride ldb, unit stride along K (the weight)"),
        CArg("ldb", "i64", "row stride of b in elements (>= K)"),
        CArg("b_s", "ptr", "b_s [ceil(N / block_n), K / block_k] float32, row stride ldb_s, unit stride along K"),
        CArg("ldb_s", "i64", "row stride of b_s in elements (>= K / block_k)"),
        CArg("c", "ptr", "c [M, N] of out_dtype, row stride ldc, unit stride along N (output)", const=False),
        CArg("ldc", "i64", "row stride of c in elements (>= N)"),
        CArg("out_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("M", "i64", "rows of a and c, >= 0"),
        CArg("N", "i64", "rows of b, columns of c: a multiple of 8"),
        CArg("K", "i64", "a multiple of act_group, > 0"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "fp8_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        Check("K % {act_group} != 0", "fp8_gemm: K = %lld must be a multiple of {act_group}", ("K",)),
        Check("N % 8 != 0", "fp8_gemm: N = %lld must be a multiple of 8", ("N",)),
        Check("lda < K || ldb < K", "fp8_gemm: lda = %lld and ldb = %lld must be >= K = %lld", ("lda", "ldb", "K")),
        Check("ldc < N", "fp8_gemm: ldc = %lld must be >= N = %lld", ("ldc", "N")),
        Check("lda_s < K / {act_group} || ldb_s < K / {block_k}",
              "fp8_gemm: lda_s = %lld must be >= K / {act_group} and ldb_s = %lld >= K / {block_k}",
              ("lda_s", "ldb_s")),
        Check("M > 2147483647 || N > 2147483647 || K > 2147483647 || lda > 2147483647 || ldb > 2147483647"
              " || ldc > 2147483647 || lda_s > 2147483647 || ldb_s > 2147483647",
              "fp8_gemm: sizes and strides must fit in 32 bits"),
        Check("M > 0 && N > 0 && (a == 0 || a_s == 0 || b == 0 || b_s == 0 || c == 0)",
              "fp8_gemm: a, a_s, b, b_s and c must not be NULL"),
    ),
    nothing_to_do="M == 0 || N == 0",
    m="M",
    n="N",
    impls={
        "portable": ImplLaunch(
            params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("M", "M"), ("N", "N"), ("K", "K"), ("stride_am", "lda"), ("stride_bn", "ldb"),
                    ("stride_cm", "ldc"), ("stride_asm", "lda_s"), ("stride_bsn", "ldb_s")),
            pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                           "as_ptr": "fp32", "bs_ptr": "fp32"},
            grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "1"),
            constexprs=_portable_constexprs,
            options=_portable_options,
        ),
        "tma_persistent": ImplLaunch(
            # launch(): TensorDescriptors over a [M, K], b [N, K] and c [M, N]; a persistent grid from the SM count;
            # the K split of split_for with its scratch (c itself where there is no split).
            params=(("a_desc", "desc"), ("b_desc", "desc"), ("c_desc", "desc"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("c_ptr", "c"), ("ws_ptr", "c"), ("count_ptr", "c"), ("M", "M"), ("N", "N"), ("K", "K"),
                    ("stride_asm", "lda_s"), ("stride_bsn", "ldb_s"), ("stride_cm", "ldc"),
                    ("num_programs", _FP8_PROGRAMS)),
            pointer_types={"as_ptr": "fp32", "bs_ptr": "fp32", "c_ptr": "dtype:out_dtype",
                           "ws_ptr": "scratch:fp32:out_dtype", "count_ptr": "scratch:i32:out_dtype"},
            descriptors={
                "a_desc": TmaDescriptor("a", "fp8e4nv", ("M", "K"), ("lda", "1"), ("{BLOCK_M}", "{BLOCK_K}")),
                "b_desc": TmaDescriptor("b", "fp8e4nv", ("N", "K"), ("ldb", "1"), ("{BLOCK_N}", "{BLOCK_K}")),
                "c_desc": TmaDescriptor("c", "dtype:out_dtype", ("M", "N"), ("ldc", "1"), ("{BLOCK_M}", "{BLOCK_N}")),
            },
            grid=(_FP8_PROGRAMS, "1", "1"),
            constexprs=lambda tile, scheme: {
                "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
                "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major",
                "NUM_STAGES": tile["num_stages"], "WARP_SPECIALIZE": tile["warp_specialize"],
                "SWAP_AB": tile["swap_ab"]},
            options=lambda tile: {"num_warps": tile["num_warps"]},  # launch() passes num_stages as a constexpr
            runtime_constexprs=(("SPLIT_K", _FP8_SPLIT, SPLIT),),
            scratch=("ws_ptr", "count_ptr", f"{_FP8_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", _FP8_TILES),
            scratch_alias="c",
            # TMA: 16-byte aligned bases and row strides. kdsl.ops copies other operands to aligned contiguous
            # ones; C cannot, so such calls run the kernel the registry picks without this one (the portable).
            refuses="nonzero(addr(a) % 16) + nonzero(addr(b) % 16) + nonzero(addr(c) % 16) + nonzero(lda % 16)"
                    " + nonzero(ldb % 16) + nonzero(ldc * dtype_size(out_dtype) % 16)",
            refused_to="entry",
        ),
    },
    problems=_fp8_gemm_problems,
    # A model quantizes its activations before each such GEMM: act_quant's (M, K) too.
    bench_problems={"fp8_gemm": lambda case: {
        "fp8_gemm": fp8_gemm_problems([(case.n, case.k)], ms=(case.m,)),
        "act_quant": act_quant_problems([case.k], ms=(case.m,))}},
)

# ---- fp8_bmm: the batched block-FP8 GEMM (MLA), strided views passed as they are -------------------------

def fp8_bmm_problems(batches, nks, ms=FP8_BMM_MS, dtypes=tuple(DTYPES)):
    """batches: the batch counts (MLA's heads per GPU); nks: the per-head (N, K). Activations arrive as
    [tokens, heads, K], so a is the transposed view (strides K, heads * K, 1), and so are its scales."""
    for heads in batches:
        for m in ms:
            for n, k in nks:
                for dtype in dtypes:
                    yield dict(B=heads, M=m, N=n, K=k, stride_ab=k, stride_am=heads * k, stride_bb=n * k, stride_bn=k,
                               stride_cb=m * n, stride_cm=n, stride_asb=k // 128, stride_asm=heads * k // 128,
                               stride_ask=1, stride_bsb=-(-n // 128) * (k // 128), stride_bsn=k // 128, stride_bsk=1,
                               out_dtype=dtype)


def _fp8_bmm_problems():
    # DeepSeek-V3's MLA: heads 128 (TP 1) or 16 (TP 8); (N, K) = (512, 128) or (128, 512).
    return fp8_bmm_problems((16, 128), ((512, 128), (128, 512)))


_BMM_TILES = "B * cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
_BMM_PROGRAMS = f"programs({_BMM_TILES}, {{persistent}}, {{programs_per_sm}}, sms)"
_BMM_STRIDE_NAMES = ("stride_ab", "stride_am", "stride_bb", "stride_bn", "stride_cb", "stride_cm", "stride_asb",
                     "stride_asm", "stride_ask", "stride_bsb", "stride_bsn", "stride_bsk")

FP8_BMM = OpAbi(
    op="fp8_bmm",
    function="kdsl_fp8_bmm",
    summary="c[g] = (a[g] * a_s[g]) @ (b[g] * b_s[g])^T for each batch g, block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [B, M, K] float8_e4m3fn, strides (stride_ab, stride_am, 1): MLA's [tokens, heads, K] "
                         "activations are (K, heads * K, 1)"),
        CArg("stride_ab", "i64", "a's batch stride in elements"),
        CArg("stride_am", "i64", "a's row stride in elements"),
        CArg("a_s", "ptr", "a_s [B, M, K / act_group] float32, strides (stride_asb, stride_asm, stride_ask)"),
        CArg("stride_asb", "i64", "a_s's batch stride"),
        CArg("stride_asm", "i64", "a_s's row stride"),
        CArg("stride_ask", "i64", "a_s's stride along K"),
        CArg("b", "ptr", "b [B, N, K] float8_e4m3fn, strides (stride_bb, stride_bn, 1) (the weights)"),
        CArg("stride_bb", "i64", "b's batch stride"),
        CArg("stride_bn", "i64", "b's row stride"),
        CArg("b_s", "ptr", "b_s [B, ceil(N / block_n), K / block_k] float32, strides (stride_bsb, stride_bsn, stride_bsk)"),
        CArg("stride_bsb", "i64", "b_s's batch stride"),
        CArg("stride_bsn", "i64", "b_s's row stride"),
        CArg("stride_bsk", "i64", "b_s's stride along K"),
        CArg("c", "ptr", "c [B, M, N] of out_dtype, strides (stride_cb, stride_cm, 1) (output)", const=False),
        CArg("stride_cb", "i64", "c's batch stride"),
        CArg("stride_cm", "i64", "c's row stride"),
        CArg("out_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("B", "i64", "batches (heads), >= 0"),
        CArg("M", "i64", "rows of a and c (tokens), >= 0"),
        CArg("N", "i64", "rows of b, columns of c: a multiple of 16"),
        CArg("K", "i64", "a multiple of act_group, > 0"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("B < 0 || M < 0 || N < 0 || K <= 0", "fp8_bmm: B = %lld, M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("B", "M", "N", "K")),
        Check("K % {act_group} != 0", "fp8_bmm: K = %lld must be a multiple of {act_group}", ("K",)),
        Check("N % 16 != 0", "fp8_bmm: N = %lld must be a multiple of 16", ("N",)),
        Check(" || ".join(f"{name} < 0" for name in _BMM_STRIDE_NAMES), "fp8_bmm: strides must be >= 0"),
        Check(" || ".join(f"{name} > 2147483647" for name in ("B", "M", "N", "K", *_BMM_STRIDE_NAMES)),
              "fp8_bmm: sizes and strides must fit in 32 bits"),
        Check("B > 0 && M > 0 && N > 0 && (a == 0 || a_s == 0 || b == 0 || b_s == 0 || c == 0)",
              "fp8_bmm: a, a_s, b, b_s and c must not be NULL"),
    ),
    nothing_to_do="B == 0 || M == 0 || N == 0",
    m="M",
    n="N",
    impls={
        "portable": ImplLaunch(
            params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("M", "M"), ("N", "N"), ("K", "K"), ("stride_ab", "stride_ab"), ("stride_am", "stride_am"),
                    ("stride_bb", "stride_bb"), ("stride_bn", "stride_bn"), ("stride_cb", "stride_cb"),
                    ("stride_cm", "stride_cm"), ("stride_asb", "stride_asb"), ("stride_asm", "stride_asm"),
                    ("stride_ask", "stride_ask"), ("stride_bsb", "stride_bsb"), ("stride_bsn", "stride_bsn"),
                    ("stride_bsk", "stride_bsk")),
            pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                           "as_ptr": "fp32", "bs_ptr": "fp32"},
            grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "B"),
            constexprs=_portable_constexprs,
            options=_portable_options,
            kernel="{module}",
        ),
        "tma_persistent": ImplLaunch(
            # 3-D descriptors over [B, rows, cols] with the strides as given (_tma_strides: a dimension of size 1
            # gets the padded row instead, as it is never stepped).
            # b_ptr, c_ptr and their strides serve the weight prefetch and the pointer epilogue (tile options).
            params=(("a_desc", "desc"), ("b_desc", "desc"), ("c_desc", "desc"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("b_ptr", "b"), ("c_ptr", "c"),
                    ("B", "B"), ("M", "M"), ("N", "N"), ("K", "K"), ("stride_asb", "stride_asb"),
                    ("stride_asm", "stride_asm"), ("stride_ask", "stride_ask"), ("stride_bsb", "stride_bsb"),
                    ("stride_bsn", "stride_bsn"), ("stride_bsk", "stride_bsk"), ("stride_bb", "stride_bb"),
                    ("stride_bn", "stride_bn"), ("stride_cb", "stride_cb"), ("stride_cm", "stride_cm"),
                    ("num_programs", _BMM_PROGRAMS)),
            pointer_types={"as_ptr": "fp32", "bs_ptr": "fp32", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype"},
            descriptors={
                "a_desc": TmaDescriptor("a", "fp8e4nv", ("B", "M", "K"),
                                        ("tma_stride(B, stride_ab, K, 1)", "tma_stride(M, stride_am, K, 1)", "1"),
                                        ("1", "{BLOCK_M}", "{BLOCK_K}")),
                "b_desc": TmaDescriptor("b", "fp8e4nv", ("B", "N", "K"),
                                        ("tma_stride(B, stride_bb, K, 1)", "tma_stride(N, stride_bn, K, 1)", "1"),
                                        ("1", "{BLOCK_N}", "{BLOCK_K}")),
                "c_desc": TmaDescriptor("c", "dtype:out_dtype", ("B", "M", "N"),
                                        ("tma_stride(B, stride_cb, N, dtype_size(out_dtype))",
                                         "tma_stride(M, stride_cm, N, dtype_size(out_dtype))", "1"),
                                        ("1", "{BLOCK_M}", "{BLOCK_N}")),
            },
            grid=(_BMM_PROGRAMS, "1", "1"),
            constexprs=lambda tile, scheme: {
                "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
                "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major",
                "BATCH_INNER": tile["batch_inner"], "SWAP_AB": tile["swap_ab"], "FLATTEN": tile["flatten"],
                "WARP_SPECIALIZE": tile["warp_specialize"],
                # The C launcher sets no programmatic-dependent-launch attribute: a pdl tile's grid-dependency
                # wait then finds its producer finished (stream order), so the same cubin is correct, without
                # the overlap kdsl.ops gets.
                "PDL": tile["pdl"], "PREFETCH_WEIGHTS": tile["prefetch_weights"],
                "POINTER_STORE": tile["epilogue"] == "pointer"},
            options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
            # The module's refusal: more batches than the tile's batch_max (0: unset), or (call.align < 16) a
            # base or stepped stride of a, b or c not a non-zero multiple of 16 bytes; its calls go to the tile
            # after it (another tile's kernel, or the portable alternative).
            refuses=("nonzero({batch_max}) * (B > {batch_max})"
                     " + nonzero(addr(a) % 16) + nonzero(addr(b) % 16) + nonzero(addr(c) % 16)"
                     " + bad_tma_stride(B, stride_ab, 1) + bad_tma_stride(M, stride_am, 1)"
                     " + bad_tma_stride(B, stride_bb, 1) + bad_tma_stride(N, stride_bn, 1)"
                     " + bad_tma_stride(B, stride_cb, dtype_size(out_dtype))"
                     " + bad_tma_stride(M, stride_cm, dtype_size(out_dtype))"),
            refused_to="tile",
        ),
    },
    problems=_fp8_bmm_problems,
    bench_problems={"fp8_bmm": lambda case: {
        "fp8_bmm": fp8_bmm_problems((case.batch,), [(case.n, case.k)], ms=(case.m,))}},
)


# ---- fp8_grouped_gemm / fp8_grouped_gemm_masked: a MoE layer's projection over its experts -----------------------

# The experts' (E, N, K) the full export targets: DeepSeek-V3 (256 experts, hidden 7168; gate-up 2I x H and down
# H x I at I = 2048 and at its TP-8 slice I = 256) and Qwen3-30B-A3B (128 experts, hidden 2048, I = 768).
MOE_PROJECTIONS = tuple((experts, n, k) for experts, hidden, inters in ((256, 7168, (2048, 256)), (128, 2048, (768,)))
                        for inter in inters for n, k in ((2 * inter, hidden), (hidden, inter)))
# fp8_grouped_gemm's M: DeepGEMM's contiguous layout pads each expert's rows to 128, and the tile buckets count
# rows per expert, ceil(M / E): with 256 and with 128 experts these reach every bucket.
GROUPED_MS = (128, 1024, 4096, 16384, 32768)
# fp8_grouped_gemm_masked's max_m (decode: the tokens, at most that many per expert), each with expected_m 0 (the
# default, max_m) and the even share of top-8 routing, ceil(8 * max_m / E).
MASKED_MS = (1, 16, 64, 128, 256)
MOE_TOPK = 8


def contiguous_rows(tokens: int, topk: int, experts: int, align: int = 128) -> int:
    """M of the contiguous layout when tokens * topk slots spread evenly over the experts they can reach, each
    expert's rows padded to `align` (kdsl.bench.moe.contiguous_layout's padding)."""
    slots = tokens * topk
    routed = min(slots, experts)
    per_expert = -(-slots // routed)
    return routed * (-(-per_expert // align) * align)


def fp8_grouped_gemm_problems(projections, ms=GROUPED_MS, dtypes=tuple(DTYPES)):
    """projections: the experts' (E, N, K); ms: rows of a in the contiguous layout."""
    for m in ms:
        for experts, n, k in projections:
            for dtype in dtypes:
                yield dict(M=m, N=n, K=k, E=experts, lda=k, lda_s=k // 128, stride_be=n * k, stride_bn=k,
                           stride_bse=-(-n // 128) * (k // 128), stride_bsn=k // 128, ldc=n, out_dtype=dtype)


def fp8_grouped_gemm_masked_problems(projections, max_ms=MASKED_MS, topk=MOE_TOPK, dtypes=tuple(DTYPES)):
    """projections: the experts' (E, N, K); max_ms: rows per expert of a [E, max_m, K] (contiguous tensors)."""
    for max_m in max_ms:
        for experts, n, k in projections:
            for expected_m in sorted({0, -(-topk * max_m // experts)}):
                for dtype in dtypes:
                    yield dict(E=experts, max_m=max_m, N=n, K=k, expected_m=expected_m, stride_ae=max_m * k,
                               stride_am=k, stride_ase=max_m * (k // 128), stride_asm=k // 128, stride_be=n * k,
                               stride_bn=k, stride_bse=-(-n // 128) * (k // 128), stride_bsn=k // 128,
                               stride_ce=max_m * n, stride_cm=n, out_dtype=dtype)


def _fp8_grouped_gemm_problems():
    return fp8_grouped_gemm_problems(MOE_PROJECTIONS)


def _fp8_grouped_gemm_masked_problems():
    return fp8_grouped_gemm_masked_problems(MOE_PROJECTIONS)


def _grouped_bench_problems(case) -> dict:
    """A bench case (T tokens routed to topk of E experts, one projection N x K): its contiguous rows, and
    act_quant's (M, K), as a layer quantizes its activations before the GEMM."""
    rows = contiguous_rows(case.m, case.topk, case.experts)
    return {"fp8_grouped_gemm": fp8_grouped_gemm_problems([(case.experts, case.n, case.k)], ms=(rows,)),
            "act_quant": act_quant_problems([case.k], ms=(rows,))}


def _masked_bench_problems(case) -> dict:
    """A bench case in the masked layout: a [E, T, K] (kdsl.bench.cases.fp8_grouped_gemm_masked), its activations
    quantized as [E * T, K]."""
    return {"fp8_grouped_gemm_masked": fp8_grouped_gemm_masked_problems(
                [(case.experts, case.n, case.k)], max_ms=(case.m,), topk=case.topk),
            "act_quant": act_quant_problems([case.k], ms=(case.experts * case.m,))}


# Both grouped GEMMs take the experts' weights alike.
_EXPERT_WEIGHTS = (
    CArg("b", "ptr", "b [E, N, K] float8_e4m3fn, strides (stride_be, stride_bn, 1): the experts' weights"),
    CArg("stride_be", "i64", "b's expert stride in elements (>= 0)"),
    CArg("stride_bn", "i64", "b's row stride in elements (>= K)"),
    CArg("b_s", "ptr", "b_s [E, ceil(N / block_n), K / block_k] float32, strides (stride_bse, stride_bsn, 1)"),
    CArg("stride_bse", "i64", "b_s's expert stride in elements (>= 0)"),
    CArg("stride_bsn", "i64", "b_s's row stride in elements (>= K / block_k)"),
)
_GROUPED_STRIDES = ("lda", "lda_s", "stride_be", "stride_bn", "stride_bse", "stride_bsn", "ldc")

FP8_GROUPED_GEMM = OpAbi(
    op="fp8_grouped_gemm",
    function="kdsl_fp8_grouped_gemm",
    summary="c[m] = (a[m] * a_s[m]) @ (b[g] * b_s[g])^T with g = group_ids[m] (DeepGEMM's contiguous layout), "
            "block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [M, K] float8_e4m3fn, row stride lda, unit stride along K: the rows grouped by expert"),
        CArg("lda", "i64", "row stride of a in elements (>= K)"),
        CArg("a_s", "ptr", "a_s [M, K / act_group] float32, row stride lda_s, unit stride along K"),
        CArg("lda_s", "i64", "row stride of a_s in elements (>= K / act_group)"),
        *_EXPERT_WEIGHTS,
        CArg("group_ids", "ptr", "group_ids int32 [M], contiguous: the expert of each row of a, -1 for a padding "
                                 "row (its row of c is not written); ids outside [-1, E) are not checked (kdsl.ops "
                                 "refuses them with check_ids): their rows are not written either"),
        CArg("c", "ptr", "c [M, N] of out_dtype, row stride ldc, unit stride along N (output; padding rows "
                         "unspecified)", const=False),
        CArg("ldc", "i64", "row stride of c in elements (>= N)"),
        CArg("out_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("M", "i64", "rows of a, c and group_ids, >= 0 (DeepGEMM pads each expert's rows to 128; any M runs)"),
        CArg("N", "i64", "rows of each expert's b, columns of c, >= 0"),
        CArg("K", "i64", "a multiple of act_group, > 0"),
        CArg("E", "i64", "experts, >= 1"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "fp8_grouped_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        Check("E <= 0", "fp8_grouped_gemm: E = %lld: expected at least one expert (b [E, N, K])", ("E",)),
        Check("K % {act_group} != 0", "fp8_grouped_gemm: K = %lld must be a multiple of {act_group}", ("K",)),
        Check("lda < K || stride_bn < K", "fp8_grouped_gemm: lda = %lld and stride_bn = %lld must be >= K = %lld",
              ("lda", "stride_bn", "K")),
        Check("ldc < N", "fp8_grouped_gemm: ldc = %lld must be >= N = %lld", ("ldc", "N")),
        Check("lda_s < K / {act_group} || stride_bsn < K / {block_k}",
              "fp8_grouped_gemm: lda_s = %lld must be >= K / {act_group} and stride_bsn = %lld >= K / {block_k}",
              ("lda_s", "stride_bsn")),
        Check("stride_be < 0 || stride_bse < 0", "fp8_grouped_gemm: stride_be = %lld and stride_bse = %lld must be "
              ">= 0", ("stride_be", "stride_bse")),
        Check(" || ".join(f"{name} > 2147483647" for name in ("M", "N", "K", "E", *_GROUPED_STRIDES)),
              "fp8_grouped_gemm: sizes and strides must fit in 32 bits"),
        Check("M > 0 && N > 0 && (a == 0 || a_s == 0 || b == 0 || b_s == 0 || group_ids == 0 || c == 0)",
              "fp8_grouped_gemm: a, a_s, b, b_s, group_ids and c must not be NULL"),
    ),
    nothing_to_do="M == 0 || N == 0",
    # kdsl.ops.fp8_grouped_gemm picks the tile by the rows per expert, ceil(M / E).
    m="cdiv(M, E)",
    n="N",
    impls={
        # launch() of fp8_grouped_gemm_portable.py: one program per (BLOCK_M, BLOCK_N) tile of c.
        "portable": ImplLaunch(
            params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("group_ptr", "group_ids"), ("M", "M"), ("N", "N"), ("K", "K"), ("E", "E"),
                    ("stride_am", "lda"), ("stride_be", "stride_be"), ("stride_bn", "stride_bn"), ("stride_cm", "ldc"),
                    ("stride_asm", "lda_s"), ("stride_bse", "stride_bse"), ("stride_bsn", "stride_bsn")),
            pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                           "as_ptr": "fp32", "bs_ptr": "fp32", "group_ptr": "i32"},
            grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "1"),
            constexprs=_portable_constexprs,
            options=_portable_options,
            kernel="{module}",
        ),
    },
    problems=_fp8_grouped_gemm_problems,
    bench_problems={"fp8_grouped_gemm": _grouped_bench_problems},
    with_m=lambda problem, m: {**problem, "M": m * problem["E"]},
)

_MASKED_STRIDES = ("stride_ae", "stride_am", "stride_ase", "stride_asm", "stride_be", "stride_bn", "stride_bse",
                   "stride_bsn", "stride_ce", "stride_cm")

FP8_GROUPED_GEMM_MASKED = OpAbi(
    op="fp8_grouped_gemm_masked",
    function="kdsl_fp8_grouped_gemm_masked",
    summary="c[e, :masked_m[e]] = (a[e] * a_s[e]) @ (b[e] * b_s[e])^T for each expert e (DeepGEMM's masked layout; "
            "masked_m read on the device), block scaling as kdsl_fp8_gemm.",
    args=(
        CArg("a", "ptr", "a [E, max_m, K] float8_e4m3fn, strides (stride_ae, stride_am, 1)"),
        CArg("stride_ae", "i64", "a's expert stride in elements (>= 0)"),
        CArg("stride_am", "i64", "a's row stride in elements (>= K)"),
        CArg("a_s", "ptr", "a_s [E, max_m, K / act_group] float32, strides (stride_ase, stride_asm, 1)"),
        CArg("stride_ase", "i64", "a_s's expert stride in elements (>= 0)"),
        CArg("stride_asm", "i64", "a_s's row stride in elements (>= K / act_group)"),
        *_EXPERT_WEIGHTS,
        CArg("masked_m", "ptr", "masked_m int32 [E], contiguous, on the device: the rows of each expert, read by the "
                                "kernel (no host sync: one CUDA graph serves any routing), clamped to [0, max_m]"),
        CArg("c", "ptr", "c [E, max_m, N] of out_dtype, strides (stride_ce, stride_cm, 1) (output; rows past "
                         "masked_m[e] unspecified)", const=False),
        CArg("stride_ce", "i64", "c's expert stride in elements (>= 0)"),
        CArg("stride_cm", "i64", "c's row stride in elements (>= N)"),
        CArg("out_dtype", "dtype", "KDSL_BF16, KDSL_F16 or KDSL_F32"),
        CArg("E", "i64", "experts, >= 0 (at most 65535: one grid row each)"),
        CArg("max_m", "i64", "rows per expert of a and c, >= 0"),
        CArg("N", "i64", "rows of each expert's b, columns of c, >= 0"),
        CArg("K", "i64", "a multiple of act_group, > 0"),
        CArg("expected_m", "i64", "the rows per expert the tile is chosen for (a hint, as kdsl.ops' and DeepGEMM's "
                                  "expected_m), or 0 for max_m"),
    ),
    dtype_choices={"out_dtype": ("bf16", "f16", "f32")},
    checks=(
        Check("E < 0 || max_m < 0 || N < 0 || K <= 0",
              "fp8_grouped_gemm_masked: E = %lld, max_m = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("E", "max_m", "N", "K")),
        Check("K % {act_group} != 0", "fp8_grouped_gemm_masked: K = %lld must be a multiple of {act_group}", ("K",)),
        Check("expected_m < 0", "fp8_grouped_gemm_masked: expected_m = %lld must be >= 0 (0: max_m)",
              ("expected_m",)),
        Check("stride_am < K || stride_bn < K",
              "fp8_grouped_gemm_masked: stride_am = %lld and stride_bn = %lld must be >= K = %lld",
              ("stride_am", "stride_bn", "K")),
        Check("stride_cm < N", "fp8_grouped_gemm_masked: stride_cm = %lld must be >= N = %lld", ("stride_cm", "N")),
        Check("stride_asm < K / {act_group} || stride_bsn < K / {block_k}",
              "fp8_grouped_gemm_masked: stride_asm = %lld must be >= K / {act_group} and stride_bsn = %lld >= "
              "K / {block_k}", ("stride_asm", "stride_bsn")),
        Check(" || ".join(f"{name} < 0" for name in _MASKED_STRIDES), "fp8_grouped_gemm_masked: strides must be >= 0"),
        Check(" || ".join(f"{name} > 2147483647" for name in ("max_m", "N", "K", *_MASKED_STRIDES)),
              "fp8_grouped_gemm_masked: sizes and strides must fit in 32 bits"),
        # The grid's second dimension is the expert (launch_masked), which CUDA caps at 65535.
        Check("E > 65535", "fp8_grouped_gemm_masked: E = %lld experts: at most 65535 (one grid row per expert)",
              ("E",)),
        Check("E > 0 && max_m > 0 && N > 0 && (a == 0 || a_s == 0 || b == 0 || b_s == 0 || masked_m == 0 || c == 0)",
              "fp8_grouped_gemm_masked: a, a_s, b, b_s, masked_m and c must not be NULL"),
    ),
    nothing_to_do="E == 0 || max_m == 0 || N == 0",
    # kdsl.ops.fp8_grouped_gemm_masked picks the tile by expected_m, else max_m.
    m="either(expected_m, max_m)",
    n="N",
    impls={
        # launch_masked() of fp8_grouped_gemm_portable.py: programs over max_m rows of each expert, an expert a grid
        # row; the programs past masked_m[e] return at once.
        "portable": ImplLaunch(
            params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
                    ("count_ptr", "masked_m"), ("MAX_M", "max_m"), ("N", "N"), ("K", "K"),
                    ("stride_ae", "stride_ae"), ("stride_am", "stride_am"), ("stride_be", "stride_be"),
                    ("stride_bn", "stride_bn"), ("stride_ce", "stride_ce"), ("stride_cm", "stride_cm"),
                    ("stride_ase", "stride_ase"), ("stride_asm", "stride_asm"), ("stride_bse", "stride_bse"),
                    ("stride_bsn", "stride_bsn")),
            pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                           "as_ptr": "fp32", "bs_ptr": "fp32", "count_ptr": "i32"},
            grid=("cdiv(max_m, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "E", "1"),
            constexprs=_portable_constexprs,
            options=_portable_options,
            kernel="{module}",
        ),
    },
    problems=_fp8_grouped_gemm_masked_problems,
    bench_problems={"fp8_grouped_gemm_masked": _masked_bench_problems},
    with_m=lambda problem, m: {**problem, "expected_m": m},
)


def gptq_dequant_problems(nks, dtypes=("f16", "bf16"), g_idx=(0, 4096)):
    """nks: the (N, K) of the weights; g_idx: 0 (none) and/or an address (act-order)."""
    for n, k in nks:
        for dtype in dtypes:
            for address in g_idx:
                yield dict(N=n, K=k, ldqw=n, ldqz=n // 8, lds=n, scales_dtype=dtype, g_idx=address)


def _gptq_dequant_problems():
    return gptq_dequant_problems([(n, k) for n in (4096, 11008, 24) for k in (4096, 11008)])


GPTQ_DEQUANT = OpAbi(
    op="gptq_dequant",
    function="kdsl_gptq_dequant",
    summary="A GPTQ checkpoint's int4 weight dequantized to w [N, K] (nn.Linear's layout) in the scales' dtype.",
    args=(
        CArg("qweight", "ptr", "qweight int32 [K / 8, N] (8 rows packed per int32), row stride ldqw, unit stride along N"),
        CArg("ldqw", "i64", "row stride of qweight in int32 elements (>= N)"),
        CArg("qzeros", "ptr", "qzeros int32 [G, N / 8], row stride ldqz, unit stride along N"),
        CArg("ldqz", "i64", "row stride of qzeros in int32 elements (>= N / 8)"),
        CArg("scales", "ptr", "scales [G, N] of scales_dtype, row stride lds, unit stride along N"),
        CArg("lds", "i64", "row stride of scales in elements (>= N)"),
        CArg("scales_dtype", "dtype", "KDSL_F16 or KDSL_BF16 (also w's dtype)"),
        CArg("g_idx", "ptr", "g_idx int32 [K], the group of each input row (act-order), or NULL for row k in "
                             "group k / group_size; its values must lie in [0, G) (not checked)"),
        CArg("w", "ptr", "w [N, K] of scales_dtype, contiguous (output)", const=False),
        CArg("N", "i64", "output features, a multiple of 8"),
        CArg("K", "i64", "input features, a multiple of 8 and of the group size"),
    ),
    dtype_choices={"scales_dtype": ("f16", "bf16")},
    checks=(
        Check("N < 0 || K < 0", "gptq_dequant: N = %lld and K = %lld must be >= 0", ("N", "K")),
        Check("N % 8 != 0 || K % 8 != 0", "gptq_dequant: N = %lld and K = %lld must be multiples of 8", ("N", "K")),
        Check("{group_size} > 0 && K % {group_size} != 0", "gptq_dequant: K = %lld must be a multiple of the group size "
              "{group_size}", ("K",)),
        Check("ldqw < N || ldqz < N / 8 || lds < N",
              "gptq_dequant: ldqw = %lld and lds = %lld must be >= N = %lld, ldqz = %lld >= N / 8",
              ("ldqw", "lds", "N", "ldqz")),
        Check("N > 2147483647 || K > 2147483647 || ldqw > 2147483647 || ldqz > 2147483647 || lds > 2147483647",
              "gptq_dequant: sizes and strides must fit in 32 bits"),
        Check("N > 0 && K > 0 && (qweight == 0 || qzeros == 0 || scales == 0 || w == 0)",
              "gptq_dequant: qweight, qzeros, scales and w must not be NULL (g_idx may be)"),
    ),
    nothing_to_do="N == 0 || K == 0",
    m="N",
    n=None,
    impls={
        "blockwise": ImplLaunch(
            params=(("qw_ptr", "qweight"), ("qz_ptr", "qzeros"), ("s_ptr", "scales"), ("g_ptr", "either(g_idx, qweight)"),
                    ("w_ptr", "w"), ("N", "N"), ("K", "K"), ("stride_qwk", "ldqw"), ("stride_qzg", "ldqz"),
                    ("stride_sg", "lds")),
            pointer_types={"qw_ptr": "i32", "qz_ptr": "i32", "s_ptr": "dtype:scales_dtype", "g_ptr": "i32",
                           "w_ptr": "dtype:scales_dtype"},
            grid=("cdiv(K, {BLOCK_K})", "cdiv(N, {BLOCK_N})", "1"),
            constexprs=lambda tile, scheme: {"BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"]},
            options=lambda tile: {"num_warps": tile["num_warps"]},
            runtime_constexprs=(
                ("HAS_G_IDX", "nonzero(g_idx)", (False, True)),
                ("UNIFORM_GROUP", "(1 - nonzero(g_idx)) * ({group_rows} % {BLOCK_K} == 0)", (False, True)),
            ),
        ),
    },
    problems=_gptq_dequant_problems,
    bench_problems={"gptq_dequant": lambda case: {"gptq_dequant": gptq_dequant_problems([(case.n, case.k)])}},
    in_forward=False,
)

# ---- w4a16_gemm: the W4A16 GEMM on prepared weights (kdsl.ops.gptq_prepare / awq_prepare) ---------------

_MAGIC = {"f16": (0x6400, 1024), "bf16": (0x4300, 128)}  # the generated modules' MAGIC per x dtype
SPLIT_SMS = (108, 132)  # SM counts the exporter compiles K splits for (A100, H100/H200); other counts: see SPLIT


def w4a16_problems(nks, ms=W4A16_MS, orders=W4A16_ORDERS, dtypes=("f16", "bf16")):
    """nks: the (N, K) of the weights; orders: (perm, contiguous_groups) pairs, W4A16_ORDERS."""
    for m in ms:
        for n, k in nks:
            for perm, contiguous in orders:
                for dtype in dtypes:
                    yield dict(M=m, N=n, K=k, ldx=k, ldqw=n, ldz=n, lds=n, ldy=n, perm=perm,
                               contiguous_groups=contiguous, x_dtype=dtype)


def _w4a16_problems():
    # M per tile bucket of both variants; N and K of the bench shapes; act-order and groups as checkpoints
    # give them (sorted act-order groups stay contiguous; a v1 checkpoint's uneven groups do not).
    return w4a16_problems(((4096, 4096), (14336, 4096), (4096, 14336)))


_W4A16_POINTERS = {"x_ptr": "dtype:x_dtype", "perm_ptr": "i32", "qw_ptr": "i32", "z_ptr": "dtype:x_dtype",
                   "s_ptr": "dtype:x_dtype", "g_ptr": "i32", "y_ptr": "dtype:x_dtype",
                   "ws_ptr": "scratch:fp32:x_dtype", "count_ptr": "scratch:i32:x_dtype"}
_W4A16_HEAD = (("x_ptr", "x"), ("perm_ptr", "either(perm, qweight)"), ("qw_ptr", "qweight"), ("z_ptr", "zeros"),
               ("s_ptr", "scales"), ("g_ptr", "groups"), ("y_ptr", "y"), ("ws_ptr", "y"), ("count_ptr", "y"),
               ("M", "M"), ("N", "N"), ("K", "K"), ("stride_xm", "ldx"))
_W4A16_TAIL = (("stride_zg", "ldz"), ("stride_sg", "lds"), ("stride_ym", "ldy"))
# split_for in kdsl/kernels/host.py: the tile's SPLIT_K capped by split_min_steps, then the split whose
# programs finish soonest on the device's SMs (gemv passes no SM count: the cap).
_TILES = "cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
_SPLIT_FOR = f"split_for(cdiv(K, {{BLOCK_K}}), {_TILES}, {{SPLIT_K}}, {{split_min_steps}}, {{split_fill}}, sms)"
_GEMV_PROGRAMS = "M * cdiv(N, {BLOCK_N})"
_GEMV_SPLIT = "split_cap(cdiv(K, {BLOCK_K}), {SPLIT_K}, {split_min_steps})"
_UNIFORM = "contiguous_groups * ({group_rows} % {BLOCK_K} == 0)"
_PLANE_UNIFORM = "contiguous_groups * ({group_rows} % 128 == 0)"  # PLANE_TILE_K (kdsl.packing)
_PLANE_WORD_GROUPS = "contiguous_groups * ({group_rows} % 32 == 0)"  # PAIR_SPAN


def _magic(dtypes):
    bits, bias = _MAGIC[dtypes["x_dtype"]]
    return {"MAGIC_BITS": bits, "MAGIC_BIAS": bias}


def _mma_launch(params, runtime, extra):
    return ImplLaunch(
        params=params, pointer_types=_W4A16_POINTERS,
        grid=(_TILES, "split", "1"),
        constexprs=lambda tile, scheme: {"BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"],
                                         "BLOCK_K": tile["BLOCK_K"], "GROUP_M": tile["GROUP_M"],
                                         "FP32_MATH": False, **extra},
        options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
        kernel="{module}", runtime_constexprs=(("HAS_PERM", "nonzero(perm)", (False, True)), *runtime,
                                               ("SPLIT_K", _SPLIT_FOR, SPLIT)),
        dtype_constexprs=_magic,
        scratch=("ws_ptr", "count_ptr", f"{_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", _TILES), scratch_alias="y")


def _gemv_launch(params, runtime, extra):
    return ImplLaunch(
        params=params, pointer_types=_W4A16_POINTERS,
        grid=(_GEMV_PROGRAMS, "split", "1"),
        constexprs=lambda tile, scheme: {"BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
                                         "FP32_MATH": False, **extra},
        options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
        kernel="{module}", runtime_constexprs=(("HAS_PERM", "nonzero(perm)", (False, True)), *runtime,
                                               ("SPLIT_K", _GEMV_SPLIT, SPLIT)),
        dtype_constexprs=lambda dtypes: {"MAGIC_BIAS": _MAGIC[dtypes["x_dtype"]][1]},
        scratch=("ws_ptr", "count_ptr", f"{_GEMV_PROGRAMS} * split * {{BLOCK_N}}", _GEMV_PROGRAMS),
        scratch_alias="y")


W4A16_GEMM = OpAbi(
    op="w4a16_gemm",
    function="kdsl_gptq_gemm",
    summary="y = x @ w on int4 weights prepared by kdsl.ops.gptq_prepare / awq_prepare (W4A16), fp32 accumulation.",
    args=(
        CArg("x", "ptr", "x [M, K] of x_dtype, row stride ldx, unit stride along K (the activations)"),
        CArg("ldx", "i64", "row stride of x in elements (>= K)"),
        CArg("perm", "ptr", "W4A16Prepared.perm: int32 [K], the column of x each prepared row reads (act-order), "
                            "or NULL (perm is None); its values must lie in [0, K) (not checked)"),
        CArg("qweight", "ptr", "W4A16Prepared.qweight, int32: [K / 8, N] with row stride ldqw (layout weights = "
                               "checkpoint, the sm_80 kernels), or [ceil(N/128), ceil(K/128), 128, 16] contiguous "
                               "(layout k_planes, sm_90; ldqw is then not read)"),
        CArg("ldqw", "i64", "row stride of qweight in int32 elements (>= N) for the checkpoint layout; for k_planes "
                            "pass N (not read)"),
        CArg("zeros", "ptr", "W4A16Prepared.zeros [G, N] of x_dtype (biased zeros), row stride ldz, column stride "
                             "1 (layout zeros = biased) or 2 (paired: scales + 1 element, one [G, N, 2] tensor)"),
        CArg("ldz", "i64", "row stride of zeros in elements (>= N; 2 N for a contiguous paired tensor)"),
        CArg("scales", "ptr", "W4A16Prepared.scales [G, N] of x_dtype, row stride lds, column stride as zeros'"),
        CArg("lds", "i64", "row stride of scales in elements (>= N)"),
        CArg("groups", "ptr", "W4A16Prepared.groups: int32 [K], the group of each prepared row (values in [0, G), "
                              "not checked)"),
        CArg("contiguous_groups", "i64", "W4A16Prepared.contiguous_groups: 1 if prepared row k is in group "
                                         "k / group_size, else 0"),
        CArg("y", "ptr", "y [M, N] of x_dtype, row stride ldy, unit stride along N (output)", const=False),
        CArg("ldy", "i64", "row stride of y in elements (>= N)"),
        CArg("x_dtype", "dtype", "KDSL_F16 or KDSL_BF16: x's, y's, scales' and zeros' dtype (W4A16Prepared.dtype)"),
        CArg("M", "i64", "rows of x and y, >= 0"),
        CArg("N", "i64", "output features, a multiple of 8"),
        CArg("K", "i64", "input features, a multiple of 8, > 0"),
    ),
    dtype_choices={"x_dtype": ("f16", "bf16")},
    checks=(
        Check("M < 0 || N < 0 || K <= 0", "w4a16_gemm: M = %lld and N = %lld must be >= 0, K = %lld > 0",
              ("M", "N", "K")),
        Check("N % 8 != 0 || K % 8 != 0", "w4a16_gemm: N = %lld and K = %lld must be multiples of 8", ("N", "K")),
        Check("contiguous_groups != 0 && contiguous_groups != 1",
              "w4a16_gemm: contiguous_groups = %lld must be 0 or 1", ("contiguous_groups",)),
        Check("ldx < K", "w4a16_gemm: ldx = %lld must be >= K = %lld", ("ldx", "K")),
        Check("ldy < N || ldz < N || lds < N || ldqw < N",
              "w4a16_gemm: ldy = %lld, ldz = %lld, lds = %lld and ldqw = %lld must be >= N = %lld",
              ("ldy", "ldz", "lds", "ldqw", "N")),
        Check("M > 2147483647 || N > 2147483647 || K > 2147483647 || ldx > 2147483647 || ldy > 2147483647"
              " || ldz > 2147483647 || lds > 2147483647 || ldqw > 2147483647",
              "w4a16_gemm: sizes and strides must fit in 32 bits"),
        Check("M > 0 && N > 0 && (x == 0 || qweight == 0 || zeros == 0 || scales == 0 || groups == 0 || y == 0)",
              "w4a16_gemm: x, qweight, zeros, scales, groups and y must not be NULL (perm may be)"),
    ),
    nothing_to_do="M == 0 || N == 0",
    m="M",
    n="N",
    impls={
        # Layout weights = checkpoint (sm_80+): qweight [K / 8, N].
        "mma": _mma_launch(
            _W4A16_HEAD + (("stride_qwk", "ldqw"),) + _W4A16_TAIL,
            (("UNIFORM_GROUP", _UNIFORM, (False, True)),
             ("ASM_DEQUANT", f"{_UNIFORM} * ({{BLOCK_M}} >= 64)", (False, True))), {}),
        "gemv": _gemv_launch(
            _W4A16_HEAD + (("stride_qwk", "ldqw"),) + _W4A16_TAIL,
            (("UNIFORM_GROUP", _UNIFORM, (False, True)),
             ("WORD_GROUPS", "contiguous_groups * ({group_rows} % 8 == 0)", (False, True)),
             ("HALF2_DOT", f"(x_dtype == KDSL_F16) * nonzero({_UNIFORM} + contiguous_groups * "
                           f"({{group_rows}} % 8 == 0))", (False, True))), {}),
        # Layout weights = k_planes (sm_90): qweight [N tiles, K tiles, 128, 16], contiguous.
        "planes_mma": _mma_launch(
            _W4A16_HEAD + _W4A16_TAIL,
            (("UNIFORM_GROUP", _PLANE_UNIFORM, (False, True)),
             ("WORD_GROUPS", _PLANE_WORD_GROUPS, (False, True)),
             ("ASM_DEQUANT", _PLANE_UNIFORM, (False, True)),
             ("SCALE_AFTER", f"{_PLANE_UNIFORM} * ({{BLOCK_M}} <= 16)", (False, True))), {}),
        "gemv:k_planes": _gemv_launch(
            # launch() passes qweight.stride(0) of the 4-D tensor: ceil(K / 128) tiles of 128 x 16 words.
            _W4A16_HEAD + (("stride_qwk", "cdiv(K, 128) * 2048"),) + _W4A16_TAIL,
            (("UNIFORM_GROUP", _PLANE_UNIFORM, (False, True)),), {"WORD_GROUPS": False, "HALF2_DOT": False}),
        # The Gluon GEMV on mma.sync (M <= 8, k_planes with paired scales and zeros): K and CHUNK_TILES are
        # constexprs, so one cubin per K the problems reach; launch() passes the (scale, zero) pairs as int32
        # [G, N] over the scales' memory (row stride lds / 2 words). Its module's refusal turns down groups that
        # change inside a 128-row plane tile (off the GPU too, which C never is; M > 8 no tile of it serves), and
        # a K with no cubin is refused as well: those calls take the tile after it (the Triton GEMV or MMA).
        "gemv_mma_gluon": ImplLaunch(
            params=(("x_ptr", "x"), ("perm_ptr", "either(perm, qweight)"), ("w_ptr", "qweight"), ("p_ptr", "scales"),
                    ("y_ptr", "y"), ("M", "M"), ("N", "N"), ("stride_xm", "ldx"), ("stride_pg", "div(lds, 2)"),
                    ("stride_ym", "ldy")),
            pointer_types={"x_ptr": "dtype:x_dtype", "perm_ptr": "i32", "w_ptr": "i32", "p_ptr": "i32",
                           "y_ptr": "dtype:x_dtype"},
            grid=("cdiv(N, 16)", "1", "1"),
            # num_warps is a parameter of the Gluon kernel as well as the launch option.
            constexprs=lambda tile, scheme: {"CHUNK_TILES": tile["BLOCK_K"] // 128, "num_warps": tile["num_warps"]},
            options=lambda tile: {"num_warps": tile["num_warps"]},
            kernel="{module}",
            runtime_constexprs=(("K", "K", EXACT), ("HAS_PERM", "nonzero(perm)", (False, True))),
            refuses=f"1 - {_PLANE_UNIFORM}",
        ),
        # The Gluon wgmma GEMM (sm_90, k_planes): x, the plane words (qweight as [rows, 16]) and the (scale, zero)
        # pairs (int32 [G, N] over the scales, row stride lds / 2) come by TMA through Gluon host descriptors, whose
        # NVMMA shared layout is the default for the block (as launch() builds it; the compiled kernel's
        # tensordesc_meta gives the swizzle and box as for Triton's). Its module's refusal: act-order, a group
        # changing inside a K block, and kdsl.ops' alignment of x and scales below 16 bytes; those calls take the
        # Triton MMA tile after it.
        "overlap_gluon": ImplLaunch(
            params=(("x_desc", "desc"), ("w_desc", "desc"), ("p_desc", "desc"), ("y_ptr", "y"), ("ws_ptr", "y"),
                    ("count_ptr", "y"), ("M", "M"), ("N", "N"), ("K", "K"), ("stride_ym", "ldy")),
            pointer_types={"y_ptr": "dtype:x_dtype", "ws_ptr": "scratch:fp32:x_dtype",
                           "count_ptr": "scratch:i32:x_dtype"},
            descriptors={
                "x_desc": TmaDescriptor("x", "dtype:x_dtype", ("M", "K"), ("ldx", "1"), ("{BLOCK_M}", "{BLOCK_K}")),
                "w_desc": TmaDescriptor("qweight", "i32", ("cdiv(N, 128) * cdiv(K, 128) * 128", "16"), ("16", "1"),
                                        ("{BLOCK_N}", "16")),
                "p_desc": TmaDescriptor("scales", "i32", ("cdiv(K, {group_rows})", "N"), ("div(lds, 2)", "1"),
                                        ("1", "{BLOCK_N}")),
            },
            grid=(_TILES, "split", "1"),
            constexprs=lambda tile, scheme: {"GROUP_M": tile["GROUP_M"], "NUM_STAGES": tile["num_stages"],
                                             "num_warps": tile["num_warps"]},
            options=lambda tile: {"num_warps": tile["num_warps"]},
            kernel="{module}",
            runtime_constexprs=(("SPLIT_K", _SPLIT_FOR, SPLIT),),
            scratch=("ws_ptr", "count_ptr", f"{_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", _TILES),
            scratch_alias="y",
            # The last three: Gluon's host descriptors also need qweight 16-byte aligned and every row stride a
            # multiple of 16 bytes, even of a single row (launch() would fail on them; C takes the alternative).
            refuses=("nonzero(perm) + (1 - contiguous_groups * ({group_rows} % {BLOCK_K} == 0))"
                     " + nonzero(addr(x) % 16) + nonzero(addr(scales) % 16)"
                     " + bad_tma_stride(M, ldx, dtype_size(x_dtype)) + bad_tma_stride(cdiv(K, {group_rows}), lds, 2)"
                     " + nonzero(addr(qweight) % 16) + nonzero(ldx * dtype_size(x_dtype) % 16) + nonzero(lds * 2 % 16)"),
        ),
    },
    problems=_w4a16_problems,
    bench_problems={"gptq_gemm": lambda case: {"w4a16_gemm": w4a16_problems([(case.n, case.k)], ms=(case.m,))}},
    call_flags={"perm": (0, 1), "contiguous_groups": (0, 1)},
)

OPS = {abi.op: abi for abi in (ACT_QUANT, FP8_GEMM, FP8_BMM, FP8_GROUPED_GEMM, FP8_GROUPED_GEMM_MASKED,
                                     GPTQ_DEQUANT, W4A16_GEMM)}


def launch_for(abi: OpAbi, entry, impl: str) -> ImplLaunch | None:
    """The launch description of a tile's implementation in this entry: one keyed by the entry's prepared
    weights layout (`impl:layout`) where the module reads another layout, else the implementation's."""
    weights = (entry.layout or {}).get("weights")
    return abi.impls.get(f"{impl}:{weights}") or abi.impls.get(impl)


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
