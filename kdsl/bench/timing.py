"""What the bench's cases share (kdsl/bench/cases/<op>.py): the timing loops, the checks against fp32 references,
torch quantizers and inputs that several ops use, and the shapes a case's setup and a `kdsl tune` problem take.

Timing needs torch, triton and a GPU; the quantizers and references below are device-agnostic so CPU tests can
check them (DEVICE is a module constant they set to "cpu").
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.testing

from kdsl.bench.case import GROUP
from kdsl.bench.results import Timing

DEVICE = "cuda"  # a module constant so CPU tests can drive the whole case logic
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRAPH_MAX_M = 128  # CUDA-graph timing only where launch overhead could hide the kernel (a case may ask for every M)
GEMM_TOL = 2e-2  # bf16 / fp16 output vs fp32 reference
DEQUANT_TOL = 1e-2

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


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in float64."""
    xd = x.double()
    return xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * weight.double()


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
    # kdsl rows that are another of its rows run another way, whose cost the report gives as a time ratio:
    # {variant impl: the impl it is held against} (act-order's desc_act row against the plain one).
    variant_of: dict[str, str] = field(default_factory=dict)


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
    if b_s.shape[1] % 4:
        # torch._scaled_mm takes 128x128 block scales whose rows are K / 128 floats apart only where that is a
        # multiple of 16 bytes; at K = 128 (fp8_bmm's per-head loop) it accepted the unaligned layout and cuBLAS
        # read past the scales (an illegal address on an H200), and a padded layout is refused. No baseline there.
        return raising(ValueError(f"cuBLAS blockwise needs K / 128 a multiple of 4 (16-byte scale rows); K = {k}"))
    b_t, scale_b = b.t(), b_s.t()
    return lambda: torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)[:m]


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


def cold_copies(m: int, weights: torch.Tensor) -> int:
    """How many copies of `weights` a callable cycles through so each call reads them cold from DRAM (one above
    COLD_MAX_M rows, where the output alone sweeps L2). Counted in bytes: GPTQ's int32 words hold eight weights."""
    size = weights.numel() * weights.element_size()
    return min(MAX_COPIES, -(-COLD_BYTES // max(1, size))) if m <= COLD_MAX_M else 1


def weight_copies(m: int, *weights: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The weights and cold_copies(m, weights[0]) - 1 clones of them: the copies a callable cycles through so that
    each call reads them cold (every copy holds the same values)."""
    return [weights] + [tuple(w.clone() for w in weights) for _ in range(cold_copies(m, weights[0]) - 1)]


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


def measure(fn: Callable[[], object], graph: bool, host: bool = True, calls: int = 1) -> Timing:
    """fn's times (per invocation of fn; per_call divides them among the `calls` calls it makes). Host time batches
    about HOST_CALLS calls however many fn makes: more could fill the launch queue where the GPU is slower than the
    host (cold weights), and the host would then wait on the GPU."""
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
    host_us = host_time_us(fn, -(-HOST_CALLS // calls)) if graph and host else None
    return Timing(eager_ms=float(eager), graph_ms=None if graph_ms is None else float(graph_ms), host_us=host_us)


def per_call(t: Timing, calls: int) -> Timing:
    """A callable's times divided among the `calls` calls it makes."""
    scale = lambda v: None if v is None else v / calls  # noqa: E731
    return Timing(eager_ms=scale(t.eager_ms), graph_ms=scale(t.graph_ms), host_us=scale(t.host_us), error=t.error)


def run_once(fn: Callable[[], object], check: Callable[[object], Check] | None) -> Check:
    out = fn()
    torch.cuda.synchronize()
    return check(out) if check else (math.nan, None)


# ---- kdsl tune: a case module's problems for the kernels it tunes ----

@dataclass
class Problem:
    """One shape's inputs bound to a kernel. launch(params) runs it (timed); check(params) poisons
    the output, runs once, waits, and compares with the reference; close() frees the inputs."""

    launch: Callable[[dict], object]
    check: Callable[[dict], Check]
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Tune:
    """How `kdsl tune` tunes an op's kernel: the scheme it is timed with (the bench's), the problem builder
    ((registry entry, tune Shape) -> Problem, called under full_fp32_matmul), and whether candidates are timed by
    CUDA graphs at every M (else up to GRAPH_MAX_M, by do_bench above it)."""

    scheme: object  # a kdsl.schema scheme: BlockFP8(), GPTQ(), W4A16()
    problem: Callable[[object, object], Problem]
    graph_every_m: bool = False


def cycling_problem(outs: list[torch.Tensor], ref: torch.Tensor, tolerance: float,
                    run: Callable[[int, torch.Tensor, dict], None]) -> Problem:
    """The Problem of a kernel whose launches take turns over len(outs) copies of its weights, each writing its own
    output: run(i, outs[i], params) launches copy i. A CUDA graph of launches then reads the weights cold from DRAM
    and writes every output back, as the bench's calls do (one reused output buffer would stay in L2)."""
    turn = [0]

    def launch(params: dict) -> torch.Tensor:
        i = turn[0] % len(outs)
        turn[0] += 1
        run(i, outs[i], params)
        return outs[i]

    def check(params: dict) -> Check:
        outs[turn[0] % len(outs)].fill_(float("nan"))  # a kernel that writes nothing must not pass on an earlier result
        out = launch(params)
        torch.cuda.synchronize()
        return check_close(out, ref, tolerance)

    return Problem(launch=launch, check=check)
