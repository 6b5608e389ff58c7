"""kdsl.ops.gptq_prepare and gptq_gemm(x, prepared): the prepared layout read back, and the
prepared kernel (Triton's interpreter on CPU) against tests/reference_gptq.py and the raw path.

Shapes are small (K = 256, N in {16, 40, 80}) and cover every group size, both checkpoint
formats, act-order (g_idx a permutation), arbitrary g_idx (groups of unequal size after
sorting), M that takes each tile bucket (1: the CUDA-core GEMV; 5: split-K decode; 33: 64-row;
70: the last). The GEMV is also driven with explicit tiles over several K blocks and splits.
Both weight layouts run: "checkpoint" (the sm_80 variant, which the interpreter selects) and
"k_planes" (the sm_90 variant, selected with KDSL_ARCH=sm_90).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kdsl
import reference_gptq as ref
from kdsl.codegen.render import tile_params
from kdsl.kernels import expressions, host
from kdsl.kernels.w4a16.gemv import IMPL as GEMV_IMPL
from kdsl.ops import gptq_prepare
from conftest import REPO_ROOT
from kdsl.ops.gptq_checkpoint import unpack_zeros
from kdsl.ops.w4a16 import checkpoint_rows, pack_planes, unpack_planes
from kdsl.schema.tiling import Tile

TOL = 1e-2
CASES = [(g, mode) for g in (32, 64, 128, -1) for mode in ("none", "perm", "random") if not (g == -1 and mode == "random")]


# The arch each weight layout's variant is selected for.
LAYOUT_ARCH = {"checkpoint": "sm_89", "k_planes": "sm_90"}
LAYOUT_ZEROS = {"checkpoint": "biased", "k_planes": "paired"}  # as each variant declares


@pytest.fixture(params=list(LAYOUT_ARCH))
def weights_layout(request, monkeypatch):
    """Select the prepared variant that reads this weight layout, through KDSL_ARCH."""
    monkeypatch.setenv("KDSL_ARCH", LAYOUT_ARCH[request.param])
    kdsl.registry.reset()
    yield request.param
    kdsl.registry.reset()


def _prepare(ck, group_size, fmt):
    return gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                        group_size=group_size, checkpoint_format=fmt)


def _ref(x, ck, group_size, fmt):
    return ref.gemm_ref(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                        group_size=group_size, checkpoint_format=fmt)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size, g_idx", CASES)
def test_prepared_layout_round_trip(fmt, group_size, g_idx, weights_layout):
    """Read the prepared tensors back by the layout's rules and recover the checkpoint's integers."""
    ck = ref.make_checkpoint(256, 40, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)
    prepared = _prepare(ck, group_size, fmt)
    assert prepared.layout == {"zeros": LAYOUT_ZEROS[weights_layout], "weights": weights_layout}
    perm = torch.arange(256) if prepared.perm is None else prepared.perm.long()
    groups = ref.default_g_idx(256, group_size) if ck["g_idx"] is None else ck["g_idx"]
    # Prepared row k is the checkpoint's input row perm[k], and its group is that row's group.
    assert torch.equal(ref.unpack_qweight(checkpoint_rows(prepared)), ck["q"][perm])
    assert torch.equal(prepared.groups.long(), groups.long()[perm])
    assert torch.equal(prepared.groups, torch.sort(groups.to(torch.int32)).values)
    # Zeros: the real zero plus the kernel's magic bias, exactly, in the scales' dtype.
    assert prepared.zeros.dtype == ck["scales"].dtype
    assert torch.equal(prepared.zeros.float() - prepared.zero_bias, ck["zero"].float())
    assert torch.equal(prepared.scales, ck["scales"])
    if prepared.layout["zeros"] == "paired":
        # One 32-bit (scale, zero) per group and column: scale in the low half.
        assert prepared.scales.stride() == prepared.zeros.stride() == (2 * 40, 2)
        assert prepared.zeros.data_ptr() == prepared.scales.data_ptr() + prepared.scales.element_size()
    expected_contiguous = g_idx != "random"
    assert prepared.contiguous_groups == expected_contiguous
    if g_idx == "none" or group_size == -1:
        assert prepared.perm is None  # already in order: no gather of x


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size, g_idx", CASES)
@pytest.mark.parametrize("m", [1, 5, 33, 70])
def test_prepared_gemm_matches_reference_and_raw(fmt, group_size, g_idx, m, weights_layout):
    ck = ref.make_checkpoint(256, 80, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx)
    prepared = _prepare(ck, group_size, fmt)
    x = torch.randn(m, 256).half()
    y = kdsl.ops.gptq_gemm(x, prepared)
    expected = _ref(x, ck, group_size, fmt)
    assert y.dtype == torch.float16 and y.shape == (m, 80)
    assert ref.rel_fro_error(y, expected) < TOL
    raw = kdsl.ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                             group_size=group_size, checkpoint_format=fmt)
    assert ref.rel_fro_error(y, raw.float()) < TOL


def _gemv_tile(block_n, block_k, split_k):
    return tile_params(Tile(block_m=1, block_n=block_n, block_k=block_k, split_k=split_k, num_stages=1), GEMV_IMPL)


@pytest.mark.parametrize("group_size, g_idx, block_k", [
    (128, "default", 64),   # every block inside one group: one scale row per block
    (128, "perm", 128),     # act-order, block = group
    (32, "default", 128),   # four groups per block: one scale row per packed word
    (64, "random", 64),     # groups of unequal size: scales per row
    (-1, "default", 256),
])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_tile_over_many_k_blocks(group_size, g_idx, block_k, split_k, dtype):
    """The GEMV implementation (block_m = 1); K = 640 spans several blocks (the last one partial for
    block_k 128 and 256), and an uneven split leaves some programs a shorter run."""
    k, n = 640, 72  # N not a multiple of block_n: wrapped columns must not be stored
    ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format="gptq", g_idx=g_idx, scale_dtype=dtype)
    prepared = _prepare(ck, group_size, "gptq")
    x = torch.randn(1, k).to(dtype)
    entry = kdsl.registry.select("w4a16_gemm", prepared.scheme, arch="sm_89")
    y = torch.full((1, n), float("nan"), dtype=dtype)
    entry.launch(x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                 prepared.contiguous_groups, y, _gemv_tile(64, block_k, split_k))
    assert ref.rel_fro_error(y, _ref(x, ck, group_size, "gptq")) < TOL


def test_planes_layout_words():
    """k_planes: word (n, kk) of tile (nt, kt) holds row 128 kt + 32 p + 2 kk + h of column 128 nt + n
    in nibble p + 4 h; K and N pad with zeros to whole 128 x 128 tiles; unpack_planes inverts it."""
    q = torch.randint(0, 16, (200, 300))
    words = pack_planes(q)
    assert words.shape == (3, 2, 128, 16) and words.dtype == torch.int32
    for nt, kt, n, kk, j in [(0, 0, 0, 0, 0), (1, 0, 5, 3, 7), (2, 1, 43, 15, 4), (0, 1, 127, 0, 2), (0, 0, 9, 6, 5)]:
        row, col = 128 * kt + 32 * (j % 4) + 2 * kk + j // 4, 128 * nt + n
        expected = int(q[row, col]) if row < 200 and col < 300 else 0
        assert (int(words[nt, kt, n, kk]) >> (4 * j)) & 15 == expected
    assert torch.equal(unpack_planes(words, 200, 300), q.to(torch.int32))


@pytest.mark.parametrize("k, n, group_size, g_idx", [
    (640, 200, 128, "none"),   # N not whole tiles; one group per tile: the half2-free uniform path
    (640, 200, 64, "perm"),    # act-order: one group per plane
    (640, 200, 32, "none"),    # groups as long as one plane's rows span
    (640, 200, 32, "random"),  # groups of unequal size: a group per row
    (192, 136, 64, "none"),    # K not whole tiles either: padded rows take the last group
    (192, 136, 32, "random"),
    (192, 136, -1, "none"),
])
@pytest.mark.parametrize("m", [1, 5, 33, 70])
@pytest.mark.parametrize("weights_layout", ["k_planes"], indirect=True)
def test_planes_layout_ragged_shapes(k, n, group_size, g_idx, m, weights_layout):
    """The Hopper variant's k_planes kernels (GEMV and MMA) on padded tiles, through the interpreter."""
    ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format="gptq", g_idx=g_idx)
    prepared = _prepare(ck, group_size, "gptq")
    assert prepared.layout["weights"] == "k_planes"
    x = torch.randn(m, k).half()
    assert ref.rel_fro_error(kdsl.ops.gptq_gemm(x, prepared), _ref(x, ck, group_size, "gptq")) < TOL


@pytest.mark.parametrize("g_idx", ["none", "perm"])
@pytest.mark.parametrize("weights_layout", ["k_planes"], indirect=True)
def test_every_planes_tile_matches_reference(g_idx, weights_layout):
    """Each tile of the Hopper variant that runs on the CPU, the N-conditioned ones included (the bench's N
    would be too slow here), launched directly at an M inside its bucket on a small problem: K ends
    mid-tile, N mid-tile, and M inside the 256-row tile."""
    k, n = 384, 136
    ck = ref.make_checkpoint(k, n, group_size=128, checkpoint_format="gptq", g_idx=g_idx)
    prepared = _prepare(ck, 128, "gptq")
    entry = kdsl.registry.select("w4a16_gemm", prepared.scheme)
    assert any(bucket.n_min is not None for bucket in entry.tiles)
    ran = set()
    for bucket in entry.tiles:
        m = bucket.m_max if bucket.m_max is not None else 70
        cpu_call = kdsl.registry.Call(m=m, n=n, device_type="cpu", act_order=prepared.perm is not None)
        if entry.refusal_reason(bucket.params, cpu_call) is not None:
            continue  # a Gluon kernel (GPU only): its alternative, the next tile, runs here
        ran.add(bucket.params["impl"])
        x = torch.randn(m, k).half()
        y = torch.full((m, n), float("nan"), dtype=torch.float16)
        entry.launch(x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                     prepared.contiguous_groups, y, bucket.params)
        assert ref.rel_fro_error(y, _ref(x, ck, 128, "gptq")) < TOL, bucket
    assert ran == {"gemv", "planes_mma"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weights_layout", ["checkpoint", "k_planes"], indirect=True)
def test_prepared_gemm_dtypes_and_batch_dims(dtype, weights_layout):
    ck = ref.make_checkpoint(256, 40, group_size=64, checkpoint_format="gptq", g_idx="perm", scale_dtype=dtype)
    prepared = _prepare(ck, 64, "gptq")
    x = torch.randn(2, 3, 256).to(dtype)
    y = kdsl.ops.gptq_gemm(x, prepared)
    assert y.shape == (2, 3, 40) and y.dtype == dtype
    assert ref.rel_fro_error(y, _ref(x, ck, 64, "gptq")) < TOL


def test_prepared_runs_the_prepared_kernel(launched):
    ck = ref.make_checkpoint(256, 16, group_size=128, checkpoint_format="gptq")
    kdsl.ops.gptq_gemm(torch.randn(1, 256).half(), _prepare(ck, 128, "gptq"))
    assert launched == ["w4a16_gemm__int4_g128__gemv_sm80"]


def test_split_k_scratch_is_left_clean():
    """The in-kernel split-K reduction must leave its counters at zero for the next launch."""
    ck = ref.make_checkpoint(256, 80, group_size=32, checkpoint_format="gptq")
    prepared = _prepare(ck, 32, "gptq")
    x = torch.randn(1, 256).half()
    first = kdsl.ops.gptq_gemm(x, prepared)
    second = kdsl.ops.gptq_gemm(x, prepared)
    assert torch.equal(first, second)
    kernel = kdsl.registry.select("w4a16_gemm", prepared.scheme, arch="sm_89").modules["gemv"].generated().kernel
    _, counters = host.SPLITK_SCRATCH[(kernel, x.device)]
    assert int(counters.abs().sum()) == 0


def _split_tile(split_k, split_fill=None, split_min_steps=None):
    return {"SPLIT_K": split_k, "split_fill": split_fill, "split_min_steps": split_min_steps}


def test_mma_split_fills_whole_waves():
    """split_k is an upper bound: the split whose programs finish soonest in waves of two programs
    per SM, counting a fixed cost per program; never below one split or past one K block per
    split; without an SM count (the interpreter) the tile's split stands."""
    module = host  # kdsl/kernels/host.py: the K split every split-K launch takes (kdsl.kernels.expressions' rule)
    assert expressions.SPLIT_FILL == 2 and expressions.PROGRAM_COST_STEPS == 6
    assert module.split_for(_split_tile(8), 32, tiles=32, sms=132) == 8     # 4096 columns / 128: 256 programs, one wave
    assert module.split_for(_split_tile(8), 32, tiles=112, sms=132) == 2    # 14336 columns: a third split starts a second wave
    assert module.split_for(_split_tile(8), 64, tiles=896, sms=132) == 1    # the tiles alone fill a wave: no split
    assert module.split_for(_split_tile(8), 64, tiles=264, sms=132) == 1
    assert module.split_for(_split_tile(8), 3, tiles=1, sms=132) == 3       # at most one K block per split
    assert module.split_for(_split_tile(8), 32, tiles=896, sms=None) == 8


def test_tile_split_fill_sets_the_programs_per_sm():
    """A tile's split_fill replaces the default two programs per SM."""
    module = host
    assert module.split_for(_split_tile(4, 1), 32, tiles=112, sms=132) == 1  # one program per SM: 112 already
    assert module.split_for(_split_tile(4, 1), 32, tiles=32, sms=132) == 4   # 128 programs
    # Three per SM, 224 tiles of 64 steps: two waves of 22-step programs beat one of 64 or three of 16.
    assert module.split_for(_split_tile(8, 3), 64, tiles=224, sms=132) == 3
    assert module.split_for(_split_tile(8, 3), 32, tiles=112, sms=132) == 3  # 336 programs: still one wave
    assert module.split_for(_split_tile(4, 1), 32, tiles=112, sms=None) == 4


def test_tile_split_min_steps_keeps_programs_long():
    """split_min_steps caps the split so each program keeps that many K steps, on the GPU and the CPU alike."""
    module = host
    assert module.split_for(_split_tile(8), 32, tiles=64, sms=132) == 4  # the wave rule alone: 8-step programs
    assert module.split_for(_split_tile(8, None, 16), 32, tiles=64, sms=132) == 2
    assert module.split_for(_split_tile(8, None, 16), 112, tiles=64, sms=132) == 4  # long K: the wave rule decides
    assert module.split_for(_split_tile(8, None, 16), 12, tiles=64, sms=132) == 1   # shorter than one program's share
    assert module.split_for(_split_tile(8, None, 16), 64, tiles=64, sms=None) == 4


@pytest.mark.parametrize("group_size, contiguous, reason", [
    (128, True, "GPU only"),             # the CPU: the Gluon kernel cannot run
    (64, True, "plane tile"),            # two groups in each 128-row plane tile
    (128, False, "plane tile"),          # groups of unequal size after act-order
])
def test_gemv_tiles_refuse_rows_the_mma_gemv_cannot_take(group_size, contiguous, reason):
    """The mma.sync GEMV refuses what it cannot serve, saying why, and the definition's next tile serving M and N
    takes the call: the M <= 16 MMA for 2-8 rows, the Triton GEMV for one row."""
    entry = kdsl.registry.select("w4a16_gemm", f"w4a16.int4.g{group_size}", arch="sm_90")
    gemv = entry.tile_for(4, 4096)
    assert gemv["impl"] == "gemv_mma_gluon", "the sm_90 definition's M <= 8 bucket is the mma.sync GEMV"
    cpu = reason == "GPU only"
    call = kdsl.registry.Call(m=4, n=4096, device_type="cpu" if cpu else "cuda", contiguous_groups=contiguous)
    assert reason in entry.refusal_reason(gemv, call)
    if group_size == 128 and contiguous:
        assert "at most 8 rows" in entry.refusal_reason(gemv, kdsl.registry.Call(m=9, n=4096))
        assert entry.refusal_reason(gemv, kdsl.registry.Call(m=4, n=4096)) is None
    chosen = entry.tile_for(4, 4096, call)
    assert chosen == entry.tile_for(16, 4096, dataclasses.replace(call, m=16)) and chosen["impl"] == "planes_mma", \
        "the M <= 16 MMA tile takes the rows"
    one_row = entry.tile_for(1, 4096, dataclasses.replace(call, m=1))
    assert one_row["impl"] == "gemv" and one_row["BLOCK_N"] == 16


def test_sixteen_row_gemv_tile_refuses_long_k_and_more_rows():
    """sm_90's M <= 16 bucket below N = 8192: the mma.sync GEMV with x_rows = 16 up to its k_max; a longer K, or
    more rows than x_rows, goes to the MMA tile after it."""
    entry = kdsl.registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_90")
    gemv = entry.tile_for(16, 4096)
    assert gemv["impl"] == "gemv_mma_gluon" and gemv["x_rows"] == 16 and gemv["k_max"] == 4096
    assert entry.refusal_reason(gemv, kdsl.registry.Call(m=16, n=4096, k=4096)) is None
    assert entry.refusal_reason(gemv, kdsl.registry.Call(m=9, n=4096)) is None  # K unknown: nothing to refuse on
    assert "K = 14336" in entry.refusal_reason(gemv, kdsl.registry.Call(m=16, n=4096, k=14336))
    assert "at most 16 rows" in entry.refusal_reason(gemv, kdsl.registry.Call(m=17, n=4096, k=4096))
    long_k = entry.tile_for(12, 4096, kdsl.registry.Call(m=12, n=4096, k=14336))
    assert long_k["impl"] == "planes_mma" and long_k["BLOCK_M"] == 16
    assert entry.tile_for(16, 8192)["impl"] == "planes_mma"  # from N = 8192 the MMA tile serves


def test_cpu_fallback_without_interpreter(monkeypatch, launched):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ck = ref.make_checkpoint(256, 40, group_size=32, checkpoint_format="gptq_v2", g_idx="random")
    prepared = _prepare(ck, 32, "gptq_v2")
    x = torch.randn(3, 256).half()
    assert ref.rel_fro_error(kdsl.ops.gptq_gemm(x, prepared), _ref(x, ck, 32, "gptq_v2")) < TOL
    assert launched == []


def test_empty_and_zero_inputs():
    ck = ref.make_checkpoint(256, 40, group_size=64)
    prepared = _prepare(ck, 64, "gptq")
    assert kdsl.ops.gptq_gemm(torch.randn(0, 256).half(), prepared).shape == (0, 40)
    y = kdsl.ops.gptq_gemm(torch.zeros(2, 256).half(), prepared)
    assert torch.equal(y, torch.zeros(2, 40).half())


def test_bad_arguments_name_the_argument():
    ck = ref.make_checkpoint(256, 40, group_size=64)
    prepared = _prepare(ck, 64, "gptq")
    with pytest.raises(TypeError, match="x: expected dtype float16"):
        kdsl.ops.gptq_gemm(torch.randn(1, 256).bfloat16(), prepared)
    with pytest.raises(ValueError, match="x: expected K = 256"):
        kdsl.ops.gptq_gemm(torch.randn(1, 128).half(), prepared)
    with pytest.raises(ValueError, match="scales: prepared weights carry their own"):
        kdsl.ops.gptq_gemm(torch.randn(1, 256).half(), prepared, None, ck["scales"])
    with pytest.raises(TypeError, match="qzeros: required"):
        kdsl.ops.gptq_gemm(torch.randn(1, 256).half(), ck["qweight"])
    bad = ck["g_idx"].clone() if ck["g_idx"] is not None else ref.default_g_idx(256, 64).to(torch.int32)
    bad[3] = 9
    with pytest.raises(ValueError, match=r"g_idx: values must lie in \[0, 4\)"):
        gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], bad, group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], group_size=48)


def test_layout_mismatch_is_refused(monkeypatch):
    ck = ref.make_checkpoint(256, 40, group_size=64)
    prepared = _prepare(ck, 64, "gptq")
    stale = type(prepared)(**{**prepared.__dict__, "layout": {"zeros": "packed"}})
    with pytest.raises(ValueError, match="prepare them again"):
        kdsl.ops.gptq_gemm(torch.randn(1, 256).half(), stale)


def test_packed_zeros_layout(tmp_path, monkeypatch):
    """A definition may declare zeros = "packed": prepare packs the real zeros, the template unpacks them."""
    defs = tmp_path / "defs"
    defs.mkdir()
    for source in (REPO_ROOT / "kernel_defs").glob("*.toml"):
        text = source.read_text().replace('layout = { zeros = "biased" }', 'layout = { zeros = "packed" }')
        (defs / source.name).write_text(text)
    from kdsl.cli import main
    assert main(["generate", "--defs", str(defs), "--out", str(tmp_path / "out")]) == 0
    monkeypatch.setenv("KDSL_GENERATED", str(tmp_path / "out"))
    kdsl.registry.reset()
    ck = ref.make_checkpoint(256, 80, group_size=32, checkpoint_format="gptq", g_idx="perm")
    prepared = _prepare(ck, 32, "gptq")
    assert prepared.layout == {"zeros": "packed", "weights": "checkpoint"}
    # "gptq" stores zero - 1; prepared zeros are the real ones, whatever the format
    assert torch.equal(unpack_zeros(prepared.zeros, 4, 0), unpack_zeros(ck["qzeros"], 4, 1))
    for m in (1, 33, 70):
        x = torch.randn(m, 256).half()
        assert ref.rel_fro_error(kdsl.ops.gptq_gemm(x, prepared), _ref(x, ck, 32, "gptq")) < TOL


def test_plan_key_is_computed_once_and_not_copied():
    """The weights' part of the launch-plan key is kept on the (frozen) prepared weights; a copy or an unpickled
    instance, whose tensors may live elsewhere, works it out again from its own tensors."""
    import copy
    import pickle

    torch.manual_seed(0)
    ck = kdsl.ops.gptq_quantize(torch.randn(256, 256, dtype=torch.float16), bits=4, group_size=128)
    prepared = gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], None, group_size=128)
    key = prepared.plan_key
    assert prepared.plan_key is key
    assert prepared.qweight.shape in key and prepared.scales.stride() in key
    for other in (copy.deepcopy(prepared), pickle.loads(pickle.dumps(prepared))):
        assert "plan_key" not in vars(other)
        assert other.plan_key == key
        x = torch.randn(3, 256, dtype=torch.float16)
        assert torch.equal(kdsl.ops.w4a16_gemm(x, other), kdsl.ops.w4a16_gemm(x, prepared))
