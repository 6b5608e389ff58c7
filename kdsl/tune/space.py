"""The candidate tiles for one M bucket of a variant.

A small grid per kind of bucket, varied only over the knobs the variant's implementation
honours (its unit in kdsl.kernels: common tile fields and its options); every other field stays unset. Each knob's values include
the current tile's (GEMV candidates where an MMA tile serves take the grid's alone), and
candidates are ordered nearest the current tile first, so a --max-candidates cap keeps its
neighbourhood. The current tile is always candidate 0, and
only tiles that validate for every scheme of the definition (kdsl.schema.tile_problems:
knobs, MMA rows, block sizes, shared memory on every arch of the range) are kept.

Kinds of bucket, by the largest M it serves:
  gemv     m_max up to the rows the tile's implementation's GEMV serves well (gemv_max_m: 1 for the
           CUDA-core GEMVs, 8 for the mma.sync one)
  decode   m_max <= 16: one MMA's rows, narrow N, split K
  mid      m_max <= 128: block_m up to M, some split K
  prefill  the last bucket or m_max > 128: big tiles, deeper pipelines, persistent grids
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kdsl.kernels import BASE_KNOBS, KernelImpl, find_impl
from kdsl.schema import Tile, Variant, tile_problems

DEFAULT_MAX_CANDIDATES = 24
# The fields a tile writes, in the order `kdsl tune` writes them (its options last, as one inline table).
TILE_FIELDS = tuple(name for name in Tile.model_fields if name != "options") + ("options",)
# What a candidate may vary besides options: m_max and n_min are the bucket's, impl the bucket's tile's.
COMMON_KNOBS = tuple(name for name in TILE_FIELDS if name not in ("impl", "m_max", "n_min", "options"))


def knobs_of(impl: KernelImpl) -> tuple[str, ...]:
    """Every knob a candidate of this implementation may vary: common tile fields, then its options."""
    return COMMON_KNOBS + tuple(impl.options.model_fields)


def knob_value(tile: Tile, impl: KernelImpl, knob: str):
    """A common field's value, or an option's (its default where the tile leaves it unset)."""
    if knob in COMMON_KNOBS:
        return getattr(tile, knob)
    return tile.options.get(knob, impl.options.model_fields[knob].default)


def knob_default(impl: KernelImpl, knob: str):
    fields = Tile.model_fields if knob in COMMON_KNOBS else impl.options.model_fields
    return fields[knob].default

GEMV, DECODE, MID, PREFILL = "gemv", "decode", "mid", "prefill"
DECODE_MAX_M = 16
MID_MAX_M = 128

# Values tried per common tile field and kind of bucket; an implementation's own options take the values its unit
# declares (KernelImpl.tune_grid). Knobs not listed keep the current tile's value.
GRIDS: dict[str, dict[str, tuple]] = {
    # block_n 16: one mma.sync's columns per program (the mma.sync GEMV's only width).
    GEMV: {"block_m": (1,), "block_n": (16, 32, 64, 128), "block_k": (128, 256, 512), "split_k": (1, 2, 4, 8),
           "num_warps": (4, 8)},
    DECODE: {"block_n": (32, 64, 128), "block_k": (64, 128, 256), "split_k": (1, 2, 4, 8),
             "num_warps": (4,), "num_stages": (3, 4, 5, 6)},
    MID: {"block_n": (64, 128, 256), "block_k": (64, 128), "split_k": (1, 2, 4),
          "num_warps": (4, 8), "num_stages": (3, 4)},
    PREFILL: {"block_m": (64, 128, 256), "block_n": (64, 128, 256), "block_k": (64, 128), "split_k": (1, 2),
              "num_warps": (4, 8), "num_stages": (3, 4, 5)},
}


@dataclass(frozen=True)
class Bucket:
    """One tile of a variant: serves lo < M <= m_max (m_max None: every M above lo) and, where the
    M bucket is tiled by N too, n_min <= N < n_below (None: unbounded)."""

    index: int
    lo: int
    m_max: int | None
    tile: Tile  # the definition's current tile
    n_min: int | None = None
    n_below: int | None = None  # the n_min of the M bucket's tile before this one
    batch_above: int | None = None  # the batch_max of the tile before it, which serves those batches first

    @property
    def batch_max(self) -> int | None:
        """The batches the tile serves at most (an option of batched kernels' tiles; None: any)."""
        return self.tile.options.get("batch_max")

    def holds_batch(self, batch: int | None) -> bool:
        if batch is None:
            return True
        return (self.batch_max is None or batch <= self.batch_max) and (self.batch_above is None or batch > self.batch_above)

    def holds(self, m: int) -> bool:
        return m > self.lo and (self.m_max is None or m <= self.m_max)

    def holds_n(self, n: int) -> bool:
        return (self.n_min is None or n >= self.n_min) and (self.n_below is None or n < self.n_below)

    def label(self) -> str:
        label = f"M <= {self.m_max}" if self.m_max is not None else f"M > {self.lo}"
        if self.n_min is not None:
            label += f", N >= {self.n_min}"
        if self.n_below is not None:
            label += f", N < {self.n_below}"
        if self.batch_max is not None:
            label += f", B <= {self.batch_max}"
        if self.batch_above is not None:
            label += f", B > {self.batch_above}"
        return label

    def name(self) -> str:
        """As --bucket names it: its m_max, or "rest" for the last bucket (every tile of that M bucket)."""
        return "rest" if self.m_max is None else str(self.m_max)


def buckets(variant: Variant) -> list[Bucket]:
    out, lo, n_below = [], 0, None
    for index, tile in enumerate(variant.tiles):
        if index and (tile.m_max, tile.n_min) == (variant.tiles[index - 1].m_max, variant.tiles[index - 1].n_min):
            # An alternative to the tile before it (served where that one's kernel refuses): the same M and N.
            before = out[-1]
            out.append(Bucket(index, before.lo, tile.m_max, tile, tile.n_min, before.n_below, before.batch_max))
            continue
        out.append(Bucket(index, lo, tile.m_max, tile, tile.n_min, n_below))
        closes = index == len(variant.tiles) - 1 or variant.tiles[index + 1].m_max != tile.m_max
        n_below = None if closes else tile.n_min
        if closes:
            lo = tile.m_max or lo
    return out


def kinds(bucket: Bucket, impl: KernelImpl) -> list[str]:
    """The kinds of candidate a bucket gets: GEMV candidates where a GEMV serves every M of it."""
    hi = bucket.m_max
    if hi is None or hi > MID_MAX_M:
        return [PREFILL]
    if hi <= DECODE_MAX_M:
        return [GEMV, DECODE] if _gemv_serves(hi, impl) else [DECODE]
    return [MID]


def _gemv_serves(m_max: int, impl: KernelImpl) -> bool:
    return bool(impl.gemv_block_m) and m_max <= impl.gemv_max_m


def _mma_rows(bucket: Bucket, impl: KernelImpl, kind: str) -> tuple[int, ...]:
    """block_m for MMA tiles: one MMA's rows for decode; up to M (at least a quarter of it) for mid."""
    floor = max(impl.min_block_m, 16)
    if kind == DECODE:
        return (floor,)
    top = 1 << (bucket.m_max - 1).bit_length()  # next power of two >= m_max
    return tuple(b for b in (16, 32, 64, 128, 256) if floor <= b <= top and b >= top // 4) or (floor,)


def knob_values(bucket: Bucket, impl: KernelImpl, kind: str) -> dict[str, tuple]:
    """Values per honoured knob (the grid's and the current tile's, where the candidate is of its kind);
    knobs the impl ignores are absent."""
    grid = {**GRIDS[kind], **impl.tune_grid.get(kind, {})}
    if kind in (DECODE, MID):
        grid["block_m"] = _mma_rows(bucket, impl, kind)
    honoured = impl.tile_knobs | BASE_KNOBS | set(impl.options.model_fields)
    current = bucket.tile
    # GEMV candidates where an MMA tile serves start from the grid and the defaults: the MMA tile's split
    # and pipeline knobs are no GEMV's.
    foreign = kind == GEMV and current.block_m != 1
    values = {}
    for knob in knobs_of(impl):
        if knob not in honoured:
            continue
        options = grid.get(knob, ())
        mine = knob_value(current, impl, knob)
        if knob == "block_m" and (kind == GEMV or mine == 1):
            values[knob] = options  # GEMV candidates and MMA candidates never mix their row counts
        elif foreign:
            values[knob] = options or (knob_default(impl, knob),)
        else:
            values[knob] = tuple(dict.fromkeys((*options, mine)))
    return values


def tile_key(tile: Tile) -> tuple:
    """What a tile launches with: equal keys, same kernel."""
    return tuple(getattr(tile, f) for f in TILE_FIELDS[:-1]) + (tuple(sorted(tile.options.items())),)


def _distance(tile: Tile, current: Tile, impl: KernelImpl) -> tuple[int, float]:
    """(knobs changed, how far in powers of two): near the current tile first."""
    changed, far = 0, 0.0
    for knob in knobs_of(impl):
        a, b = knob_value(tile, impl, knob), knob_value(current, impl, knob)
        if a == b:
            continue
        changed += 1
        # Powers of two apart for sizes; a switch (a flag, or a size against None) counts one.
        numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b))
        far += abs(math.log2(a / b)) if numbers else 1.0
    return changed, far


def _make_tile(bucket: Bucket, impl: KernelImpl, knobs: dict[str, object]) -> Tile | None:
    """A Tile with the common knobs as fields and the implementation's as options (defaults left out)."""
    fields = {name: value for name, value in
              (("impl", bucket.tile.impl), ("m_max", bucket.m_max), ("n_min", bucket.n_min)) if value is not None}
    common = {k: v for k, v in knobs.items() if k in COMMON_KNOBS}
    options = {k: v for k, v in knobs.items() if k not in COMMON_KNOBS and v != knob_default(impl, k)}
    if bucket.batch_max is not None:  # which calls the tile serves, not how it runs them: candidates keep it
        options["batch_max"] = bucket.batch_max
    try:
        return Tile(**fields, **common, options=options)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None


def candidates(variant: Variant, bucket: Bucket, schemes, max_candidates: int = DEFAULT_MAX_CANDIDATES,
               ) -> list[Tile]:
    """The bucket's current tile, then valid candidates nearest it first, at most max_candidates in all."""
    if max_candidates < 1:
        raise ValueError(f"max_candidates must be at least 1, got {max_candidates}")
    impl = find_impl(variant.op, variant.impl_of(bucket.tile))
    if impl is None:
        raise ValueError(f"{variant.op}/{variant.impl_of(bucket.tile)} is not in the catalogue")
    current = bucket.tile
    # Candidates leave options at their defaults out; an option the current tile writes at its default
    # launches the same kernel, so it counts as left out here too.
    not_default = {k: v for k, v in current.options.items() if v != knob_default(impl, k)}
    seen = {tile_key(current.model_copy(update={"options": not_default}))}
    found: list[tuple[tuple, int, Tile]] = []
    for kind in kinds(bucket, impl):
        values = knob_values(bucket, impl, kind)
        names = list(values)
        for combo in itertools.product(*(values[n] for n in names)):
            tile = _make_tile(bucket, impl, dict(zip(names, combo)))
            if tile is None or tile_key(tile) in seen:
                continue
            seen.add(tile_key(tile))
            if any(tile_problems(variant, tile, scheme) for scheme in schemes):
                continue
            found.append((_distance(tile, current, impl), len(found), tile))
    found.sort(key=lambda item: item[:2])
    return [current, *(tile for _, _, tile in found)][:max_candidates]
