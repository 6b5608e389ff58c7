"""The C ABI of each exported op, and how each exportable kernel of that op is launched from it.

One description serves three readers: the exporter (which specializations to compile), the C emitter (the
dispatcher's checks, tile choice, kernel arguments and grid) and the tests (which compare it with what the
generated module's launch() computes, so the two cannot drift apart unnoticed).

Expressions (`params`, `grid`, `runtime_constexprs`) are written once in a subset both C and Python evaluate:
names of the op's C arguments, integer literals, + - * and ==, and the helpers cdiv(a, b), div(a, b) (floor
division of non-negative numbers), nonzero(p) (1 if p is not 0/NULL) and either(p, q) (p unless it is NULL,
then q). `{NAME}` fields are filled from the tile (BLOCK_M, ...) and the scheme (act_group, group_rows, ...)
before either language sees them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
class ImplLaunch:
    """How the dispatcher launches one kernel implementation of the op (mirrors the module's launch())."""
    params: tuple[tuple[str, str], ...]  # (kernel parameter, expression); pointers are the op's "ptr" args
    pointer_types: dict  # kernel pointer parameter -> Triton element type, or "dtype:ARG" (varies with ARG)
    grid: tuple[str, str, str]
    constexprs: callable  # (tile params, scheme fields) -> {name: value}, as launch() passes them
    options: callable  # (tile params) -> {num_warps: .., num_stages: ..}, only those launch() passes
    kernel: str = "{entry}"  # the @triton.jit function in the implementation's module ({entry}, {impl})
    # Constexprs launch() computes from the call's arguments: (name, expression, the values it can take).
    # Each value is a separate compile; the dispatcher computes the expression and matches it.
    runtime_constexprs: tuple = ()


@dataclass(frozen=True)
class OpAbi:
    op: str
    function: str  # the C function, e.g. kdsl_fp8_gemm
    summary: str
    args: tuple[CArg, ...]
    dtype_choices: dict  # dtype argument -> allowed dtype names
    checks: tuple[Check, ...]
    nothing_to_do: str  # C condition: return KDSL_OK without launching
    m: str  # the expression the registry buckets by M (rows)
    n: str | None  # and by N, for definitions that tile by N
    impls: dict  # impl name -> ImplLaunch
    problems: callable  # () -> iterable of {arg: value}: the calls whose specializations are compiled
    unexportable: dict = field(default_factory=dict)  # impl name -> why it is not exported


def _act_quant_problems():
    for m in (1, 2, 7, 16, 17, 32, 100, 128, 4096, 4097):
        for k in (512, 1536, 2048, 7168):
            for dtype in DTYPES:
                yield dict(M=m, K=k, ldx=k, x_dtype=dtype)


def _fp8_gemm_problems():
    for m in (1, 2, 7, 16, 17, 32, 100, 128, 129, 1024, 4096, 4097):
        for n in (2112, 7168, 576, 24):
            for k in (2048, 7168):
                for dtype in DTYPES:
                    yield dict(M=m, N=n, K=k, lda=k, ldb=k, ldc=n, lda_s=k // 128, ldb_s=k // 128, out_dtype=dtype)


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
            constexprs=lambda tile, scheme: {
                "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
                "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major"},
            options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
        ),
    },
    problems=_fp8_gemm_problems,
    unexportable={
        "tma_persistent": (
            "its host code builds TMA descriptors per call (Triton TensorDescriptor), sizes a persistent grid "
            "from the device's SM count, allocates a split-K workspace and counters at run time, and runs "
            "M = 1 tiles through a separate GEMV kernel and deferred_rescale tiles through a Gluon kernel; "
            "the C side does not reproduce that host code yet, so its cases go to the portable kernel"),
    },
)

def _gptq_dequant_problems():
    for n in (4096, 11008, 24):
        for k in (4096, 11008):
            for dtype in ("f16", "bf16"):
                for g_idx in (0, 4096):
                    yield dict(N=n, K=k, ldqw=n, ldqz=n // 8, lds=n, scales_dtype=dtype, g_idx=g_idx)


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
)

OPS = {abi.op: abi for abi in (ACT_QUANT, FP8_GEMM, GPTQ_DEQUANT)}


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
        # The modules' GROUP_SIZE: group_size -1 (one group over all of K) is rendered as 2**30.
        values["group_rows"] = 2 ** 30 if fields["group_size"] == -1 else fields["group_size"]
    return values


def fill(expression: str, tile: dict, scheme: dict) -> str:
    """An expression with its {FIELD}s replaced by the tile's and the scheme's values."""
    values = {**scheme, **{k: v for k, v in tile.items() if isinstance(v, int)}}
    return expression.format(**values)


def evaluate(expression: str, values: dict) -> int:
    """Evaluate a filled expression in Python (the C dispatcher compiles the same text)."""
    namespace = {"cdiv": lambda a, b: -(-a // b), "div": lambda a, b: a // b, "nonzero": lambda p: int(p != 0),
                 "either": lambda p, q: p if p else q, "__builtins__": {}}
    return int(eval(expression, namespace, dict(values)))  # noqa: S307 (text written in abi.py, not user input)
