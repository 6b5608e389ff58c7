"""Time a bucket's candidate tiles on its shapes and pick the winner.

What runs a candidate is a `Problem` (one shape's inputs bound to the generated kernel, built on the
GPU by the op's bench case, kdsl/bench/cases/<op>.py, through kdsl.tune.problems) and what times it
is a `Timer`, both passed in, so CPU tests drive the whole search with stand-ins.

Per shape, every surviving candidate is run once and checked against the fp32 reference
(poisoned output first, the bench's tolerance), then timed. A candidate that is wrong or
raises (out of resources, a compile error) on any shape is dropped with the reason.

Score = geometric mean over shapes of (candidate time / current tile time); the winner has
the lowest score, and ties keep the current tile (candidate 0). If the current tile itself
fails, times are divided by the fastest survivor's instead: the ranking is the same (a
geometric mean of ratios to any fixed per-shape time orders candidates alike).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kdsl.bench.case import Case
from kdsl.bench.cases import TUNE_SHAPE_OPS, TUNES
from kdsl.bench.timing import Problem
from kdsl.codegen.render import tile_params
from kdsl.ops.moe import most_tokens, tokens_per_expert
from kdsl.schema import Tile
from kdsl.tune.space import Bucket

# What the bench's case modules tune (their TUNES), and the bench op whose preset shapes each is tuned on
# (gptq_gemm's serve both GPTQ GEMMs).
SHAPE_OPS = TUNE_SHAPE_OPS
TUNABLE_OPS = tuple(SHAPE_OPS)


@dataclass(frozen=True)
class Shape:
    m: int  # the MoE layers: T, tokens
    n: int  # the MoE layers: I, the experts' intermediate size
    k: int  # the MoE layers: H, the hidden size
    batch: int | None = None  # fp8_bmm's B (MLA's heads); None for the 2-D GEMMs
    experts: int | None = None  # the MoE layers: E experts, each token routed to topk of them; None elsewhere
    topk: int | None = None

    @property
    def bucket_m(self) -> int:
        """The M that picks the shape's tile: M, or for the MoE layers the tokens per routed expert."""
        if self.experts is None:
            return self.m
        return tokens_per_expert(self.m * self.topk, self.experts)

    def label(self) -> str:
        if self.experts is not None:
            return f"E={self.experts} TOPK={self.topk} T={self.m} H={self.k} I={self.n}"
        return (f"B={self.batch} " if self.batch is not None else "") + f"M={self.m} N={self.n} K={self.k}"


ProblemFactory = Callable[[Shape], Problem]
Timer = Callable[[Callable[[], object], int], float]  # (launch, M) -> median milliseconds
Progress = Callable[[str], None]


def default_timer(fn: Callable[[], object], m: int) -> float:
    """Median ms: triton.testing.do_bench_cudagraph for M <= 128, do_bench (L2 flushed) otherwise."""
    from triton.testing import do_bench, do_bench_cudagraph

    from kdsl.bench.timing import GRAPH_MAX_M

    bench = do_bench_cudagraph if m <= GRAPH_MAX_M else do_bench
    return float(bench(fn, return_mode="median"))


def graph_timer(fn: Callable[[], object], m: int) -> float:
    """Median ms of triton.testing.do_bench_cudagraph at every M."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, return_mode="median"))


# Ops timed by CUDA graphs at every M, as kdsl bench times them (their Tune says so: fp8_bmm's B = 16 calls run
# in 5-25 us at M = 512-4096, under an eager launch's host time).
GRAPH_TIMED_OPS = frozenset(op for op, tune in TUNES.items() if tune.graph_every_m)


def timer_for(op: str) -> Timer:
    return graph_timer if op in GRAPH_TIMED_OPS else default_timer


def shapes_for_bucket(op: str, cases: Sequence[Case], bucket: Bucket) -> list[Shape]:
    """Every (N, K) the preset has for the op inside the bucket's N range, at the preset's M values
    inside the bucket, or at the bucket's m_max if none is (the last bucket: twice the previous
    m_max, at least 1). An N range no preset shape falls in takes the preset's K at its edge N.
    fp8_bmm's shapes carry the preset's batch (B, N, K) with them, those of the batches the bucket's tile
    serves (batch_max, and above the batch_max of a tile before it); none: the preset's (N, K) at that bound."""
    mine = [c for c in cases if c.op == SHAPE_OPS[op]]
    if any(c.experts is not None for c in mine):
        return _moe_shapes(mine, bucket)
    in_n = [c for c in mine if bucket.holds_n(c.n)]
    triples = list(dict.fromkeys((c.n, c.k, c.batch) for c in in_n if bucket.holds_batch(c.batch)))
    if in_n and not triples:  # no preset batch in the bucket's range: its bound
        bound = bucket.batch_max if bucket.batch_max is not None else bucket.batch_above + 1
        triples = list(dict.fromkeys((c.n, c.k, bound) for c in in_n))
    if not triples and mine:  # only an N range (n_min or n_below set) can leave out every preset shape
        triples = list(dict.fromkeys((_edge_n(bucket), c.k, c.batch) for c in mine))
    ms = sorted({c.m for c in mine if bucket.holds(c.m)})
    if not ms:
        ms = [bucket.m_max if bucket.m_max is not None else max(2 * bucket.lo, 1)]
    return [Shape(m, n, k, batch) for m in ms for n, k, batch in triples]


def _edge_n(bucket: Bucket) -> int:
    """The N an N range that no preset shape falls in is tuned at: its n_min, or half the n_below under it."""
    return bucket.n_min if bucket.n_min is not None else max(bucket.n_below // 2, 1)


def _moe_shapes(cases: Sequence[Case], bucket: Bucket) -> list[Shape]:
    """The MoE layers' shapes for a bucket of tokens per routed expert: every layer (E, k, H, I) of the preset at
    the preset's token counts T whose tokens per expert fall in the bucket; none: at the most T that give the
    bucket's m_max tokens per expert (the last bucket: twice the previous m_max). The tile is picked by I as its N;
    an I range no preset layer falls in takes the preset's layers at its edge I, as the GEMMs' N ranges do."""
    layers = list(dict.fromkeys((c.experts, c.topk, c.hidden, c.inter) for c in cases))
    in_range = [layer for layer in layers if bucket.holds_n(layer[3])]
    if in_range or not layers:
        tuned = [(layer, layer[3]) for layer in in_range]
    else:
        tuned = [(layer, _edge_n(bucket)) for layer in layers]
    shapes = []
    for (experts, topk, hidden, inter), n in tuned:
        tokens = sorted({c.m for c in cases if (c.experts, c.topk, c.hidden, c.inter) == (experts, topk, hidden, inter)
                         and bucket.holds(tokens_per_expert(c.m * topk, experts))})
        if not tokens:
            want = bucket.m_max if bucket.m_max is not None else max(2 * bucket.lo, 1)
            tokens = [most_tokens(want, experts, topk)]
        shapes += [Shape(t, n, hidden, experts=experts, topk=topk) for t in tokens]
    return shapes


def describe(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:300] if first else ''}"


@dataclass
class Outcome:
    """One candidate: its time per shape, or why it was dropped."""

    tile: Tile
    times: dict[Shape, float] = field(default_factory=dict)
    errors: dict[Shape, float] = field(default_factory=dict)  # relative error per shape
    dropped: str | None = None
    score: float | None = None  # geometric mean of time ratios; None when dropped

    @property
    def ok(self) -> bool:
        return self.dropped is None


@dataclass
class BucketResult:
    bucket: Bucket
    shapes: list[Shape]
    outcomes: list[Outcome]  # outcomes[0] is the current tile

    @property
    def current(self) -> Outcome:
        return self.outcomes[0]

    @property
    def winner(self) -> Outcome | None:
        """Lowest score; the first of equals, so a tie keeps the current tile."""
        survivors = [o for o in self.outcomes if o.ok]
        return min(survivors, key=lambda o: o.score) if survivors else None

    @property
    def speedup(self) -> float | None:
        """Current tile's time over the winner's (geometric mean over shapes); None if either failed."""
        winner = self.winner
        if winner is None or not self.current.ok:
            return None
        return self.current.score / winner.score

    @property
    def changed(self) -> bool:
        return self.winner is not None and self.winner is not self.current

    @property
    def dropped(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def score(outcomes: list[Outcome], shapes: list[Shape]) -> None:
    """Fill in every surviving outcome's score (see the module docstring)."""
    survivors = [o for o in outcomes if o.ok]
    if not survivors:
        return
    current = outcomes[0]
    for o in survivors:
        logs = []
        for shape in shapes:
            base = current.times[shape] if current.ok else min(s.times[shape] for s in survivors)
            logs.append(math.log(o.times[shape] / base))
        o.score = math.exp(sum(logs) / len(logs))


def compact(tile: Tile) -> str:
    """One short line per tile for progress: 64x128x128 split_k=4 w4 s4 persistent."""
    parts = [f"{tile.block_m}x{tile.block_n}x{tile.block_k}"]
    parts += [f"split_k={tile.split_k}"] if tile.split_k != 1 else []
    parts += [f"group_m={tile.group_m}"] if tile.group_m != Tile.model_fields["group_m"].default else []
    parts += [f"w{tile.num_warps}", f"s{tile.num_stages}"]
    # Every option the tile sets, named as the definition names it; switches by their name alone.
    parts += [name if value is True else f"{name}={value}" for name, value in tile.options.items()
              if value not in (False, None)]
    return " ".join(parts)


def search_bucket(bucket: Bucket, tiles: list[Tile], shapes: list[Shape], make_problem: ProblemFactory,
                  timer: Timer = default_timer, progress: Progress | None = None, *, impl) -> BucketResult:
    """Check and time every tile on every shape (tiles[0] is the current tile); score the survivors.
    impl: the implementation (kdsl.kernels) whose tiles they are, which turns them into launch parameters."""
    if not tiles or not shapes:
        raise ValueError("a bucket needs at least one tile and one shape")
    say = progress or (lambda line: None)
    outcomes = [Outcome(tile) for tile in tiles]
    params = [tile_params(tile, impl) for tile in tiles]
    for s_index, shape in enumerate(shapes, 1):
        problem = make_problem(shape)
        try:
            for c_index, (outcome, p) in enumerate(zip(outcomes, params), 1):
                if not outcome.ok:
                    continue
                where = (f"bucket {bucket.label()} shape {s_index}/{len(shapes)} {shape.label()} "
                         f"candidate {c_index}/{len(tiles)} {compact(outcome.tile)}")
                try:
                    err, why = problem.check(p)
                    if why is not None:
                        outcome.dropped = f"WRONG at {shape.label()}: {why}"
                    else:
                        ms = timer(lambda p=p: problem.launch(p), shape.m)
                        if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0):
                            outcome.dropped = f"ERROR at {shape.label()}: timer returned {ms!r}"
                        else:
                            outcome.times[shape], outcome.errors[shape] = float(ms), err
                except Exception as exc:  # noqa: BLE001 - out of resources, compile errors: drop the tile
                    outcome.dropped = f"ERROR at {shape.label()}: {describe(exc)}"
                say(f"{where}: " + (f"{outcome.times[shape]:.4f} ms" if outcome.ok else f"dropped ({outcome.dropped})"))
        finally:
            problem.close()
            del problem  # before the next shape's inputs are built
    score(outcomes, shapes)
    return BucketResult(bucket, shapes, outcomes)
