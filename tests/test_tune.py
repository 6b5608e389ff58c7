"""`python -m kdsl tune`: candidate spaces, scoring and winners, TOML write-back, the CLI.

CPU tests drive the search with stand-in problems and timers; the GPU test (marked `gpu`)
runs the real search on a tiny space and writes to a copy of the definitions.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shutil
import stat
import tomllib
from pathlib import Path

import pytest
import torch

from kdsl.bench.shapes import Case, preset_cases
from kdsl.cli import build_parser
from kdsl.codegen.render import tile_params
from kdsl.schema import DefinitionError, KernelDefinition, Tile, load_definitions
from kdsl.schema.arch import archs_in_range
from kdsl.kernels import BASE_KNOBS, find_impl
from kdsl.kernels.w4a16.gemv_mma_gluon import MMA_GEMV_MAX_M
from kdsl.tune import cli as tune_cli
from kdsl.tune import search, space, target, write
from kdsl.tune.search import Problem, Shape

TUNABLE = search.TUNABLE_OPS
MOE_OPS = ("moe_fp8", "moe_w4a16")


@pytest.fixture(scope="module")
def definitions(repo_root_module):
    return load_definitions(repo_root_module / "kernel_defs")


@pytest.fixture(scope="module")
def repo_root_module() -> Path:
    return Path(__file__).resolve().parents[1]


def tunable_variants(definitions):
    return [(d, v) for d in definitions for v in d.definition.variants if v.op in TUNABLE]


@pytest.fixture
def defs_copy(tmp_path, repo_root_module) -> Path:
    folder = tmp_path / "kernel_defs"
    shutil.copytree(repo_root_module / "kernel_defs", folder)
    return folder


def variant_of(folder: Path, op: str, impl: str, min_arch: str):
    for loaded in load_definitions(folder):
        for index, v in enumerate(loaded.definition.variants):
            if (v.op, v.impl, v.min_arch) == (op, impl, min_arch):
                return loaded, index, v
    raise AssertionError(f"no {op}/{impl} {min_arch} in {folder}")


# ---- the candidate space ----

def test_every_candidate_validates_honours_knobs_and_fits_shared_memory(definitions):
    seen_ops = set()
    for loaded, variant in tunable_variants(definitions):
        limit = min(f.max_shared_bytes for f in archs_in_range(variant.min_cc, variant.max_cc))
        raw = tomllib.loads(loaded.source_text)
        v_index = loaded.definition.variants.index(variant)
        for bucket in space.buckets(variant):
            impl = find_impl(variant.op, variant.impl_of(bucket.tile))  # candidates keep the tile's implementation
            tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=10_000)
            assert tiles[0] == bucket.tile and len(tiles) > 1, (variant.op, bucket.label())
            assert len({space.tile_key(t) for t in tiles}) == len(tiles)  # no duplicates
            # No two candidates launch alike (the same common fields and the same options, defaults filled).
            assert len({tuple(tile_params(t, impl).items()) for t in tiles}) == len(tiles)
            for tile in tiles:
                assert tile.m_max == bucket.m_max and tile.n_min == bucket.n_min
                assert tile.impl == bucket.tile.impl
                common = tile.model_fields_set - BASE_KNOBS - {"options", "impl"}
                assert common <= impl.tile_knobs, (variant.op, impl.impl, tile)
                # Options are the implementation's own, and validate against its Options model.
                assert set(tile.options) <= set(impl.options.model_fields), (variant.op, impl.impl, tile)
                options = impl.resolve(tile)
                for scheme in loaded.definition.schemes:
                    assert impl.shared_bytes(scheme, tile, options) <= limit
                assert tile.block_m >= impl.min_block_m or (impl.gemv_block_m and tile.block_m == 1)
            # The whole variant, with each candidate in the bucket's place, validates as a definition.
            for tile in tiles[1:]:
                # Candidates name only options that differ from the implementation's defaults.
                assert all(v != space.knob_default(impl, k) for k, v in tile.options.items()), tile
                # The variant alone: its dequant_min_m (which asks for a dequantizer variant beside it) is not a
                # tile property, so it is left out rather than the dequantizer brought along.
                alone = {key: value for key, value in raw["variants"][v_index].items()
                         if key not in ("dequant_min_m", "dequant_max_n")}
                doc = dict(raw, variants=[alone])
                doc["variants"][0]["tiles"] = [
                    dict(write.tile_fields(t)) for t in
                    [tile if b.index == bucket.index else b.tile for b in space.buckets(variant)]]
                KernelDefinition.model_validate(doc)
        seen_ops.add(variant.op)
    assert seen_ops == set(TUNABLE)


def test_knobs_an_impl_ignores_stay_unset(definitions):
    (loaded, portable), = [(d, v) for d, v in tunable_variants(definitions)
                           if (v.op, v.impl) == ("fp8_gemm", "portable")]
    impl = find_impl("fp8_gemm", "portable")
    for bucket in space.buckets(portable):
        for tile in space.candidates(portable, bucket, loaded.definition.schemes, max_candidates=10_000):
            assert "split_k" not in tile.model_fields_set and tile.split_k == 1
            assert not {"persistent", "warp_specialize", "swap_ab", "split_fill", "mma_gemv"} & set(tile.options)
            assert set(tile.options) <= {"tile_order"}
            # The launch carries the portable kernel's options only: no other implementation's knobs.
            params = tile_params(tile, impl)
            assert not {"persistent", "warp_specialize", "swap_ab"} & set(params) and "tile_order" in params
    # ...and a knob the impl honours is varied: the TMA kernel tries persistent grids for prefill.
    (loaded, tma), = [(d, v) for d, v in tunable_variants(definitions)
                      if (v.op, v.impl) == ("fp8_gemm", "tma_persistent")]
    tma_impl = find_impl("fp8_gemm", "tma_persistent")
    rest = space.buckets(tma)[-1]
    tiles = space.candidates(tma, rest, loaded.definition.schemes, 10_000)
    assert {space.knob_value(t, tma_impl, "persistent") for t in tiles} == {False, True}
    assert {t.options.get("persistent", False) for t in tiles} == {False, True}
    assert {tile_params(t, tma_impl)["persistent"] for t in tiles} == {False, True}


def test_gemv_candidates_only_where_a_gemv_serves_the_bucket(definitions):
    """A GEMV tile's candidates are GEMVs of its implementation (one row for the CUDA-core one, up to 8 for
    the mma.sync one); an MMA tile's are MMAs."""
    found = set()
    for loaded, variant in tunable_variants(definitions):
        for bucket in space.buckets(variant):
            impl = find_impl(variant.op, variant.impl_of(bucket.tile))
            tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=10_000)
            if impl.gemv_block_m and bucket.m_max is not None and bucket.m_max <= impl.gemv_max_m:
                assert all(t.block_m == 1 for t in tiles), (variant.op, bucket.label())
                found.add(impl.impl)
            else:
                assert all(t.block_m >= 16 for t in tiles), (variant.op, bucket.label())
    assert {"gemv", "gemv_mma_gluon"} <= found


def test_cap_keeps_the_current_tile_and_its_nearest_neighbours(definitions):
    (loaded, variant), = [(d, v) for d, v in tunable_variants(definitions)
                          if (v.op, v.impl) == ("fp8_gemm", "tma_persistent")]
    schemes = loaded.definition.schemes
    for bucket in space.buckets(variant):
        impl = find_impl(variant.op, variant.impl_of(bucket.tile))
        full = space.candidates(variant, bucket, schemes, max_candidates=10_000)
        capped = space.candidates(variant, bucket, schemes, max_candidates=5)
        assert capped == full[:5] and len(capped) == min(5, len(full)) and len(full) >= 4
        assert space.candidates(variant, bucket, schemes, max_candidates=1) == [bucket.tile]
        # Neighbours first: every tile in the cap changes no more knobs than any tile left out.
        changed = [space._distance(t, bucket.tile, impl)[0] for t in full]
        if len(full) > 5:
            assert max(changed[1:5]) <= min(changed[5:])
    assert len(space.candidates(variant, space.buckets(variant)[0], schemes)) == space.DEFAULT_MAX_CANDIDATES
    with pytest.raises(ValueError, match="at least 1"):
        space.candidates(variant, space.buckets(variant)[0], schemes, max_candidates=0)


def test_current_tile_outside_the_grid_is_still_candidate_zero(definitions):
    (loaded, variant), = [(d, v) for d, v in tunable_variants(definitions) if v.op == "gptq_gemm"]
    odd = Tile(m_max=16, block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2)
    bucket = space.Bucket(0, 0, 16, odd)
    tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=4)
    assert tiles[0] is odd and all(t.num_warps in (2, 4) for t in tiles)


@pytest.mark.parametrize("op,impl,knob", [("fp8_gemm", "tma_persistent", "swap_ab"),
                                           ("w4a16_gemm", "planes_mma", "split_min_steps")])
def test_an_option_written_at_its_default_adds_no_candidate(definitions, op, impl, knob):
    """`options = { swap_ab = false }` launches as the same tile without it: no second candidate times it."""
    unit = find_impl(op, impl)
    loaded, variant = next((d, v) for d, v in tunable_variants(definitions) if (v.op, v.impl) == (op, impl))
    last = space.buckets(variant)[-1]
    current = last.tile.model_copy(update={"options": {**last.tile.options, knob: space.knob_default(unit, knob)}})
    bucket = space.Bucket(last.index, last.lo, last.m_max, current, last.n_min, last.n_below)
    tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=10_000)
    assert tiles[0] is current and len(tiles) > 1
    launches = [tuple(tile_params(t, unit).items()) for t in tiles]
    assert len(set(launches)) == len(launches)


# ---- shapes of a bucket ----

def test_tiles_for_few_batches_are_tuned_on_those_batches_and_keep_batch_max(definitions):
    """fp8_bmm's batch_max tiles (16 heads) are timed on the preset's B <= 16 shapes and their candidates keep
    batch_max; the tile after one, which serves the larger batches, is timed on those."""
    (loaded, tma), = [(d, v) for d, v in tunable_variants(definitions) if (v.op, v.impl) == ("fp8_bmm", "tma_persistent")]
    cases = preset_cases("deepseek-v3")
    few = [b for b in space.buckets(tma) if b.batch_max is not None]
    assert few, "the shipped fp8_bmm tiles have batch_max tiles"
    for bucket in few:
        after = next(b for b in space.buckets(tma) if b.index == bucket.index + 1)
        assert after.batch_above == bucket.batch_max and "B <= 16" in bucket.label() and "B > 16" in after.label()
        assert {s.batch for s in search.shapes_for_bucket("fp8_bmm", cases, bucket)} == {16}
        assert {s.batch for s in search.shapes_for_bucket("fp8_bmm", cases, after)} == {128}
        tiles = space.candidates(tma, bucket, loaded.definition.schemes, max_candidates=20)
        assert len(tiles) > 1 and all(t.options.get("batch_max") == bucket.batch_max for t in tiles)
    # A bucket of batches no preset shape has: the bound itself.
    only_big = space.Bucket(0, 0, 16, Tile(m_max=16, options={"batch_max": 4}))
    assert {s.batch for s in search.shapes_for_bucket("fp8_bmm", cases, only_big)} == {4}


def test_shapes_come_from_the_preset_m_values_in_the_bucket():
    cases = preset_cases("deepseek-v3")
    fp8_pairs = {(c.n, c.k) for c in cases if c.op == "fp8_gemm"}
    decode = search.shapes_for_bucket("fp8_gemm", cases, space.Bucket(0, 0, 16, Tile(m_max=16)))
    assert {s.m for s in decode} == {1, 16} and {(s.n, s.k) for s in decode} == fp8_pairs
    assert len(decode) == 2 * len(fp8_pairs)
    assert {s.m for s in search.shapes_for_bucket("fp8_gemm", cases, space.Bucket(1, 16, 128, Tile(m_max=128)))} == {64, 128}
    assert {s.m for s in search.shapes_for_bucket("fp8_gemm", cases, space.Bucket(2, 128, None, Tile()))} == {512, 4096}
    gemv = search.shapes_for_bucket("w4a16_gemm", cases, space.Bucket(0, 0, 1, Tile(m_max=1)))
    gptq_pairs = {(c.n, c.k) for c in cases if c.op == "gptq_gemm"}
    assert {s.m for s in gemv} == {1} and {(s.n, s.k) for s in gemv} == gptq_pairs
    # No preset M inside: the bucket's m_max; the last bucket, twice the previous m_max.
    assert {s.m for s in search.shapes_for_bucket("gptq_gemm", cases, space.Bucket(1, 1, 8, Tile(m_max=8)))} == {8}
    assert {s.m for s in search.shapes_for_bucket("gptq_gemm", cases, space.Bucket(3, 8192, None, Tile()))} == {16384}


def test_moe_layers_are_tuned_per_bucket_of_tokens_per_expert(definitions):
    """The MoE layers' buckets count tokens per routed expert, ceil(T k / min(T k, E)): a bucket is tuned on the
    preset's layers at the token counts T that fall in it, or at the most T that give its m_max per expert."""
    assert set(MOE_OPS) <= set(TUNABLE)
    cases = preset_cases("qwen3-moe")  # moe_w4a16: E = 128, top-8, H = 2048, I = 768 at T = 1 ... 4096
    chosen = target.select_target("moe_w4a16", definitions, arch="sm_90")
    assert chosen.entry.name == "moe_w4a16__int4_g128__sorted_sm90"
    by_bucket = {b.name(): search.shapes_for_bucket("moe_w4a16", cases, b) for b in space.buckets(chosen.variant)}
    assert {name: [s.m for s in shapes] for name, shapes in by_bucket.items()} == {
        "8": [1, 16, 64, 128], "32": [512], "64": [1024], "rest": [4096]}
    for bucket in space.buckets(chosen.variant):
        for shape in by_bucket[bucket.name()]:
            assert (shape.experts, shape.topk, shape.k, shape.n) == (128, 8, 2048, 768)
            assert bucket.holds(shape.bucket_m)
            # The registry picks this bucket's tile for the shape, as the op would.
            assert chosen.entry.tile_for(shape.bucket_m, shape.n) == chosen.entry.tiles[bucket.index].params
    assert by_bucket["64"][0].label() == "E=128 TOPK=8 T=1024 H=2048 I=768"
    assert by_bucket["64"][0].bucket_m == 64 and Shape(64, 1, 1).bucket_m == 64
    # moe_fp8 on DeepSeek-V3 (E = 256, top-8, H = 7168; I = 2048 and the TP-8 slice 256): the layers tile by I, so
    # the decode tile from I = 1024 is tuned on I = 2048 and the one below it on I = 256; later buckets take both.
    fp8 = target.select_target("moe_fp8", definitions, arch="sm_90")
    fp8_buckets = space.buckets(fp8.variant)
    for bucket, inters in ((fp8_buckets[0], (2048,)), (fp8_buckets[1], (256,)), (fp8_buckets[2], (2048, 256))):
        shapes = search.shapes_for_bucket("moe_fp8", preset_cases("deepseek-v3"), bucket)
        assert {s.n for s in shapes} == set(inters), bucket.name()
        for shape in shapes:
            assert fp8.entry.tile_for(shape.bucket_m, shape.n) == fp8.entry.tiles[bucket.index].params
    decode = search.shapes_for_bucket("moe_fp8", preset_cases("deepseek-v3"), fp8_buckets[0])
    assert {(s.n, s.m) for s in decode} == {(2048, t) for t in (1, 16, 64, 128)}
    # A layer below that split alone (I = 128): the I >= 1024 decode tile is still tuned, on the layer at I = 1024
    # (`kdsl tune --bucket 4` raised on a bucket with no shape before).
    small = [Case("moe_fp8", m=4, experts=8, topk=2, hidden=256, inter=128)]
    assert [(s.n, s.k, s.m) for s in search.shapes_for_bucket("moe_fp8", small, fp8_buckets[0])] == [(1024, 256, 4)]
    assert [(s.n, s.k, s.m) for s in search.shapes_for_bucket("moe_fp8", small, fp8_buckets[1])] == [(128, 256, 4)]
    # Candidates vary moe_fp8's fused activation where the block allows it (fuse_act needs block_n = 128).
    rest = space.buckets(fp8.variant)[-1]
    tiles = space.candidates(fp8.variant, rest, fp8.loaded.definition.schemes, 10_000)
    impl = find_impl("moe_fp8", "sorted")
    assert {space.knob_value(t, impl, "fuse_act") for t in tiles} == {False, True}
    assert all(t.block_n == 128 for t in tiles if space.knob_value(t, impl, "fuse_act"))
    # At decode they also swap the MMA's sides, only where the GEMM is unfused (swap_ab needs fuse_act = false).
    decode_tiles = space.candidates(fp8.variant, fp8_buckets[0], fp8.loaded.definition.schemes, 10_000)
    swaps = {(space.knob_value(t, impl, "fuse_act"), space.knob_value(t, impl, "swap_ab")) for t in decode_tiles}
    assert swaps == {(False, False), (False, True), (True, False)}


def _variant_tiled_by_n():
    from kdsl.schema import Variant
    return Variant(op="w4a16_gemm", impl="planes_mma", min_arch="sm_90", max_arch="sm_90",
                   layout={"zeros": "paired", "weights": "k_planes"},
                   tiles=[Tile(m_max=16, block_m=16), Tile(n_min=8192, block_m=256, options={"split_fill": 1}), Tile(n_min=4096),
                          Tile()])


def test_buckets_of_a_variant_tiled_by_n():
    buckets = space.buckets(_variant_tiled_by_n())
    assert [(b.lo, b.m_max, b.n_min, b.n_below) for b in buckets] == [
        (0, 16, None, None), (16, None, 8192, None), (16, None, 4096, 8192), (16, None, None, 4096)]
    assert [b.label() for b in buckets[1:]] == ["M > 16, N >= 8192", "M > 16, N >= 4096, N < 8192", "M > 16, N < 4096"]


def test_candidates_keep_the_bucket_n_min():
    import kdsl
    variant = _variant_tiled_by_n()
    wide = space.buckets(variant)[1]
    tiles = space.candidates(variant, wide, [kdsl.schema.W4A16()], max_candidates=8)
    assert len(tiles) == 8 and all(t.n_min == 8192 and t.m_max is None for t in tiles)
    assert tiles[0].options["split_fill"] == 1  # the current tile's knobs stay among the values
    # split_fill is on no grid: every candidate keeps the current tile's value, as an option.
    assert all(t.options.get("split_fill") == 1 for t in tiles)


def test_shapes_of_a_bucket_tiled_by_n():
    cases = preset_cases("deepseek-v3")
    pairs = {(c.n, c.k) for c in cases if c.op == "gptq_gemm"}
    wide = search.shapes_for_bucket("w4a16_gemm", cases, space.Bucket(3, 64, None, Tile(n_min=8192), 8192))
    assert {(s.n, s.k) for s in wide} == {p for p in pairs if p[0] >= 8192} and {s.m for s in wide} == {256}
    narrow = search.shapes_for_bucket("w4a16_gemm", cases, space.Bucket(4, 64, None, Tile(), None, 8192))
    assert {(s.n, s.k) for s in narrow} == {p for p in pairs if p[0] < 8192} and narrow
    # No preset N in range: the preset's K at the range's edge.
    edge = search.shapes_for_bucket("w4a16_gemm", cases, space.Bucket(3, 64, None, Tile(n_min=65536), 65536))
    assert {s.n for s in edge} == {65536} and {s.k for s in edge} == {k for _, k in pairs}


# ---- search: checking, timing, scoring ----

T = [Tile(m_max=16, block_m=16, block_n=bn, num_warps=4) for bn in (64, 32, 128, 256, 16)]
SHAPES = [Shape(16, 256, 512), Shape(8, 512, 1024)]
BUCKET = space.Bucket(0, 0, 16, T[0])
IMPL = find_impl("gptq_gemm", "splitk")  # the implementation whose launch parameters the fake reads


class Fake:
    """Stand-in problems and timer: times[BLOCK_N] = (ms at shape 0, ms at shape 1)."""

    def __init__(self, times, wrong=(), raise_check=(), raise_time=()):
        self.times, self.wrong, self.raise_check, self.raise_time = times, wrong, raise_check, raise_time
        self.launched: list[tuple[int, int]] = []  # (BLOCK_N, M) per launch
        self.timed: list[int] = []  # M the timer was given
        self.checks = 0

    def factory(self, shape: Shape) -> Problem:
        index = SHAPES.index(shape)

        def launch(p):
            self.launched.append((p["BLOCK_N"], shape.m))

        def check(p):
            self.checks += 1
            if p["BLOCK_N"] in self.raise_check:
                raise RuntimeError("out of resource: shared memory, Required: 300000")
            launch(p)
            return (0.3, "rel err 0.3 > 0.02") if p["BLOCK_N"] in self.wrong else (1e-3, None)

        self._index, self._shape = index, shape
        return Problem(launch=launch, check=check)

    def timer(self, fn, m):
        self.timed.append(m)
        before = len(self.launched)
        fn()
        bn, launched_m = self.launched[before]
        assert launched_m == m
        if bn in self.raise_time and self._index in self.raise_time[bn]:
            raise RuntimeError("cuda graph capture failed")
        return self.times[bn][self._index]


def test_geometric_mean_scoring_picks_the_winner():
    fake = Fake({64: (2.0, 4.0),      # current
                 32: (1.0, 8.0),      # ratios 0.5, 2: geomean 1, a tie with the current tile
                 128: (1.0, 3.0),     # 0.5, 0.75: geomean 0.612
                 256: (0.2, 12.0),    # 0.1, 3: geomean 0.548 (the worst arithmetic mean, yet the winner)
                 16: (2.0, 4.0)})
    result = search.search_bucket(BUCKET, T, SHAPES, fake.factory, fake.timer, impl=IMPL)
    scores = {o.tile.block_n: o.score for o in result.outcomes}
    assert scores[64] == pytest.approx(1.0) and scores[32] == pytest.approx(1.0)
    assert scores[128] == pytest.approx(math.sqrt(0.375)) and scores[256] == pytest.approx(math.sqrt(0.3))
    assert result.winner.tile is T[3] and result.changed
    assert result.speedup == pytest.approx(1 / math.sqrt(0.3))
    assert result.current.times == {SHAPES[0]: 2.0, SHAPES[1]: 4.0}
    assert fake.timed == [16] * 5 + [8] * 5 and fake.checks == 10  # checked once per shape, then timed


def test_ties_keep_the_current_tile():
    fake = Fake({bn: (1.0, 2.0) for bn in (64, 32, 128, 256, 16)})
    result = search.search_bucket(BUCKET, T, SHAPES, fake.factory, fake.timer, impl=IMPL)
    assert result.winner is result.current and not result.changed and result.speedup == 1.0
    assert tune_cli.winners([BUCKET], [result]) == [T[0]]


def test_wrong_and_failing_candidates_are_dropped_and_reported():
    fake = Fake({64: (2.0, 2.0), 32: (0.1, 0.1), 128: (0.1, 0.1), 256: (0.1, 0.1), 16: (1.0, 1.0)},
                wrong=(32,), raise_check=(128,), raise_time={256: (1,)})
    lines: list[str] = []
    result = search.search_bucket(BUCKET, T, SHAPES, fake.factory, fake.timer, progress=lines.append,
                                  impl=IMPL)
    dropped = {o.tile.block_n: o.dropped for o in result.dropped}
    assert set(dropped) == {32, 128, 256}
    assert dropped[32] == "WRONG at M=16 N=256 K=512: rel err 0.3 > 0.02"
    assert dropped[128].startswith("ERROR at M=16 N=256 K=512: RuntimeError: out of resource")
    assert dropped[256] == "ERROR at M=8 N=512 K=1024: RuntimeError: cuda graph capture failed"
    assert all(o.score is None for o in result.dropped)
    assert result.winner.tile is T[4] and result.speedup == pytest.approx(2.0)
    # Dropped tiles are not run again on later shapes.
    assert (32, 8) not in fake.launched and (128, 8) not in fake.launched
    assert any("candidate 2/5" in line and "dropped (WRONG" in line for line in lines)
    assert any(line.startswith("bucket M <= 16 shape 2/2 M=8 N=512 K=1024 candidate 5/5") and line.endswith("1.0000 ms")
               for line in lines)
    from kdsl.tune.report import format_bucket
    table = format_bucket(result)
    assert "winner is 2.000x the current tile's speed" in table and "dropped 16x32x128 w4 s3: WRONG" in table


def test_a_failing_current_tile_still_ranks_the_others():
    fake = Fake({64: (1.0, 1.0), 32: (2.0, 4.0), 128: (1.0, 2.0), 256: (4.0, 4.0), 16: (1.0, 8.0)}, wrong=(64,))
    result = search.search_bucket(BUCKET, T, SHAPES, fake.factory, fake.timer, impl=IMPL)
    assert not result.current.ok and result.winner.tile is T[2] and result.speedup is None
    assert result.winner.score == pytest.approx(1.0)  # against the fastest survivor per shape
    assert tune_cli.winners([BUCKET], [result]) == [T[2]]


def test_bad_timer_values_drop_the_candidate():
    fake = Fake({64: (1.0, 1.0), 32: (float("nan"), 1.0), 128: (0.0, 1.0), 256: (1.0, 1.0), 16: (1.0, 1.0)})
    result = search.search_bucket(BUCKET, T, SHAPES, fake.factory, fake.timer, impl=IMPL)
    assert {o.tile.block_n for o in result.dropped} == {32, 128}


def test_launch_gets_the_tile_params_of_the_candidate():
    got = []

    def factory(shape):
        return Problem(launch=lambda p: got.append(p), check=lambda p: (0.0, None))

    search.search_bucket(BUCKET, T[:2], SHAPES[:1], factory, lambda fn, m: (fn(), 1.0)[1], impl=IMPL)
    assert got == [tile_params(T[0], IMPL), tile_params(T[1], IMPL)]
    # The implementation's options reach the launch, defaults filled; another implementation's stay out.
    got.clear()
    tma = find_impl("fp8_gemm", "tma_persistent")
    tiles = [T[0], T[1].model_copy(update={"options": {"persistent": True, "split_fill": 1}})]
    search.search_bucket(BUCKET, tiles, SHAPES[:1], factory, lambda fn, m: (fn(), 1.0)[1], impl=tma)
    assert got == [tile_params(tiles[0], tma), tile_params(tiles[1], tma)]
    assert (got[0]["persistent"], got[0]["split_fill"]) == (False, None)
    assert (got[1]["persistent"], got[1]["split_fill"], got[1]["BLOCK_N"]) == (True, 1, 32)
    assert got[1]["impl"] == "tma_persistent" and "tile_order" in got[1]


# ---- problems: the bench's inputs bound to the generated launch (Triton's interpreter) ----

@pytest.fixture
def interpreted(monkeypatch):
    """Run kdsl.tune.problems on the CPU: the generated kernels through Triton's interpreter."""
    from kdsl.bench import timing

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (the CPU test run)")
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


@pytest.mark.parametrize("op", TUNABLE)
def test_problems_launch_the_generated_kernel_and_check_it(interpreted, definitions, op):
    import types

    from kdsl.runtime import registry
    from kdsl.tune import problems

    chosen = target.select_target(op, definitions, arch=registry.INTERPRETER_ARCH)
    bucket = space.buckets(chosen.variant)[0]
    tiles = space.candidates(chosen.variant, bucket, chosen.loaded.definition.schemes, max_candidates=2)
    # The MoE layers: 4 tokens routed to 2 of 4 experts (2 tokens per routed expert, inside the first bucket).
    shape = Shape(4, 128, 256, experts=4, topk=2) if op in MOE_OPS else Shape(bucket.m_max, 64, 256)
    assert bucket.holds(shape.bucket_m)
    impl = find_impl(chosen.variant.op, chosen.variant.impl)
    result = search.search_bucket(bucket, tiles, [shape], problems.problem_factory(op, chosen.entry),
                                  timer=lambda fn, m: (fn(), 1.0)[1], impl=impl)
    assert [o.dropped for o in result.outcomes] == [None, None]
    assert all(o.errors[shape] < 2e-2 for o in result.outcomes)
    # A launch that writes nothing fails: the output is poisoned before the check.
    idle = types.SimpleNamespace(launch=lambda *args: None, layout=chosen.entry.layout, name="idle")
    err, why = problems.problem_factory(op, idle)(shape).check(tile_params(tiles[0], impl))
    assert math.isnan(err) and why == "rel err nan > 0.02"


def test_fp8_bmm_is_timed_by_graphs_at_every_m_and_writes_an_output_per_weight_copy(interpreted, definitions):
    """fp8_bmm is timed as kdsl bench times it: CUDA graphs at every M (its B = 16 calls are shorter than an eager
    launch), and each launch takes the next weight copy and writes its own output (a reused one stays in L2)."""
    from kdsl.runtime import registry
    from kdsl.tune import problems

    assert search.timer_for("fp8_bmm") is search.graph_timer
    assert all(search.timer_for(op) is search.default_timer for op in TUNABLE if op != "fp8_bmm")
    chosen = target.select_target("fp8_bmm", definitions, arch=registry.INTERPRETER_ARCH)
    seen = []

    class Spy:
        layout, name = chosen.entry.layout, chosen.entry.name

        def launch(self, a, a_s, b, b_s, c, params):
            seen.append((b.data_ptr(), c.data_ptr()))
            chosen.entry.launch(a, a_s, b, b_s, c, params)

    shape = Shape(4, 64, 256, batch=3)
    problem = problems.problem_factory("fp8_bmm", Spy())(shape)
    tile = tile_params(space.buckets(chosen.variant)[0].tile, find_impl("fp8_bmm", chosen.variant.impl))
    err, why = problem.check(tile)
    assert why is None and err < 2e-2
    for _ in range(3):
        problem.launch(tile)
    assert len({b for b, _ in seen}) == 4 and len({c for _, c in seen}) == 4
    assert shape.label() == "B=3 M=4 N=64 K=256"


@pytest.mark.parametrize("op,weight_arg,copies", [("fp8_gemm", 2, 3), ("gptq_gemm", 1, 6), ("w4a16_gemm", 2, 6)])
def test_gemm_problems_read_cold_weight_copies_up_to_cold_max_m(interpreted, definitions, monkeypatch, op,
                                                               weight_arg, copies):
    """Up to timing.COLD_MAX_M rows the GEMM problems take turns over copies of the weights (each launch its own
    weights and output), as kdsl bench's calls do, so decode tiles are picked on weights read from DRAM; above it
    one copy."""
    from kdsl.bench import timing
    from kdsl.runtime import registry
    from kdsl.tune import problems

    chosen = target.select_target(op, definitions, arch=registry.INTERPRETER_ARCH)
    seen = []

    class Spy:
        layout, name = chosen.entry.layout, chosen.entry.name

        def launch(self, *args):
            seen.append((args[weight_arg].data_ptr(), args[-2].data_ptr()))  # (weights, output)
            chosen.entry.launch(*args)

    monkeypatch.setattr(timing, "COLD_BYTES", 3 * 64 * 256)  # three 64 x 256 fp8 weights, six int4 ones
    bucket = space.buckets(chosen.variant)[0]
    tile = tile_params(bucket.tile, find_impl(op, chosen.variant.impl))
    shape = Shape(bucket.m_max, 64, 256)
    problem = problems.problem_factory(op, Spy())(shape)
    err, why = problem.check(tile)
    assert why is None and err < 2e-2
    for _ in range(copies):
        problem.launch(tile)
    assert len({w for w, _ in seen}) == copies and len({y for _, y in seen}) == copies
    seen.clear()
    monkeypatch.setattr(timing, "COLD_MAX_M", shape.m - 1)
    prefill = problems.problem_factory(op, Spy())(shape)
    prefill.launch(tile)
    prefill.launch(tile)
    assert len(set(seen)) == 1


@pytest.mark.parametrize("op", MOE_OPS)
def test_moe_problems_read_cold_layer_copies_at_decode(interpreted, definitions, op):
    """At decode the MoE problems take turns over copies of the layer (each launch its own weights and output), as
    kdsl bench's calls do, so a graph of launches reads the routed experts from DRAM; prefill keeps one."""
    from kdsl.runtime import registry
    from kdsl.tune import problems

    chosen = target.select_target(op, definitions, arch=registry.INTERPRETER_ARCH)
    seen = []

    class Spy:
        layout, name = chosen.entry.layout, chosen.entry.name

        def launch(self, x, w13, *args):
            y = args[-3]
            seen.append((w13.data_ptr(), y.data_ptr()))
            chosen.entry.launch(x, w13, *args)

    tile = tile_params(space.buckets(chosen.variant)[0].tile, find_impl(op, "sorted"))
    problem = problems.problem_factory(op, Spy())(Shape(4, 128, 256, experts=4, topk=2))
    err, why = problem.check(tile)
    assert why is None and err < 2e-2
    for _ in range(2):
        problem.launch(tile)
    assert len({w for w, _ in seen}) == 3 and len({y for _, y in seen}) == 3
    seen.clear()
    prefill = problems.problem_factory(op, Spy())(Shape(129, 128, 256, experts=4, topk=2))
    prefill.launch(tile)
    prefill.launch(tile)
    assert len(set(seen)) == 1


# ---- write-back ----

def _variant_line_range(text: str, index: int) -> tuple[int, int]:
    """Lines [start, end) from the index-th [[variants]] header to the next [[...]] top-level header."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("[[variants]]")]
    start = starts[index]
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].lstrip().startswith("[[") and not lines[i].lstrip().startswith("[[variants.")), len(lines))
    return start, end


def _changed_lines_within(old: str, new: str, lo: int, hi: int) -> None:
    """Every difference between old and new falls within old's lines [lo, hi)."""
    ops = difflib.SequenceMatcher(a=old.splitlines(keepends=True), b=new.splitlines(keepends=True),
                                  autojunk=False).get_opcodes()
    diffs = [(i1, i2) for tag, i1, i2, _, _ in ops if tag != "equal"]
    assert diffs, "nothing changed"
    for i1, i2 in diffs:
        assert lo <= i1 and i2 <= hi, (i1, i2, lo, hi)


NOTE = write.note("NVIDIA H200", "2025-01-01")


@pytest.mark.parametrize("op,impl,min_arch", [
    ("fp8_gemm", "tma_persistent", "sm_90"), ("fp8_gemm", "portable", "sm_89"), ("gptq_gemm", "splitk", "sm_80"),
    ("w4a16_gemm", "planes_mma", "sm_90"), ("w4a16_gemm", "mma", "sm_80"), ("moe_fp8", "sorted", "sm_90"),
    ("moe_w4a16", "sorted", "sm_80")])
def test_write_back_changes_only_the_variants_tiles(defs_copy, op, impl, min_arch):
    loaded, index, variant = variant_of(defs_copy, op, impl, min_arch)
    path = loaded.path
    old = path.read_bytes().decode()
    bucket = space.buckets(variant)[1]
    new_tile = space.candidates(variant, bucket, loaded.definition.schemes, 10_000)[-1]
    tiles = [new_tile if b.index == bucket.index else b.tile for b in space.buckets(variant)]

    result = write.write_tiles(path, op, impl, min_arch, tiles, NOTE)
    assert result.changed
    new = path.read_bytes().decode()
    lo, hi = _variant_line_range(old, index)
    _changed_lines_within(old, new, lo, hi)
    assert new.count(NOTE) == 1 and NOTE in result.block
    # Every other variant and scheme parses to the same values; the file loads with the new tiles.
    before, after = tomllib.loads(old), tomllib.loads(new)
    assert after["schemes"] == before["schemes"] and after.get("description") == before.get("description")
    for j, (b, a) in enumerate(zip(before["variants"], after["variants"])):
        if j != index:
            assert a == b
        else:
            assert {k: v for k, v in a.items() if k != "tiles"} == {k: v for k, v in b.items() if k != "tiles"}
    reloaded = {d.path.name: d for d in load_definitions(defs_copy)}[path.name]
    assert list(reloaded.definition.variants[index].tiles) == tiles
    # Untouched buckets keep their text, header comments included.
    for b in space.buckets(variant):
        if b.index != bucket.index:
            assert space.tile_key(reloaded.definition.variants[index].tiles[b.index]) == space.tile_key(b.tile)
    written_fields = tomllib.loads(new)["variants"][index]["tiles"][bucket.index]
    assert list(written_fields) == [k for k in space.TILE_FIELDS if k in written_fields]  # fixed key order
    assert written_fields == dict(write.tile_fields(new_tile))  # only non-default fields

    # A second write of the same tiles is a no-op (another day, another GPU name: still nothing).
    stamp = path.stat().st_mtime_ns
    again = write.write_tiles(path, op, impl, min_arch, tiles, write.note("other", "2030-01-01"))
    assert not again.changed and path.read_bytes().decode() == new and path.stat().st_mtime_ns == stamp


COMMENTED = """\
# A file of its own, so the comments below are known.
[[schemes]]
kind = "block_fp8"

[[variants]]
op = "fp8_gemm"
impl = "portable"
min_arch = "sm_89"

# about the tiles
[[variants.tiles]]  # decode
m_max = 16
block_m = 16
block_n = 64   # narrow N: many programs
num_stages = 4

# prefill, introduced by a comment line
[[variants.tiles]]  # prefill
block_m = 128
num_warps = 8  # two warpgroups

# the next variant's introduction
[[variants]]
op = "weight_dequant"
impl = "blockwise"
min_arch = "sm_89"
tiles = [{ num_warps = 8 }]
"""


def test_write_back_keeps_comments_and_replaces_its_own_note(tmp_path):
    path = tmp_path / "fp8.toml"
    path.write_text(COMMENTED)
    decode = Tile(m_max=16, block_m=16, block_n=64, num_stages=5)
    prefill = Tile(block_m=128, num_warps=8)
    write.write_tiles(path, "fp8_gemm", "portable", "sm_89", [decode, prefill], NOTE)
    # The changed tile keeps its header comment and the comment of the line whose value stayed;
    # the unchanged tile and every comment around the tables stay byte for byte.
    assert path.read_text() == COMMENTED.replace(
        "# about the tiles\n", f"# about the tiles\n{NOTE}\n").replace(
        "num_stages = 4\n", "num_stages = 5\n")
    # Tuning again replaces the note instead of stacking a second one; a changed value drops its comment.
    second = write.note("NVIDIA H100", "2025-02-02")
    write.write_tiles(path, "fp8_gemm", "portable", "sm_89", [decode.model_copy(update={"block_n": 32}), prefill],
                      second)
    text = path.read_text()
    assert NOTE not in text and text.count(write.NOTE_PREFIX) == 1
    assert f"# about the tiles\n{second}\n[[variants.tiles]]  # decode\nm_max = 16\nblock_m = 16\nblock_n = 32\n" \
           "num_stages = 5\n\n# prefill, introduced by a comment line\n" in text
    assert text.endswith(COMMENTED[COMMENTED.index("# prefill, introduced"):])


WITH_OPTIONS = """\
[[schemes]]
kind = "block_fp8"

[[variants]]
op = "fp8_gemm"
impl = "tma_persistent"
min_arch = "sm_90"
max_arch = "sm_90"

[[variants.tiles]]  # decode
m_max = 16
block_m = 16
block_n = 64
split_k = 8
options = { swap_ab = true }  # wide N on the MMA's M side

[[variants.tiles]]  # prefill
block_m = 128
num_warps = 8

[[variants]]
op = "fp8_gemm"
impl = "portable"
min_arch = "sm_89"
tiles = [{ m_max = 16, block_m = 16, options = { tile_order = "n_major" } }, { block_m = 128 }]
"""


def test_write_back_writes_options_as_one_inline_table(tmp_path):
    """An implementation's knobs go back as one `options = { ... }` line, after the common fields."""
    path = tmp_path / "fp8.toml"
    path.write_text(WITH_OPTIONS)
    decode = Tile(m_max=16, block_m=16, block_n=64, split_k=8, num_stages=4, options={"swap_ab": True})
    prefill = Tile(block_m=128, num_warps=8, options={"persistent": True, "split_fill": 1})
    write.write_tiles(path, "fp8_gemm", "tma_persistent", "sm_90", [decode, prefill], NOTE)
    # The unchanged options line keeps its comment; the new one comes last, in the tile's order.
    assert path.read_text() == WITH_OPTIONS.replace(
        "[[variants.tiles]]  # decode\n", f"{NOTE}\n[[variants.tiles]]  # decode\n").replace(
        "split_k = 8\noptions = { swap_ab = true }  # wide N on the MMA's M side\n",
        "split_k = 8\nnum_stages = 4\noptions = { swap_ab = true }  # wide N on the MMA's M side\n").replace(
        "num_warps = 8\n", "num_warps = 8\noptions = { persistent = true, split_fill = 1 }\n", 1)
    (loaded,) = load_definitions(tmp_path)
    assert list(loaded.definition.variants[0].tiles) == [decode, prefill]
    # A changed options value is written anew and drops its comment; options back at their defaults go.
    swapped = decode.model_copy(update={"options": {"swap_ab": True, "tile_order": "n_major"}})
    cleared = prefill.model_copy(update={"options": {}})
    write.write_tiles(path, "fp8_gemm", "tma_persistent", "sm_90", [swapped, cleared], NOTE)
    text = path.read_text()
    assert "split_k = 8\nnum_stages = 4\noptions = { swap_ab = true, tile_order = \"n_major\" }\n\n" in text
    assert "wide N on the MMA's M side" not in text
    assert "[[variants.tiles]]  # prefill\nblock_m = 128\nnum_warps = 8\n\n" in text and "persistent = true" not in text
    # Inline tiles: options as a nested inline table, after the common fields.
    tiles = [Tile(m_max=16, block_m=16, block_n=32, options={"tile_order": "n_major"}), Tile(block_m=128)]
    write.write_tiles(path, "fp8_gemm", "portable", "sm_89", tiles, NOTE)
    text = path.read_text()
    assert ('tiles = [\n    { m_max = 16, block_m = 16, block_n = 32, options = { tile_order = "n_major" } },\n'
            "    { block_m = 128 },\n]\n") in text
    (loaded,) = load_definitions(tmp_path)
    assert list(loaded.definition.variants[1].tiles) == tiles
    assert list(loaded.definition.variants[0].tiles) == [swapped, Tile(block_m=128, num_warps=8)]


def test_invalid_winner_writes_nothing_and_names_the_file(defs_copy, repo_root):
    loaded, index, variant = variant_of(defs_copy, "gptq_gemm", "splitk", "sm_80")
    path = loaded.path
    before = path.read_bytes()
    bad = [
        variant.tiles[0].model_copy(update={"block_m": 8}),  # below one MMA
        Tile(m_max=16, block_m=16, options={"persistent": True}),  # a knob gptq_gemm does not implement
        Tile(m_max=16, block_m=128, block_n=256, block_k=256, num_stages=8),  # over 99 KB of sm_86
    ]
    for tile in bad:
        with pytest.raises(DefinitionError) as info:
            write.write_tiles(path, "gptq_gemm", "splitk", "sm_80", [tile, *variant.tiles[1:]], NOTE)
        assert str(path) in str(info.value) and "nothing written" in str(info.value)
        assert path.read_bytes() == before
    shipped = sorted(p.name for p in (repo_root / "kernel_defs").glob("*.toml"))
    assert sorted(p.name for p in defs_copy.iterdir()) == shipped  # no temp files
    with pytest.raises(DefinitionError, match="0 variants with op 'gptq_gemm', impl 'splitk', min_arch 'sm_90'"):
        write.write_tiles(path, "gptq_gemm", "splitk", "sm_90", list(variant.tiles), NOTE)
    with pytest.raises(DefinitionError, match=f"has {len(variant.tiles)} M buckets, got 1 tiles"):
        write.write_tiles(path, "gptq_gemm", "splitk", "sm_80", [variant.tiles[-1]], NOTE)


def test_inline_tiles_are_rewritten_in_place(defs_copy):
    loaded, index, variant = variant_of(defs_copy, "act_quant", "rowwise", "sm_89")
    path = loaded.path
    old = path.read_text()
    lo, hi = _variant_line_range(old, index)
    lines = old.splitlines(keepends=True)[lo:hi]
    first = [i for i, x in enumerate(lines) if x.startswith("tiles = [{")]
    assert len(first) == 1, "kernel_defs' act_quant variant is the inline `tiles = [{...}, ...]` case"
    last = next(i for i in range(first[0], len(lines)) if "}]" in lines[i])
    array_text = "".join(lines[first[0]:last + 1])
    tiles = [Tile(m_max=t.m_max, block_m=t.block_m, num_warps=2 * t.num_warps) for t in variant.tiles]
    write.write_tiles(path, "act_quant", "rowwise", "sm_89", tiles, NOTE)
    new = path.read_text()
    rest = lines[last][lines[last].index("}]") + 2:]  # the array's trailing comment and newline
    array = "[\n" + "".join(f"    {write.inline_table(tile)},\n" for tile in tiles) + "]"
    assert new == old.replace(array_text, f"{NOTE}\ntiles = {array}{rest}", 1)
    _changed_lines_within(old, new, lo, hi)
    reloaded = {d.path.name: d for d in load_definitions(defs_copy)}[path.name]
    assert list(reloaded.definition.variants[index].tiles) == tiles


MULTILINE = '''\
description = "inline tiles over several lines"  # [[variants]] in a comment is not a table

[[schemes]]
kind = "block_fp8"

[[variants]]
op = "fp8_gemm"
impl = "portable"
min_arch = "sm_89"
tiles = [
    { m_max = 16, block_m = 16, block_n = 64 },  # decode
    { block_m = 128, num_warps = 8 },
]  # two buckets

[[variants]]
op = "weight_quant"
impl = "blockwise"
min_arch = "sm_89"
tiles = [{ num_warps = 8 }]
'''


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_multiline_inline_tiles_and_crlf(tmp_path, newline):
    path = tmp_path / "fp8.toml"
    path.write_bytes(MULTILINE.replace("\n", newline).encode())
    os.chmod(path, 0o640)
    tiles = [Tile(m_max=16, block_m=16, block_n=32, num_stages=4), Tile(block_m=128, num_warps=8)]
    result = write.write_tiles(path, "fp8_gemm", "portable", "sm_89", tiles, NOTE)
    raw = path.read_bytes().decode()
    assert result.changed and stat.S_IMODE(path.stat().st_mode) == 0o640
    expected = MULTILINE.replace(
        "tiles = [\n    { m_max = 16, block_m = 16, block_n = 64 },  # decode\n    { block_m = 128, num_warps = 8 },\n]",
        f"{NOTE}\ntiles = [\n    {{ m_max = 16, block_m = 16, block_n = 32, num_stages = 4 }},\n"
        "    { block_m = 128, num_warps = 8 },\n]")
    assert raw == expected.replace("\n", newline)
    (loaded,) = load_definitions(tmp_path)
    assert list(loaded.definition.variants[0].tiles) == tiles


# ---- target: the registry's pick and its variant ----

@pytest.mark.parametrize("op,arch,impl,min_arch,file", [
    ("fp8_gemm", "sm_90", "tma_persistent", "sm_90", "block_fp8.toml"),
    ("fp8_gemm", "sm_89", "portable", "sm_89", "block_fp8.toml"),
    ("gptq_gemm", "sm_90", "splitk", "sm_80", "gptq_int4.toml"),
    ("w4a16_gemm", "sm_90", "planes_mma", "sm_90", "w4a16.toml"),
    ("w4a16_gemm", "sm_80", "mma", "sm_80", "w4a16.toml"),
])
def test_target_is_the_registrys_pick_and_its_variant(definitions, op, arch, impl, min_arch, file):
    chosen = target.select_target(op, definitions, arch=arch)
    assert chosen.loaded.path.name == file and (chosen.variant.op, chosen.variant.impl) == (op, impl)
    assert chosen.variant.min_arch == min_arch and chosen.entry.impl == impl


def test_stale_tiles_compares_generated_with_the_definition(definitions):
    import dataclasses

    from kdsl.runtime.manifest import TileBucket

    chosen = target.select_target("gptq_gemm", definitions, arch="sm_80")
    impl = find_impl(chosen.variant.op, chosen.variant.impl)
    tiles = chosen.variant.tiles
    fresh = dataclasses.replace(chosen.entry,
                                tiles=tuple(TileBucket(t.m_max, t.n_min, tile_params(t, impl)) for t in tiles))
    assert not target.stale_tiles(target.Target(fresh, chosen.loaded, chosen.variant_index))
    other = tiles[0].model_copy(update={"num_stages": tiles[0].num_stages + 1})
    old = dataclasses.replace(chosen.entry, tiles=(TileBucket(other.m_max, other.n_min, tile_params(other, impl)),
                                                  *fresh.tiles[1:]))
    assert target.stale_tiles(target.Target(old, chosen.loaded, chosen.variant_index))


def test_target_missing_from_the_definitions_is_a_clear_error(definitions):
    with pytest.raises(target.TargetError, match="no variant op 'fp8_gemm' impl 'tma_persistent' on sm_100"):
        target.find_variant(definitions, "fp8_gemm", "tma_persistent", "block_fp8.e4m3.w128x128.a128.f32", 100, None)


# ---- the command ----

def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["tune", *argv])


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--op", "--defs", "--shapes", "--bucket", "--max-candidates", "--write"):
        assert option in out
    assert "usage: python -m kdsl tune" in out and "w4a16_gemm" in out
    main_help = build_parser().format_help()
    assert "tune" in main_help and "search tiles on a CUDA GPU" in main_help


def test_argument_errors_exit_2(capsys, tmp_path):
    for argv in (["--op", "act_quant"], ["--op", "fp8_gemm", "--max-candidates", "0"], []):
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2
    assert tune_cli.run(parse("--op", "fp8_gemm", "--shapes", str(tmp_path / "missing.json"))) == 2
    assert "not a preset" in capsys.readouterr().err
    only_gptq = tmp_path / "gptq.json"
    only_gptq.write_text(json.dumps({"gptq_gemm": [{"m": 1, "n": 256, "k": 512}]}))
    assert tune_cli.run(parse("--op", "fp8_gemm", "--shapes", str(only_gptq))) == 2
    assert "has no fp8_gemm shapes" in capsys.readouterr().err
    assert tune_cli.run(parse("--op", "fp8_gemm", "--defs", str(tmp_path))) == 2
    assert "holds no *.toml definition" in capsys.readouterr().err


def test_outside_a_checkout_the_missing_default_definitions_name_defs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./kernel_defs here, as after `pip install kdsl`
    assert tune_cli.run(parse("--op", "fp8_gemm")) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdsl tune: error: --defs kernel_defs: is not a folder of kernel definitions")
    assert "pass --defs DIR" in err


def test_without_cuda_exits_2_with_a_clear_message(monkeypatch, capsys, defs_copy):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune_cli.run(parse("--op", "w4a16_gemm", "--defs", str(defs_copy), "--write")) == 2
    err = capsys.readouterr().err
    assert "kdsl tune: error: needs a CUDA GPU, but torch.cuda.is_available() is False" in err
    assert not list(defs_copy.glob(".*"))


class StandIn:
    """What the command runs on CPU: `wrong(params)` fails the check, `fast(params)` halves the time."""

    def __init__(self):
        self.launched: list[dict] = []
        self.wrong = lambda params: False
        self.fast = lambda params: False


@pytest.fixture
def cpu_tune(monkeypatch) -> StandIn:
    """Run the command on CPU: arch forced to sm_90, stand-in problems and timer."""
    from kdsl.tune import problems

    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    stand_in = StandIn()

    def factory(op, entry):
        def make(shape):
            return Problem(launch=stand_in.launched.append,
                           check=lambda p: (0.0, "rel err 1 > 0.02") if stand_in.wrong(p) else (0.0, None))
        return make

    def timer(fn, m):
        fn()
        return 0.5 if stand_in.fast(stand_in.launched[-1]) else 1.0

    monkeypatch.setattr(problems, "problem_factory", factory)
    monkeypatch.setattr(search, "default_timer", timer)
    return stand_in


def test_command_end_to_end_on_cpu_stand_ins(cpu_tune, defs_copy, capsys):
    loaded, index, variant = variant_of(defs_copy, "fp8_gemm", "tma_persistent", "sm_90")
    all_buckets = space.buckets(variant)
    bucket = all_buckets[0]
    tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=6)
    shapes = search.shapes_for_bucket("fp8_gemm", preset_cases("deepseek-v3"), bucket)
    impl = find_impl("fp8_gemm", "tma_persistent")
    wrong, fast = tiles[1], tiles[4]
    cpu_tune.wrong = lambda p: p == tile_params(wrong, impl)
    cpu_tune.fast = lambda p: p == tile_params(fast, impl)
    path = loaded.path
    old = path.read_text()

    args = ("--op", "fp8_gemm", "--defs", str(defs_copy), "--bucket", bucket.name(), "--max-candidates", "6")
    assert tune_cli.run(parse(*args)) == 0
    captured = capsys.readouterr()
    assert path.read_text() == old  # without --write nothing is written
    assert f"kdsl tune: bucket {bucket.label()}: 6 candidates on {len(shapes)} shapes" in captured.err
    assert f"shape {len(shapes)}/{len(shapes)} {shapes[-1].label()} candidate 6/6" in captured.err
    assert f"-- bucket {bucket.label()}" in captured.out
    assert not any(f"-- bucket {b.label()}" in captured.out for b in all_buckets[1:])
    assert "winner is 2.000x the current tile's speed" in captured.out
    assert f"dropped {search.compact(wrong)}: WRONG at {shapes[0].label()}: rel err 1 > 0.02" in captured.out
    assert "would read (run again with --write to write it)" in captured.out
    assert "# tiles from `python -m kdsl tune` on Stand-in GPU, " in captured.out

    assert tune_cli.run(parse(*args, "--write")) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}; run `python -m kdsl generate` and review the diff" in out
    written = variant_of(defs_copy, "fp8_gemm", "tma_persistent", "sm_90")[2].tiles
    assert list(written) == [fast, *variant.tiles[1:]]
    # Tuning again finds the same winner: nothing to write.
    cpu_tune.wrong = lambda p: False
    assert tune_cli.run(parse(*args, "--write")) == 0
    assert "already holds these tiles; nothing to write" in capsys.readouterr().out


def test_command_tunes_each_tile_of_a_bucket_tiled_by_n(cpu_tune, defs_copy, capsys):
    """--bucket rest names every tile of the last M bucket; each is timed on the preset's shapes in
    its own N range and written back with its n_min."""
    loaded, _, variant = variant_of(defs_copy, "w4a16_gemm", "planes_mma", "sm_90")
    rest = [b for b in space.buckets(variant) if b.name() == "rest"]
    # Each N range has the Gluon tile and its alternative, the Triton MMA with the same blocks.
    assert [(b.n_min, b.tile.impl) for b in rest] == [(8192, "overlap_gluon"), (8192, None), (None, "overlap_gluon"),
                                                       (None, None)]
    wide, narrow = rest[0], rest[-1]
    fast = space.candidates(variant, wide, loaded.definition.schemes, max_candidates=3)[2]
    impl = find_impl("w4a16_gemm", "overlap_gluon")
    cpu_tune.fast = lambda p: p == tile_params(fast, impl)
    args = ("--op", "w4a16_gemm", "--defs", str(defs_copy), "--bucket", "rest", "--max-candidates", "3")
    assert tune_cli.run(parse(*args, "--write")) == 0
    err = capsys.readouterr().err
    for bucket in rest:
        shapes = search.shapes_for_bucket("w4a16_gemm", preset_cases("deepseek-v3"), bucket)
        assert shapes and all(bucket.holds_n(s.n) for s in shapes)
        assert f"kdsl tune: bucket {bucket.label()}: 3 candidates on {len(shapes)} shapes" in err
    written = variant_of(defs_copy, "w4a16_gemm", "planes_mma", "sm_90")[2].tiles
    assert written[wide.index] == fast and fast.n_min == wide.n_min
    assert written[narrow.index].n_min is None
    assert list(written[:wide.index]) == list(variant.tiles[:wide.index])


@pytest.mark.parametrize("op, file", [("moe_w4a16", "moe_w4a16.toml"), ("moe_fp8", "moe_fp8.toml")])
def test_command_tunes_a_moe_bucket_and_writes_it_back(cpu_tune, defs_copy, capsys, op, file):
    """`kdsl tune --op moe_w4a16 --shapes qwen3-moe --bucket 32 --write` on stand-ins: the bucket's candidates run
    on the preset's layer at T = 512 (32 tokens per routed expert) and the faster one replaces the bucket's tile in
    its definition, every other variant of the file (moe_fp8.toml: the grouped GEMMs') untouched."""
    loaded, index, variant = variant_of(defs_copy, op, "sorted", "sm_90")
    assert loaded.path.name == file
    bucket = next(b for b in space.buckets(variant) if b.m_max == 32 and b.holds_n(768))  # Qwen3's I
    fast = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=4)[3]
    cpu_tune.fast = lambda p: p == tile_params(fast, find_impl(op, "sorted"))
    old = loaded.path.read_text()
    args = ("--op", op, "--defs", str(defs_copy), "--shapes", "qwen3-moe", "--bucket", "32", "--max-candidates", "4")
    assert tune_cli.run(parse(*args, "--write")) == 0
    captured = capsys.readouterr()
    shapes = search.shapes_for_bucket(op, preset_cases("qwen3-moe"), bucket)
    assert f"kdsl tune: bucket {bucket.label()}: 4 candidates on {len(shapes)} shapes" in captured.err
    assert f"shape 1/{len(shapes)} E=128 TOPK=8 T={shapes[0].m} H=2048 I=768 candidate 4/4" in captured.err
    assert "winner is 2.000x the current tile's speed" in captured.out
    written = variant_of(defs_copy, op, "sorted", "sm_90")[2].tiles
    assert written[bucket.index] == fast
    assert [t for i, t in enumerate(written) if i != bucket.index] == \
        [t for i, t in enumerate(variant.tiles) if i != bucket.index]
    before, after = tomllib.loads(old), tomllib.loads(loaded.path.read_text())
    assert [v for j, v in enumerate(after["variants"]) if j != index] == \
        [v for j, v in enumerate(before["variants"]) if j != index]


def test_command_refuses_unknown_buckets(cpu_tune, defs_copy, capsys):
    variant = variant_of(defs_copy, "w4a16_gemm", "planes_mma", "sm_90")[2]
    names = ", ".join(dict.fromkeys(b.name() for b in space.buckets(variant)))  # one name per M bucket
    assert names.endswith("64, 128, rest")
    assert tune_cli.run(parse("--op", "w4a16_gemm", "--defs", str(defs_copy), "--bucket", "0")) == 2
    assert f"--bucket 0: the variant's buckets are {names}" in capsys.readouterr().err


def test_command_exits_1_when_the_current_tile_is_wrong(cpu_tune, defs_copy, capsys):
    loaded, index, variant = variant_of(defs_copy, "gptq_gemm", "splitk", "sm_80")
    bucket = space.buckets(variant)[1]
    tiles = space.candidates(variant, bucket, loaded.definition.schemes, max_candidates=3)
    shape = search.shapes_for_bucket("gptq_gemm", preset_cases("deepseek-v3"), bucket)[0]
    args = ("--op", "gptq_gemm", "--defs", str(defs_copy), "--bucket", bucket.name(), "--max-candidates", "3")

    cpu_tune.wrong = lambda p: True
    assert tune_cli.run(parse(*args)) == 1
    out = capsys.readouterr().out
    assert "no candidate ran correctly: the bucket keeps its tile" in out and "nothing to write" in out

    cpu_tune.wrong = lambda p: p == tile_params(bucket.tile, find_impl("gptq_gemm", "splitk"))
    assert tune_cli.run(parse(*args, "--write")) == 1
    out = capsys.readouterr().out
    assert f"the current tile failed (WRONG at {shape.label()}: rel err 1 > 0.02); the winner replaces it" in out
    assert "wrote" in out
    assert variant_of(defs_copy, "gptq_gemm", "splitk", "sm_80")[2].tiles[bucket.index] == tiles[1]  # first of equals


# ---- on a GPU ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["fp8_gemm", "w4a16_gemm"])
def test_real_search_on_a_tiny_space_writes_a_valid_definition(op, defs_copy, tmp_path, capsys):
    chosen = target.select_target(op, load_definitions(defs_copy))
    first = space.buckets(chosen.variant)[0]
    m = first.m_max
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({search.SHAPE_OPS[op]: [{"m": [m], "n": 256, "k": 512}]}))
    tiles = space.candidates(chosen.variant, first, chosen.loaded.definition.schemes, max_candidates=2)
    assert len(tiles) == 2

    status = tune_cli.run(parse("--op", op, "--defs", str(defs_copy), "--shapes", str(shapes),
                                "--bucket", str(m), "--max-candidates", "2", "--write"))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    tuned = [b for b in space.buckets(chosen.variant) if b.m_max == m]  # every tile of the M bucket
    for bucket in tuned:
        assert f"-- bucket {bucket.label()}: 2 candidates on 1 shapes" in captured.out
    assert "0 dropped" in captured.out, captured.out
    assert f"shape 1/1 M={m} N=256 K=512 candidate 2/2" in captured.err
    reloaded = target.select_target(op, load_definitions(defs_copy))  # the written file validates
    assert reloaded.variant.tiles[0] in tiles
    assert list(reloaded.variant.tiles[len(tuned):]) == list(chosen.variant.tiles[len(tuned):])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", MOE_OPS)
def test_real_moe_search_on_a_tiny_layer_writes_a_valid_definition(op, defs_copy, tmp_path, capsys):
    """A MoE layer's first bucket on a small layer (E = 8, top-2, H = 256, I = 128, T = 4: one token per routed
    expert at most 8 routed experts): both candidates check against the fp32 reference and the file stays valid."""
    chosen = target.select_target(op, load_definitions(defs_copy))
    first = space.buckets(chosen.variant)[0]
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({op: [{"experts": 8, "topk": 2, "m": [4], "hidden": 256, "inter": 128}]}))
    status = tune_cli.run(parse("--op", op, "--defs", str(defs_copy), "--shapes", str(shapes),
                                "--bucket", str(first.m_max), "--max-candidates", "2", "--write"))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "0 dropped" in captured.out, captured.out
    assert "shape 1/1 E=8 TOPK=2 T=4 H=256 I=128 candidate 2/2" in captured.err
    reloaded = target.select_target(op, load_definitions(defs_copy))
    assert reloaded.variant.tiles[0] in space.candidates(chosen.variant, first, chosen.loaded.definition.schemes, 2)


def test_every_implementations_tune_grid_names_kinds_of_bucket_and_options_of_its_own():
    """An implementation's tune_grid (kdsl.kernels.base.KernelImpl) gives values for its own options only, per kind
    of bucket that kdsl.tune.space knows, and every value validates as that option."""
    from kdsl.kernels import CATALOGUE
    from kdsl.tune.space import GRIDS

    declared = 0
    for impl in CATALOGUE:
        for kind, knobs in impl.tune_grid.items():
            assert kind in GRIDS, f"{impl.op}/{impl.impl}: tune_grid kind {kind!r}"
            for knob, values in knobs.items():
                assert knob in impl.options.model_fields, f"{impl.op}/{impl.impl}: {knob!r} is not one of its options"
                for value in values:
                    impl.options.model_validate({knob: value})
                declared += 1
    assert declared >= 10  # fp8_bmm's, fp8_gemm's and moe_fp8's sweeps are declared
