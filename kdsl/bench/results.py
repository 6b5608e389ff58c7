"""What one benchmark case produced: timings of kdsl and its baselines, and the correctness check.

Kept free of torch so the report can be built and tested from hand-made results on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kdsl.bench.case import Case

OK, WRONG, ERROR, UNAVAILABLE = "ok", "WRONG", "ERROR", "not available"
FAILED = (WRONG, ERROR)  # statuses that make `kdsl bench` exit 1
COPY = "copy"
# A computed pseudo-baseline: the roofline time of the case (the larger of bytes / measured copy bandwidth and
# FLOPs / measured FP8 rate), so its ratio is kdsl's fraction of the roofline.
ROOFLINE = "roofline"


@dataclass
class Timing:
    """Median times of one implementation; `error` says why it has none."""

    eager_ms: float | None = None
    graph_ms: float | None = None  # CUDA-graph replay, measured for M <= 128 (gptq_gemm: every M)
    host_us: float | None = None  # host time per call, GPU idle, where graph_ms is measured (decode sizes)
    error: str | None = None
    rel_err: float | None = None  # baselines computing the same quantized product report theirs
    # kdsl bench --kernels: device µs per call of each GPU kernel (kdsl.bench.profile), largest first
    kernels_us: dict[str, float] | None = None


@dataclass
class Result:
    case: Case
    impl: str  # the kdsl function timed, e.g. "gptq_gemm" or "gptq_gemm[prepared]"
    kdsl: Timing
    baselines: dict[str, Timing] = field(default_factory=dict)
    flops: int | None = None  # 2*M*N*K for GEMMs
    bytes_moved: int | None = None  # bytes read + written by the op
    rel_err: float | None = None  # ||out - ref|| / ||ref|| against the fp32 reference
    tolerance: float | None = None
    detail: str | None = None  # why WRONG / ERROR / not available
    status: str = OK
    memory_bound: bool = False  # rated in TB/s against the copy baseline (its case module's MEMORY_BOUND)
    variant_of: str | None = None  # the kdsl row of the same case this one is held against (CaseSetup.variant_of)

    def tflops(self, ms: float | None) -> float | None:
        return self.flops / (ms * 1e-3) / 1e12 if self.flops and ms else None

    def tbps(self, ms: float | None) -> float | None:
        return self.bytes_moved / (ms * 1e-3) / 1e12 if self.bytes_moved and ms else None

    @property
    def best_ms(self) -> float | None:
        """kdsl's CUDA-graph time where measured, else its eager time."""
        return self.kdsl.graph_ms or self.kdsl.eager_ms

    def rate(self, ms: float | None) -> float | None:
        """The headline rate: TB/s for memory-bound ops, TFLOP/s for GEMMs."""
        return self.tbps(ms) if self.memory_bound else self.tflops(ms)

    def ratio(self, baseline: str, mode: str = "eager") -> float | None:
        """baseline time / kdsl time: > 1 means kdsl is faster."""
        base = self.baselines.get(baseline)
        attr = f"{mode}_ms"
        mine = getattr(self.kdsl, attr)
        theirs = getattr(base, attr) if base else None
        return theirs / mine if mine and theirs else None

    def ceiling_fraction(self) -> float | None:
        """Memory-bound ops: share of the copy bandwidth measured for the same bytes.
        Ops with a roofline (fp8_gemm, gptq_gemm, fp8_bmm, the MoE ops): its share, on CUDA-graph times where
        measured.
        Other GEMMs: time of the fastest baseline / kdsl time (no roofline is measured for them)."""
        if self.memory_bound:
            return self.ratio(COPY)
        if ROOFLINE in self.baselines:
            return self.ratio(ROOFLINE, "graph") or self.ratio(ROOFLINE)
        ratios = [r for name in self.baselines if (r := self.ratio(name)) is not None]
        return min(ratios) if ratios else None

    @property
    def failed(self) -> bool:
        return self.status in FAILED
