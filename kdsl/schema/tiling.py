"""How a kernel is tiled: per M bucket, inside an arch range."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PositiveInt, field_validator, model_validator

from kdsl.naming import parse_arch
from kdsl.strict_model import StrictModel
from kdsl.schema.layout import GPTQLayout


def _power_of_two(value: int) -> int:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two")
    return value


def _arch_name(value: str) -> str:
    parse_arch(value)  # raises ValueError with the expected form
    return value


PowerOfTwo = Annotated[int, AfterValidator(_power_of_two)]
ArchName = Annotated[str, AfterValidator(_arch_name)]


class Tile(StrictModel):
    """Launch parameters for one M bucket: the geometry every GEMM shares, and `options`, the knobs of
    the variant's implementation. Fields an implementation ignores must stay unset."""

    impl: str | None = Field(
        None, description="the implementation serving this tile (default: the variant's impl); a tile with the same "
        "m_max and n_min as the one before it is that tile's alternative, used where its kernel refuses the call"
    )
    m_max: PositiveInt | None = Field(None, description="serves M up to this (inclusive); omit on the last bucket")
    n_min: PositiveInt | None = Field(
        None, description="inside its M bucket, serves N from this up; the bucket's last tile omits it"
    )
    block_m: PowerOfTwo = 64
    block_n: PowerOfTwo = 128
    block_k: PowerOfTwo = 128
    group_m: PositiveInt = Field(8, description="rows of tiles walked together for L2 reuse")
    split_k: PositiveInt = Field(1, description="programs sharing one output tile along K (clamped to K's blocks)")
    num_warps: Literal[1, 2, 4, 8, 16] = 4
    num_stages: int = Field(3, ge=1, le=8)
    options: dict[str, Any] = Field(
        default_factory=dict, description="knobs of the variant's implementation only, validated by its Options "
        "model (kdsl/kernels/<family>/<impl>.py), e.g. { persistent = true, swap_ab = true }"
    )


class Variant(StrictModel):
    """One implementation of one op, with the arch range it may be picked on and its tiles."""

    op: str
    impl: str
    min_arch: ArchName
    max_arch: ArchName | None = None
    tiles: list[Tile] = Field(min_length=1)
    layout: GPTQLayout | None = Field(None, description="weight layout, for ops that read prepared weights")
    dequant_min_m: PositiveInt | None = Field(
        None, description="from this many rows of x up, the op dequantizes the prepared weights with its dequant op "
        "(w4a16_gemm: w4a16_dequant, a variant of the same arch range and layout in this definition) and runs "
        "torch.matmul (cuBLAS) instead of its GEMM tiles, which still serve smaller M (and every M where no dequant "
        "kernel serves); omit it for no such path"
    )
    dequant_max_n: PositiveInt | None = Field(
        None, description="with dequant_min_m: only layers of at most this many output columns take the dequantize "
        "+ cuBLAS path (wider ones keep the GEMM tiles, whose wide-N prefill tiles may beat it); omit: every N"
    )

    @field_validator("tiles")
    @classmethod
    def _buckets_cover_m_and_n_once(cls, tiles: list[Tile]) -> list[Tile]:
        """M buckets in increasing m_max, the last open-ended; inside one, tiles for wide N first
        (decreasing n_min), the last one serving every N."""
        previous_m, previous_n = 0, None
        for index, tile in enumerate(tiles):
            if index and (tile.m_max, tile.n_min) == (tiles[index - 1].m_max, tiles[index - 1].n_min):
                continue  # an alternative to the tile before it (its implementation's refusals are checked later)
            # The tile that ends this (m_max, n_min) run of alternatives decides the bucket structure.
            end = index
            while end + 1 < len(tiles) and (tiles[end + 1].m_max, tiles[end + 1].n_min) == (tile.m_max, tile.n_min):
                end += 1
            last = end == len(tiles) - 1
            closes_bucket = last or tiles[end + 1].m_max != tile.m_max
            if tile.m_max is None and not last and tiles[end + 1].m_max is not None:
                raise ValueError(f"tiles[{index}] has no m_max but is not the last bucket")
            if previous_n is None and tile.m_max is not None and tile.m_max <= previous_m:
                raise ValueError(
                    f"tiles[{index}].m_max = {tile.m_max} overlaps the previous bucket (m_max = {previous_m}); "
                    "buckets must be listed with strictly increasing m_max"
                )
            if last and tile.m_max is not None:
                raise ValueError(f"tiles[{index}] is the last bucket and must omit m_max so every M is served")
            if tile.n_min is None and not closes_bucket:
                raise ValueError(
                    f"tiles[{index}] has the same m_max as tiles[{end + 1}] but no n_min: "
                    "tiles of one M bucket must differ by n_min, and only the bucket's last omits it"
                )
            if tile.n_min is not None:
                if closes_bucket:
                    raise ValueError(
                        f"tiles[{index}] has n_min = {tile.n_min} but is the last tile of its M bucket, "
                        "which must omit n_min so every N is served"
                    )
                if previous_n is not None and tile.n_min >= previous_n:
                    raise ValueError(
                        f"tiles[{index}].n_min = {tile.n_min} must be below the previous tile's ({previous_n}): "
                        "inside an M bucket, list wide-N tiles first"
                    )
            previous_n = None if closes_bucket else tile.n_min
            if closes_bucket and tile.m_max is not None:
                previous_m = tile.m_max
        return tiles

    @model_validator(mode="after")
    def _range_is_ordered(self) -> "Variant":
        if self.max_arch is not None and parse_arch(self.max_arch) < parse_arch(self.min_arch):
            raise ValueError(f"max_arch {self.max_arch} is below min_arch {self.min_arch}")
        return self

    def impl_of(self, tile: Tile) -> str:
        """The implementation that serves `tile`."""
        return tile.impl or self.impl

    @property
    def impls(self) -> tuple[str, ...]:
        """Every implementation the variant's tiles use, the variant's own first: one generated module each."""
        return tuple(dict.fromkeys([self.impl, *(self.impl_of(tile) for tile in self.tiles)]))

    @property
    def min_cc(self) -> int:
        return parse_arch(self.min_arch)

    @property
    def max_cc(self) -> int | None:
        return None if self.max_arch is None else parse_arch(self.max_arch)
