"""Runs one case on the GPU: builds fresh random inputs, checks kdsl against an fp32 reference,
then times kdsl and its baselines on the same inputs.

Only the bench command's run path imports this module (it needs torch, triton and a GPU); the
quantizers and references below are device-agnostic so CPU tests can check them.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.testing

from kdsl.bench.results import COPY, ERROR, OK, ROOFLINE, UNAVAILABLE, WRONG, Result, Timing
from kdsl.bench.shapes import GROUP, Case

DEVICE = "cuda"  # a module constant so CPU tests can drive the whole case logic
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRAPH_MAX_M = 128  # CUDA-graph timing only where launch overhead could hide the kernel
# Ops whose performance bar is stated on CUDA-graph timing at every M (GPTQ's W4A16 bar), or up to an M
# where the op's eager launch (host time) would hide the kernel (fp8_bmm: B = 16 at M = 4096 runs in ~30 us).
GRAPH_EVERY_M = frozenset({"gptq_gemm", "fp8_bmm"})
GEMM_TOL = 2e-2  # bf16 / fp16 output vs fp32 reference
ACT_QUANT_TOL = 5e-2  # dequantized q*s vs x: e4m3 keeps 3 mantissa bits
DEQUANT_TOL = 1e-2
# Scales must equal amax/448; Triton lowers fp32 '/' to div.full.f32 (up to 2 ulp off IEEE),
# so a correct kernel may differ from torch by that much and no more.
SCALE_MAX_ULPS = 2

Check = tuple[float, "str | None"]  # (relative error, why it is wrong or None)


class OpUnavailable(Exception):
    """kdsl.ops cannot be imported or lacks the op: its rows read 'not available'."""


def kdsl_op(name: str) -> Callable:
    try:
        from kdsl import ops
    except ImportError as exc:
        raise OpUnavailable(f"kdsl.ops cannot be imported: {exc}") from None
    try:
        return getattr(ops, name)
    except AttributeError:
        raise OpUnavailable(f"kdsl.ops has no {name}") from None


def describe(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:300] if first else ''}"


def environment() -> dict[str, str | None]:
    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "arch": f"sm_{major}{minor}", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}


# ---- torch quantizers and fp32 references (device-agnostic) ----

def expand_blocks(s: torch.Tensor, rows: int, cols: int, block: tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def torch_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain torch expression: per-token groups of 128 along K, s = amax/448."""
    m, k = x.shape
    groups = x.view(m, k // GROUP, GROUP)
    s = groups.abs().amax(-1).float() / FP8_MAX
    return (groups / s[..., None]).to(FP8).view(m, k), s


def torch_weight_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks, s [ceil(N/128), ceil(K/128)]; ragged edges are zero-padded."""
    n, k = w.shape
    nb, kb = -(-n // GROUP), -(-k // GROUP)
    padded = w.new_zeros(nb * GROUP, kb * GROUP, dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.view(nb, GROUP, kb, GROUP)
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (blocks / s[:, None, :, None]).to(FP8).view(nb * GROUP, kb * GROUP)
    return q[:n, :k].contiguous(), s


def fp8_weight_reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * expand_blocks(s, *q.shape)


def fp8_gemm_reference(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    return (a.float() * a_s.repeat_interleave(GROUP, 1)) @ fp8_weight_reference(b, b_s).T


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`, value i in bits 4*(i % 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    if dim == 0:
        return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, packed.shape[1])
    return ((packed[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(packed.shape[0], -1)


def gptq_reference_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          g_idx: torch.Tensor, checkpoint_format: str = "gptq") -> torch.Tensor:
    """fp32 w [K, N] = (q - z[g_idx]) * s[g_idx]; "gptq" checkpoints store zero - 1."""
    q = unpack_int4(qweight, dim=0)
    z = unpack_int4(qzeros, dim=1) + (1 if checkpoint_format == "gptq" else 0)
    g = g_idx.long()
    return (q - z[g]).float() * scales[g].float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_close(out: object, ref: torch.Tensor, tol: float) -> Check:
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return math.nan, f"output shape {getattr(out, 'shape', type(out).__name__)}, expected {tuple(ref.shape)}"
    err = relative_error(out, ref)
    return err, None if err <= tol else f"rel err {err:.3g} > {tol:g}"  # NaN fails too


def check_act_quant(out: object, x: torch.Tensor, ref_s: torch.Tensor) -> Check:
    try:
        q, s = out  # type: ignore[misc]
    except (TypeError, ValueError):
        return math.nan, f"expected (q, s), got {type(out).__name__}"
    if q.dtype != FP8 or s.dtype != torch.float32:
        return math.nan, f"dtypes q={q.dtype}, s={s.dtype}; expected {FP8}, torch.float32"
    if q.shape != x.shape or s.shape != ref_s.shape:
        return math.nan, f"shapes q={tuple(q.shape)}, s={tuple(s.shape)}; expected {tuple(x.shape)}, {tuple(ref_s.shape)}"
    m, k = x.shape
    dequant = q.float().view(m, k // GROUP, GROUP) * s[..., None]
    err, why = check_close(dequant.view(m, k), x.float(), ACT_QUANT_TOL)
    ulp = torch.nextafter(ref_s, torch.full_like(ref_s, math.inf)) - ref_s
    ulps = ((s - ref_s).abs() / ulp).max().item()
    if why is None and not ulps <= SCALE_MAX_ULPS:
        why = f"scales differ from amax/448 by up to {ulps:.3g} ulp (> {SCALE_MAX_ULPS})"
    return err, why


# ---- one case ----

@dataclass
class CaseSetup:
    """Inputs bound into callables: the kdsl implementations, the baselines and the checks."""

    kdsl: dict[str, Callable[[], object]]
    check: Callable[[object], Check]
    baselines: dict[str, Callable[[], object]]
    tolerance: float
    bytes_moved: int
    flops: int | None = None
    baseline_checks: dict[str, Callable[[object], Check]] = field(default_factory=dict)
    roofline_ms: float | None = None  # shown as the ROOFLINE pseudo-baseline: its ratio is the fraction reached
    # Each callable makes this many calls, one per copy of the weights, so that each call finds its weights
    # cold in L2 under CUDA-graph replay too (do_bench flushes L2 only before each callable); times are per call.
    calls: int = 1
    host_time: bool = True  # host time per call where graph-timed (decode's eager bar); off where no bar asks


def raising(exc: Exception) -> Callable[[], object]:
    def fail() -> object:
        raise exc
    return fail


def copy_baseline(bytes_moved: int) -> Callable[[], object]:
    # Half the traffic is read, half written: the bandwidth ceiling for the same byte count.
    src = torch.empty(bytes_moved // 2, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def scaled_mm_baseline(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> Callable[[], object]:
    """cuBLAS blockwise FP8 through torch._scaled_mm; it needs M % 4 == 0, so pad with zero rows."""
    m, k = a.shape
    pad = -m % 4
    if pad:
        a = torch.cat([a.view(torch.uint8), a.new_zeros(pad, k, dtype=torch.uint8)]).view(FP8)
        a_s = torch.cat([a_s, a_s.new_ones(pad, a_s.shape[1])])
    scale_a = a_s.t().contiguous().t()  # column-major
    b_t, scale_b = b.t(), b_s.t()
    return lambda: torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)[:m]


@dataclass
class FP8GemmInputs:
    """Random bf16 x [M, K] and w [N, K], quantized by torch, and the fp32 reference of the GEMM."""

    x: torch.Tensor
    w: torch.Tensor
    a: torch.Tensor  # fp8 [M, K]
    a_s: torch.Tensor  # f32 [M, K / 128]
    b: torch.Tensor  # fp8 [N, K]
    b_s: torch.Tensor  # f32 [ceil(N / 128), K / 128]
    ref: torch.Tensor  # f32 [M, N]


def fp8_gemm_inputs(m: int, n: int, k: int) -> FP8GemmInputs:
    """Inputs of one fp8_gemm case on DEVICE (also used by `kdsl tune`); call under full_fp32_matmul."""
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    a, a_s = torch_act_quant(x)
    b, b_s = torch_weight_quant(w)
    return FP8GemmInputs(x, w, a, a_s, b, b_s, fp8_gemm_reference(a, a_s, b, b_s))


def setup_fp8_gemm(case: Case) -> CaseSetup:
    gemm = kdsl_op("fp8_gemm")
    m, n, k = case.m, case.n, case.k
    inputs = fp8_gemm_inputs(m, n, k)
    x, a, a_s, b, b_s, ref = inputs.x, inputs.a, inputs.a_s, inputs.b, inputs.b_s, inputs.ref
    w_kn = inputs.w.t().contiguous()
    return CaseSetup(
        kdsl={"fp8_gemm": lambda: gemm(a, a_s, b, b_s, out_dtype=torch.bfloat16)},
        check=lambda out: check_close(out, ref, GEMM_TOL),
        baselines={"cublas_blockwise": scaled_mm_baseline(a, a_s, b, b_s), "bf16_matmul": lambda: torch.matmul(x, w_kn)},
        baseline_checks={"cublas_blockwise": lambda out: check_close(out, ref, GEMM_TOL)},
        tolerance=GEMM_TOL, flops=2 * m * n * k,
        bytes_moved=a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * m * n)


_CEILINGS: dict[str, float] = {}


def machine_ceilings() -> tuple[float, float]:
    """(bytes/s, FLOP/s) measured once per process: a 1 GiB device copy (read + write), and cuBLAS's FP8 rate
    on an 8192^3 torch._scaled_mm with per-tensor scales (its fastest FP8 path)."""
    if not _CEILINGS:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        _CEILINGS["copy"] = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
        del src, dst
        size = 8192
        a = torch.randn(size, size, device=DEVICE).to(FP8)
        b = torch.randn(size, size, device=DEVICE).to(FP8).t()
        one = torch.ones((), device=DEVICE)
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                     return_mode="median")
        _CEILINGS["fp8"] = 2 * size ** 3 / (ms * 1e-3)
        print(f"kdsl bench: roofline from a measured copy rate of {_CEILINGS['copy'] / 1e12:.2f} TB/s and FP8 rate "
              f"of {_CEILINGS['fp8'] / 1e12:.0f} TFLOP/s", file=sys.stderr)
    return _CEILINGS["copy"], _CEILINGS["fp8"]


COLD_BYTES = 128 << 20  # weight copies a callable cycles through: over twice an H100's or H200's 50-60 MB of L2
MAX_COPIES = 64
COLD_MAX_M = 512  # above it the output alone (17-537 MB at MLA's shapes) sweeps L2 every call


def fp8_bmm_inputs(batch: int, m: int, n: int, k: int) -> tuple:
    """One fp8_bmm case on DEVICE (also used by `kdsl tune`): bf16 activations x [M, B, K]; a, a_s, the transpose(0,
    1) views of their act_quant (MLA's layout); per-head block weights b [B, N, K], b_s; their fp32 dequantized
    w [B, N, K]; and the fp32 reference [B, M, N]."""
    x = torch.randn(m, batch, k, device=DEVICE, dtype=torch.bfloat16)
    q, s = torch_act_quant(x.view(m * batch, k))
    a, a_s = q.view(m, batch, k).transpose(0, 1), s.view(m, batch, k // GROUP).transpose(0, 1)
    quantized = [torch_weight_quant(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)) for _ in range(batch)]
    b = torch.stack([wq for wq, _ in quantized])
    b_s = torch.stack([ws for _, ws in quantized])
    w = torch.stack([fp8_weight_reference(wq, ws) for wq, ws in quantized])
    ref = torch.bmm(a.float() * a_s.repeat_interleave(GROUP, -1), w.transpose(1, 2))
    return x, a, a_s, b, b_s, w, ref


def cold_copies(m: int, weights: torch.Tensor) -> int:
    """How many copies of `weights` a callable cycles through so each call reads them cold from DRAM (one above
    COLD_MAX_M rows, where the output alone sweeps L2)."""
    return min(MAX_COPIES, -(-COLD_BYTES // weights.numel())) if m <= COLD_MAX_M else 1


def setup_fp8_bmm(case: Case) -> CaseSetup:
    """MLA's per-head GEMM: a is the transpose(0, 1) view of act_quant's [M, B, K] activations (as MLA passes it),
    b [B, N, K] per-head 128x128 block weights. Baselines: bf16 torch.bmm on the dequantized weights (the same
    transposed view of the bf16 activations), and per-batch loops (one CUDA graph when graph-timed) of cuBLAS
    blockwise torch._scaled_mm and of kdsl's fp8_gemm. Up to M = 512 the callables cycle through copies of the
    weights (CaseSetup.calls) so every call reads them cold from DRAM, CUDA graphs included; activations stay
    as a previous layer leaves them."""
    bmm, gemm = kdsl_op("fp8_bmm"), kdsl_op("fp8_gemm")
    batch, m, n, k = case.batch, case.m, case.n, case.k
    x, a, a_s, b, b_s, w, ref = fp8_bmm_inputs(batch, m, n, k)
    x_t = x.transpose(0, 1)
    copies = cold_copies(m, b)
    weights = [(b, b_s, w.to(torch.bfloat16))] + [(b.clone(), b_s.clone(), w.to(torch.bfloat16))
                                                  for _ in range(copies - 1)]
    scaled = [[scaled_mm_baseline(a[g], a_s[g], bq[g], bs[g]) for g in range(batch)] for bq, bs, _ in weights]
    last = lambda outs: check_close(outs[-1], ref, GEMM_TOL)  # noqa: E731  (every copy holds the same weights)
    stacked = lambda outs: check_close(torch.stack(outs[-1]), ref, GEMM_TOL)  # noqa: E731
    bytes_moved = a.numel() + b.numel() + 4 * (a_s.numel() + b_s.numel()) + 2 * batch * m * n
    flops = 2 * batch * m * n * k
    copy_rate, fp8_rate = machine_ceilings()
    return CaseSetup(
        kdsl={"fp8_bmm": lambda: [bmm(a, a_s, bq, bs, out_dtype=torch.bfloat16) for bq, bs, _ in weights]},
        check=last,
        baselines={"bf16_bmm": lambda: [torch.bmm(x_t, w16.transpose(1, 2)) for _, _, w16 in weights],
                   "cublas_blockwise_loop": lambda: [[fn() for fn in loop] for loop in scaled],
                   "fp8_gemm_loop": lambda: [[gemm(a[g], a_s[g], bq[g], bs[g]) for g in range(batch)]
                                             for bq, bs, _ in weights]},
        baseline_checks={"cublas_blockwise_loop": stacked, "fp8_gemm_loop": stacked},
        tolerance=GEMM_TOL, flops=flops, bytes_moved=bytes_moved, calls=copies, host_time=False,
        roofline_ms=1e3 * max(bytes_moved / copy_rate, flops / fp8_rate))


def setup_act_quant(case: Case) -> CaseSetup:
    quant = kdsl_op("act_quant")
    m, k = case.m, case.k
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    ref_s = x.float().view(m, k // GROUP, GROUP).abs().amax(-1) / FP8_MAX
    bytes_moved = 2 * m * k + m * k + 4 * ref_s.numel()
    return CaseSetup(
        kdsl={"act_quant": lambda: quant(x, group_size=GROUP)},
        check=lambda out: check_act_quant(out, x, ref_s),
        baselines={COPY: copy_baseline(bytes_moved), "torch": lambda: torch_act_quant(x)},
        tolerance=ACT_QUANT_TOL, bytes_moved=bytes_moved)


def setup_weight_dequant(case: Case) -> CaseSetup:
    dequant = kdsl_op("weight_dequant")
    n, k = case.n, case.k
    q, s = torch_weight_quant(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16))
    ref = fp8_weight_reference(q, s)
    bytes_moved = n * k + 4 * s.numel() + 2 * n * k
    return CaseSetup(
        kdsl={"weight_dequant": lambda: dequant(q, s, block_size=(GROUP, GROUP), out_dtype=torch.bfloat16)},
        check=lambda out: check_close(out, ref, DEQUANT_TOL),
        baselines={COPY: copy_baseline(bytes_moved),
                   "torch": lambda: (q.float() * expand_blocks(s, n, k)).to(torch.bfloat16)},
        tolerance=DEQUANT_TOL, bytes_moved=bytes_moved)


@dataclass
class GPTQGemmInputs:
    """A random fp16 weight quantized by kdsl's gptq_quantize (INT4, group 128, "gptq" format,
    no act-order), random fp16 x [M, K], and the fp32 reference of x @ w."""

    x: torch.Tensor
    qweight: torch.Tensor  # int32 [K / 8, N]
    qzeros: torch.Tensor  # int32 [G, N / 8]
    scales: torch.Tensor  # fp16 [G, N]
    w_ref: torch.Tensor  # f32 [K, N], dequantized
    ref: torch.Tensor  # f32 [M, N]


def gptq_gemm_inputs(m: int, n: int, k: int) -> GPTQGemmInputs:
    """Inputs of one gptq_gemm case on DEVICE (also used by `kdsl tune`); call under full_fp32_matmul."""
    quantize = kdsl_op("gptq_quantize")
    w = torch.randn(n, k, device=DEVICE, dtype=torch.float16) * 0.02
    packed = quantize(w, bits=4, group_size=GROUP, sym=True)
    qweight, qzeros, scales = packed["qweight"], packed["qzeros"], packed["scales"]
    g_idx = packed.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k, device=DEVICE, dtype=torch.int32) // GROUP
    w_ref = gptq_reference_weight(qweight, qzeros, scales, g_idx)  # [K, N]
    x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
    return GPTQGemmInputs(x, qweight, qzeros, scales, w_ref, x.float() @ w_ref)


@dataclass
class DescActInputs:
    x: torch.Tensor  # [M, K], x's columns in the checkpoint's row order
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor  # int32 [K]: a permutation's groups, as GPTQ's desc_act writes them


def desc_act_checkpoint(inputs: GPTQGemmInputs) -> DescActInputs:
    """inputs' weights as an act-order checkpoint computing the same product: row perm[i] of the new
    checkpoint holds row i of the old one (group i // GROUP), and x's columns move with the rows."""
    k = inputs.x.shape[-1]
    perm = torch.randperm(k, device=DEVICE)
    q = unpack_int4(inputs.qweight, dim=0)  # [K, N]
    moved = torch.empty_like(q)
    moved[perm] = q
    shifts = torch.arange(8, device=DEVICE, dtype=torch.int64) * 4
    words = (moved.to(torch.int64).view(k // 8, 8, -1) << shifts[None, :, None]).sum(dim=1)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the top nibble
    g_idx = torch.empty(k, device=DEVICE, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, device=DEVICE, dtype=torch.int32) // GROUP
    x = torch.empty_like(inputs.x)
    x[:, perm] = inputs.x
    return DescActInputs(x, qweight, inputs.qzeros, inputs.scales, g_idx)


def setup_gptq_gemm(case: Case) -> CaseSetup:
    gemm = kdsl_op("gptq_gemm")
    m, n, k = case.m, case.n, case.k
    inputs = gptq_gemm_inputs(m, n, k)
    x, qweight, qzeros, scales, ref = inputs.x, inputs.qweight, inputs.qzeros, inputs.scales, inputs.ref
    w16 = inputs.w_ref.half()
    # No act-order here, so g_idx is left out: the bench times the contiguous-group path.
    kdsl = {"gptq_gemm": lambda: gemm(x, qweight, qzeros, scales, None, bits=4, group_size=GROUP)}
    from kdsl import ops
    if hasattr(ops, "gptq_prepare"):  # repacked weights, prepared once outside the timed call
        try:
            prepared = ops.gptq_prepare(qweight, qzeros, scales, None, bits=4, group_size=GROUP,
                                        checkpoint_format="gptq")
            kdsl["gptq_gemm[prepared]"] = lambda: gemm(x, prepared)
        except Exception as exc:  # noqa: BLE001 - only this row fails, the plain gptq_gemm still runs
            kdsl["gptq_gemm[prepared]"] = raising(exc)
        try:  # the same weights as a desc_act checkpoint: rows permuted, the group of each row in g_idx
            act_order = desc_act_checkpoint(inputs)
            prepared_act_order = ops.gptq_prepare(act_order.qweight, act_order.qzeros, act_order.scales,
                                                  act_order.g_idx, bits=4, group_size=GROUP, checkpoint_format="gptq")
            kdsl["gptq_gemm[prepared,desc_act]"] = lambda: gemm(act_order.x, prepared_act_order)
        except Exception as exc:  # noqa: BLE001 - only this row fails
            kdsl["gptq_gemm[prepared,desc_act]"] = raising(exc)
    groups = scales.shape[0]
    return CaseSetup(
        kdsl=kdsl, check=lambda out: check_close(out, ref, GEMM_TOL),
        baselines={"fp16_matmul": lambda: torch.matmul(x, w16)},
        tolerance=GEMM_TOL, flops=2 * m * n * k,
        bytes_moved=2 * m * k + k * n // 2 + groups * n // 2 + 2 * groups * n + 2 * m * n)


def setup_gptq_dequant(case: Case) -> CaseSetup:
    quantize, dequant = kdsl_op("gptq_quantize"), kdsl_op("gptq_dequant")
    n, k = case.n, case.k
    packed = quantize(torch.randn(n, k, device=DEVICE, dtype=torch.float16) * 0.02, bits=4, group_size=GROUP, sym=False)
    qweight, qzeros, scales = packed["qweight"], packed["qzeros"], packed["scales"]
    g_idx = torch.arange(k, device=DEVICE, dtype=torch.int32) // GROUP

    def torch_dequant() -> torch.Tensor:
        return gptq_reference_weight(qweight, qzeros, scales, g_idx).t().half()

    ref = gptq_reference_weight(qweight, qzeros, scales, g_idx).t()  # [N, K], as gptq_dequant returns
    bytes_moved = 4 * qweight.numel() + 4 * qzeros.numel() + 2 * scales.numel() + 2 * n * k
    return CaseSetup(
        kdsl={"gptq_dequant": lambda: dequant(qweight, qzeros, scales, bits=4, group_size=GROUP)},
        check=lambda out: check_close(out, ref, DEQUANT_TOL),
        baselines={COPY: copy_baseline(bytes_moved), "torch": torch_dequant},
        tolerance=DEQUANT_TOL, bytes_moved=bytes_moved)


SETUPS: dict[str, Callable[[Case], CaseSetup]] = {
    "fp8_gemm": setup_fp8_gemm, "act_quant": setup_act_quant,
    "weight_dequant": setup_weight_dequant, "gptq_gemm": setup_gptq_gemm,
    "gptq_dequant": setup_gptq_dequant, "fp8_bmm": setup_fp8_bmm,
}


@contextlib.contextmanager
def full_fp32_matmul() -> Iterator[None]:
    # References must be true fp32, whatever the process set for TF32.
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


HOST_CALLS = 100


def host_time_us(fn: Callable[[], object], calls: int = HOST_CALLS) -> float:
    """Host time per call: `calls` back-to-back calls on the host clock, the GPU idle before each batch and
    synchronized after (outside the timed region); median of three batches. At decode sizes the kernels
    finish sooner than the host issues them, so this is what an eager model waits for."""
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def measure(fn: Callable[[], object], graph: bool, host: bool = True) -> Timing:
    try:
        eager = triton.testing.do_bench(fn, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return Timing(error=describe(exc))
    graph_ms = None
    if graph:
        try:
            graph_ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        except Exception:  # noqa: BLE001 - not every op can be captured; eager still counts
            graph_ms = None
    host_us = host_time_us(fn) if graph and host else None
    return Timing(eager_ms=float(eager), graph_ms=None if graph_ms is None else float(graph_ms), host_us=host_us)


def per_call(t: Timing, calls: int) -> Timing:
    """A callable's times divided among the `calls` calls it makes."""
    scale = lambda v: None if v is None else v / calls  # noqa: E731
    return Timing(eager_ms=scale(t.eager_ms), graph_ms=scale(t.graph_ms), host_us=scale(t.host_us), error=t.error)


def run_once(fn: Callable[[], object], check: Callable[[object], Check] | None) -> Check:
    out = fn()
    torch.cuda.synchronize()
    return check(out) if check else (math.nan, None)


def graph_timed(case: Case) -> bool:
    """Whether the case is also timed by CUDA-graph replay."""
    return case.m is not None and (case.m <= GRAPH_MAX_M or case.op in GRAPH_EVERY_M)


def run_case(case: Case, host_time: bool = True, setups: dict | None = None) -> list[Result]:
    """All results of one case: one per kdsl implementation, sharing the baseline timings. host_time=False
    skips the host-time batches (kdsl bench --no-host-time). setups: op -> the function that sets a case up
    (default SETUPS; kdsl.bench.cases.SETUPS adds the MoE ops of kdsl/bench/moe.py)."""
    torch.manual_seed(zlib.crc32(f"{case.op} {case.label()}".encode()))  # reproducible, never zeros
    try:
        with full_fp32_matmul():
            setup = (setups or SETUPS)[case.op](case)
    except OpUnavailable as exc:
        return [Result(case, case.op, Timing(error=str(exc)), status=UNAVAILABLE, detail=str(exc))]
    except Exception as exc:  # noqa: BLE001 - e.g. kdsl's quantizer rejecting the shape
        return [Result(case, case.op, Timing(error=describe(exc)), status=ERROR, detail=f"setup: {describe(exc)}")]

    graph = graph_timed(case)
    baselines: dict[str, Timing] = {}
    for name, fn in setup.baselines.items():
        try:
            err, _ = run_once(fn, setup.baseline_checks.get(name))
        except Exception as exc:  # noqa: BLE001 - e.g. _scaled_mm refusing a shape: baseline unavailable
            baselines[name] = Timing(error=describe(exc))
            continue
        baselines[name] = per_call(measure(fn, graph, setup.host_time and host_time), setup.calls)
        baselines[name].rel_err = None if math.isnan(err) else err
    if setup.roofline_ms is not None:
        baselines[ROOFLINE] = Timing(eager_ms=setup.roofline_ms, graph_ms=setup.roofline_ms if graph else None)

    results = []
    for impl, fn in setup.kdsl.items():
        result = Result(case, impl, Timing(), baselines, flops=setup.flops, bytes_moved=setup.bytes_moved,
                        tolerance=setup.tolerance)
        try:
            result.rel_err, why = run_once(fn, setup.check)
        except Exception as exc:  # noqa: BLE001
            result.status, result.detail, result.kdsl = ERROR, describe(exc), Timing(error=describe(exc))
            results.append(result)
            continue
        if why is not None:
            result.status, result.detail = WRONG, why
        result.kdsl = per_call(measure(fn, graph, setup.host_time and host_time), setup.calls)  # a wrong kernel is still timed, and flagged
        if result.kdsl.error and result.status == OK:
            result.status, result.detail = ERROR, result.kdsl.error
        results.append(result)
    del setup
    torch.cuda.empty_cache()
    return results
