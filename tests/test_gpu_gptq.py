"""GPTQ INT4 ops on a CUDA GPU (real kernels, no interpreter) against tests/reference_gptq.py.

    KDSL_TEST_GPU=1 python -m pytest tests/test_gpu_gptq.py -m gpu -q

Checkpoints are built by hand on the GPU from random integers (reference_gptq.make_checkpoint,
not kdsl.ops.gptq_quantize), once per (shape, scheme, g_idx, dtype) for the whole module; the
fp32 reference weight of each is cached beside it.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import kdsl
import reference_gptq as ref
from conftest import wrap_launch
from kdsl.naming import gptq_scheme_name, w4a16_scheme_name
from kdsl.runtime import registry

pytestmark = pytest.mark.gpu

TOL = 1e-2
# (K, N): Llama-3-8B-like projections and a 70B-like MLP up projection.
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
MS = [1, 16, 64, 256]


def _shape_id(shape):
    return f"K{shape[0]}xN{shape[1]}"


@pytest.fixture(scope="module")
def checkpoints():
    """Module-wide cache: build each checkpoint (and its fp32 reference weight [K, N]) once."""
    cache: dict = {}

    def get(k, n, *, group_size=128, fmt="gptq", g_idx="default", scale_dtype=torch.float16):
        key = (k, n, group_size, fmt, g_idx, scale_dtype)
        if key not in cache:
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
            ck = ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx,
                                     scale_dtype=scale_dtype, device="cuda", generator=gen)
            tensors = {name: ck[name] for name in ("qweight", "qzeros", "scales", "g_idx")}
            del ck  # the int64 integers are large; keep only the checkpoint tensors
            tensors["w"] = ref.dequant_ref(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                                           group_size=group_size, checkpoint_format=fmt)
            cache[key] = tensors
        return cache[key]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def _x(m, k, dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(1000 * m + k)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


def _check(ck, m, *, group_size=128, fmt="gptq", dtype=torch.float16, g_idx="ckpt"):
    k, n = ck["w"].shape
    x = _x(m, k, dtype)
    groups = ck["g_idx"] if g_idx == "ckpt" else g_idx
    y = kdsl.ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], groups,
                           group_size=group_size, checkpoint_format=fmt)
    assert y.shape == (m, n) and y.dtype == dtype and y.is_cuda
    expected = x.float() @ ck["w"]
    err = ref.rel_fro_error(y, expected)
    assert err < TOL, f"M={m} K={k} N={n} group_size={group_size} {fmt}: rel err {err:.3g}"
    return y


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_gemm_shapes(checkpoints, shape, m):
    _check(checkpoints(*shape), m)


@pytest.mark.parametrize("m", [1, 64, 256])
@pytest.mark.parametrize("g_idx", ["perm", "random"])
def test_gemm_act_order(checkpoints, g_idx, m):
    ck = checkpoints(4096, 4096, g_idx=g_idx)
    _check(ck, m)


@pytest.mark.parametrize("m", [1, 64, 256])
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_gemm_group_sizes(checkpoints, group_size, m):
    _check(checkpoints(4096, 4096, group_size=group_size), m, group_size=group_size)


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gemm_formats(checkpoints, fmt, m):
    _check(checkpoints(4096, 14336, fmt=fmt), m, fmt=fmt)


@pytest.mark.parametrize("m", [1, 16, 256])
def test_gemm_bf16(checkpoints, m):
    ck = checkpoints(4096, 4096, scale_dtype=torch.bfloat16, fmt="gptq_v2", g_idx="perm")
    _check(ck, m, dtype=torch.bfloat16, fmt="gptq_v2")


@pytest.mark.parametrize("m", [1, 64])
def test_gemm_explicit_default_g_idx(checkpoints, m):
    ck = checkpoints(4096, 4096, g_idx="none")
    _check(ck, m, g_idx=ref.default_g_idx(4096, 128, "cuda"))


def test_gemm_leading_batch_dims(checkpoints):
    ck = checkpoints(4096, 4096)
    x = _x(6, 4096).view(2, 3, 4096)
    y = kdsl.ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=128)
    assert y.shape == (2, 3, 4096)
    assert ref.rel_fro_error(y, x.float() @ ck["w"]) < TOL


@pytest.mark.parametrize("shape, fmt, g_idx, dtype", [
    ((8192, 28672), "gptq", "default", torch.float16),
    ((4096, 14336), "gptq_v2", "perm", torch.float16),
    ((4096, 4096), "gptq_v2", "perm", torch.bfloat16),
], ids=["K8192xN28672-gptq", "K4096xN14336-gptq_v2-act_order", "K4096xN4096-gptq_v2-act_order-bf16"])
def test_dequant_large(checkpoints, shape, fmt, g_idx, dtype):
    ck = checkpoints(*shape, fmt=fmt, g_idx=g_idx, scale_dtype=dtype)
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                              group_size=128, checkpoint_format=fmt)
    k, n = ck["w"].shape
    assert w.shape == (n, k) and w.dtype == dtype and w.is_cuda
    assert ref.rel_fro_error(w.T, ck["w"]) < TOL
    # (q - z) * s is exact in fp32: one rounding to the output dtype gives the reference rounded.
    assert torch.equal(w.T, ck["w"].to(dtype))


def test_dequant_then_matmul_matches_gemm(checkpoints):
    ck = checkpoints(4096, 4096)
    w = kdsl.ops.gptq_dequant(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=128)
    x = _x(64, 4096)
    y = kdsl.ops.gptq_gemm(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=128)
    assert ref.rel_fro_error(y, x @ w.T) < TOL


def test_gemm_runs_the_scheme_kernel(checkpoints, launched):
    ck = checkpoints(4096, 4096, group_size=64)
    _check(ck, 1, group_size=64)
    assert launched == ["gptq_gemm__int4_g64_gptq__splitk_sm80"]


# ---------------------------------------------------------------------------------------------
# prepared weights (kdsl.ops.gptq_prepare): the fast path


def _check_prepared(ck, m, *, group_size=128, fmt="gptq", dtype=torch.float16):
    k, n = ck["w"].shape
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"],
                                     group_size=group_size, checkpoint_format=fmt)
    x = _x(m, k, dtype)
    expected = x.float() @ ck["w"]
    for attempt in range(2):  # twice: the split-K counters must be left clean for the next launch
        y = kdsl.ops.gptq_gemm(x, prepared)
        assert y.shape == (m, n) and y.dtype == dtype and y.is_cuda
        err = ref.rel_fro_error(y, expected)
        assert err < TOL, f"prepared M={m} K={k} N={n} group_size={group_size} {fmt} call {attempt}: rel err {err:.3g}"


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_prepared_gemm_shapes(checkpoints, shape, m):
    _check_prepared(checkpoints(*shape), m)


@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("group_size, g_idx, fmt", [(128, "perm", "gptq"), (-1, "perm", "gptq_v2"),
                                                    (32, "random", "gptq"), (64, "default", "gptq_v2")])
def test_prepared_act_order_and_groups(checkpoints, group_size, g_idx, fmt, m):
    ck = checkpoints(4096, 4096, group_size=group_size, fmt=fmt, g_idx=g_idx)
    _check_prepared(ck, m, group_size=group_size, fmt=fmt)


@pytest.mark.parametrize("m", [9, 12, 16])
@pytest.mark.parametrize("shape, g_idx, dtype, impl", [
    ((4096, 4096), "default", torch.float16, "gemv_mma_gluon"),
    ((4096, 6144), "perm", torch.float16, "gemv_mma_gluon"),
    ((4096, 4096), "default", torch.bfloat16, "gemv_mma_gluon"),
    ((14336, 4096), "default", torch.float16, "planes_mma"),  # K above the GEMV tile's k_max
], ids=lambda v: _shape_id(v) if isinstance(v, tuple) else str(v).removeprefix("torch."))
def test_prepared_sixteen_row_gemv(checkpoints, launched, shape, g_idx, dtype, impl, m):
    """M = 9-16 below N = 8192 on sm_90: the mma.sync GEMV with x's 16 rows on two MMAs per dequantized weight
    fragment (rows past M masked), act-order's gathered x included; K above its k_max takes the MMA tile."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 16-row GEMV tile is sm_90's")
    _check_prepared(checkpoints(*shape, g_idx=g_idx, scale_dtype=dtype), m, dtype=dtype)
    gemms = [name for name in launched if name.startswith("w4a16_gemm")]
    assert gemms and all(impl in name for name in gemms), gemms


@pytest.mark.parametrize("m", [8, 64, 1024])
@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336)], ids=_shape_id)
def test_prepared_act_order_long_k_and_prefill(checkpoints, shape, m):
    """Act-order's one gather of x (whole rows permuted in shared memory; K = 14336 pads to 16384), and from
    dequant_min_m rows the dequantized weights written back in the checkpoint's K order instead of a gather."""
    _check_prepared(checkpoints(*shape, g_idx="perm"), m)


@pytest.mark.parametrize("m", [1, 4, 64])
def test_prepared_act_order_dependent_launch_waits_for_the_gather(checkpoints, monkeypatch, m):
    """Act-order on a tile with pdl: the gather is launched programmatically dependent on the kernel before it,
    which writes x, and the GEMM on the gather; each must read only after the one before is done. Inside a CUDA
    graph that writes x with a kernel and is replayed with a new source each time, a gather or GEMM that read
    early would see the previous replay's x."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launches need sm_90+")
    ck = checkpoints(4096, 4096, g_idx="perm")
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], bits=4, group_size=128)
    entry = registry.dispatch("w4a16_gemm", prepared.scheme, torch.device("cuda"))
    tile = entry.tile_for(m, 4096, registry.Call(m=m, n=4096, contiguous_groups=prepared.contiguous_groups))
    if not tile.get("pdl"):
        pytest.skip(f"{entry.name}'s tile for M = {m}, N = 4096 takes no pdl")
    dependent = []
    for kernel_module in entry.modules.values():
        def spy(original):
            def launch(*args, **kwargs):
                dependent.append(kwargs.get("dependent", False))
                return original(*args, **kwargs)
            return launch
        wrap_launch(monkeypatch, kernel_module, spy)
    kdsl.registry.plans.clear()
    monkeypatch.setattr(kdsl.ops._plan, "RECORD", False)
    x = torch.zeros(m, 4096, dtype=torch.float16, device="cuda")
    kdsl.ops.gptq_gemm(x, prepared)
    assert dependent == [True], "the GEMM after act-order's gather was not a dependent launch"
    source = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(source, 1, out=x)  # a kernel writing x right before the gather (a copy would be a memcpy node)
        y = kdsl.ops.gptq_gemm(x, prepared)
    for seed in range(4):
        source.copy_(torch.randn(m, 4096, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        err = ref.rel_fro_error(y, source.float() @ ck["w"])
        assert err < TOL, f"replay {seed}: rel err {err:.3g} (x read before the kernel writing it or the gather finished?)"


@pytest.mark.parametrize("m", [1, 4])
def test_silu_mul_and_plain_gemm_dependent_launches_wait_for_their_inputs(checkpoints, monkeypatch, m):
    """A W4A16 MLP's decode chain: silu_mul launched programmatically dependent on the kernel that writes gate_up
    (its tile's pdl) and releasing the kernel after it at once; the plain GEMM (no act-order) on h launched
    dependent on silu_mul (its tile's plain_pdl). Inside a CUDA graph replayed with a new source each time, a
    kernel that read early would see the previous replay's gate_up or h."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launches need sm_90+")
    inter, n = 4096, 8192
    ck = checkpoints(inter, n)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], bits=4, group_size=128)
    gemm = registry.dispatch("w4a16_gemm", prepared.scheme, torch.device("cuda"))
    act = kdsl.registry.select("silu_mul", arch="sm_90")
    call = registry.Call(m=m, n=n, contiguous_groups=prepared.contiguous_groups)
    if not (gemm.tile_for(m, n, call).get("plain_pdl")
            and act.tile_for(m).get("pdl")):
        pytest.skip(f"the tiles for M = {m} take no dependent launch")
    dependent = []
    for kernel_module in [*gemm.modules.values(), *act.modules.values()]:
        def spy(original, _name=kernel_module.kernel_name):
            def launch(*args, **kwargs):
                dependent.append((_name.split("__")[0], kwargs.get("dependent", False)))
                return original(*args, **kwargs)
            return launch
        wrap_launch(monkeypatch, kernel_module, spy)
    kdsl.registry.plans.clear()
    monkeypatch.setattr(kdsl.ops._plan, "RECORD", False)
    gate_up = torch.zeros(m, 2 * inter, dtype=torch.float16, device="cuda")
    kdsl.ops.gptq_gemm(kdsl.ops.silu_mul(gate_up), prepared)
    assert dependent == [("silu_mul", True), ("w4a16_gemm", True)], dependent
    source = torch.zeros_like(gate_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(source, 1, out=gate_up)  # a kernel writing gate_up right before silu_mul
        y = kdsl.ops.gptq_gemm(kdsl.ops.silu_mul(gate_up), prepared)
    for seed in range(4):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        source.copy_(torch.randn(m, 2 * inter, generator=gen, device="cuda") * 2)
        graph.replay()
        g, u = source.float()[:, :inter], source.float()[:, inter:]
        h = (g / (1.0 + torch.exp(-g)) * u).half().float()  # silu_mul rounds h once, to gate_up's dtype
        err = ref.rel_fro_error(y, h @ ck["w"])
        assert err < TOL, f"replay {seed}: rel err {err:.3g} (gate_up or h read before the kernel writing it finished?)"


def test_a_tile_that_refuses_act_order_refuses_a_permutation(checkpoints):
    """The Gluon TMA tile cannot follow perm: launched with one anyway it raises, never an unpermuted product."""
    ck = checkpoints(4096, 4096, g_idx="perm")
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], bits=4, group_size=128)
    entry = registry.dispatch("w4a16_gemm", prepared.scheme, torch.device("cuda"))
    tiles = [b.params for b in entry.tiles if b.params["impl"] == "overlap_gluon"]
    if not tiles:
        pytest.skip(f"{entry.name} has no overlap_gluon tile on this GPU")
    x = _x(64, 4096)
    y = torch.empty(64, 4096, dtype=x.dtype, device="cuda")
    with pytest.raises(ValueError, match="perm: w4a16_gemm/overlap_gluon takes no act-order permutation"):
        entry.launch(x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales, prepared.groups,
                     prepared.contiguous_groups, y, tiles[0])


@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_prepared_bf16(checkpoints, m):
    ck = checkpoints(4096, 14336, scale_dtype=torch.bfloat16, g_idx="perm")
    _check_prepared(ck, m, dtype=torch.bfloat16)


# The CUDA-core M = 1 GEMV sums fp16 products of four weights and activations at a time (packed
# half2 math); a power-of-two scale on x keeps those sums finite and clear of fp16's subnormals. The
# mma.sync GEMV (gemv_mma_gluon) sums in fp32. Both must stay this close to the fp32 reference.
GEMV_TOL = 2e-3
# The GEMV the definition dispatches (the mma.sync one on sm_90), and the CUDA-core GEMV tile serving the
# same calls where that one refuses them.
GEMVS = ["dispatched", "cuda_cores"]


def _prepared_gemv(x, prepared, gemv, group_size=128):
    if gemv == "dispatched":
        return kdsl.ops.gptq_gemm(x, prepared)
    entry = _prepared_entry(group_size)
    tile = next(b.params for b in entry.tiles if b.serves(x.shape[0], prepared.n) and b.params["impl"] == "gemv")
    return _launch_tile(prepared, x, tile, group_size)


@pytest.mark.parametrize("gemv", GEMVS)
@pytest.mark.parametrize("x_kind", ["outliers", "tiny"])
def test_prepared_gemv_extreme_activations(checkpoints, x_kind, gemv):
    ck = checkpoints(4096, 4096)
    k, n = ck["w"].shape
    x = _x(1, k).float()
    if x_kind == "outliers":
        # 30000 * (q - zero) overflows fp16 for |q - zero| >= 3: unscaled, every column would be inf.
        x[0, 8:16] = 30000.0
        x[0, 1000:1004] = -30000.0
    else:
        x = x * 1e-4  # mostly below fp16's smallest normal (6.1e-5)
    x = x.half()
    expected = x.float() @ ck["w"]
    assert expected.abs().max() < 60000, "the reference itself must fit fp16 for this test to mean anything"
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    y = _prepared_gemv(x, prepared, gemv)
    assert torch.isfinite(y).all()
    err = ref.rel_fro_error(y, expected)
    assert err < GEMV_TOL, f"{x_kind}: rel err {err:.3g}"


@pytest.mark.parametrize("gemv", GEMVS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_prepared_gemv_precision(checkpoints, shape, gemv):
    """The GEMV's fp16 products stay within a few fp16 ulps of the fp32 reference."""
    ck = checkpoints(*shape)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    x = _x(1, shape[0])
    err = ref.rel_fro_error(_prepared_gemv(x, prepared, gemv), x.float() @ ck["w"])
    assert err < GEMV_TOL, f"rel err {err:.3g}"


@pytest.mark.parametrize("k, n", [(4000, 2112), (200, 136)], ids=["K4000xN2112", "K200xN136"])
@pytest.mark.parametrize("x_offset", [0, 1], ids=["aligned", "offset"])
@pytest.mark.parametrize("gemv", GEMVS)
def test_prepared_gemv_ragged_k_and_x_alignment(checkpoints, k, n, x_offset, gemv):
    """The CUDA-core GEMV reads x as 32-bit half2 pairs when x's row starts 4-byte aligned, the mma.sync
    one 16 bytes at a time when it can. One group (group_size -1) lets K be any multiple of 8, not of the
    128-row tile: rows past K must read as zero. An x view starting one fp16 in (2-byte aligned) must take
    narrower loads and agree."""
    ck = checkpoints(k, n, group_size=-1)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=-1)
    x = _x(1, k + x_offset)[:, x_offset:]
    assert (x.data_ptr() % 4 == 0) == (x_offset == 0)
    err = ref.rel_fro_error(_prepared_gemv(x, prepared, gemv, group_size=-1), x.float() @ ck["w"])
    assert err < GEMV_TOL, f"{gemv} K={k} N={n} x offset {x_offset}: rel err {err:.3g}"


# ---------------------------------------------------------------------------------------------
# overlap_dequant tiles: the Gluon kernel that dequantizes K block k+1 while block k's wgmma runs


def _prepared_entry(group_size=128):
    return kdsl.registry.dispatch("w4a16_gemm", w4a16_scheme_name(4, group_size), torch.device("cuda"))


def _launch_tile(prepared, x, tile, group_size=128):
    """y of the launch of the module serving `tile` (NaN-filled first, so unwritten outputs show)."""
    y = torch.full((x.shape[0], prepared.n), float("nan"), dtype=x.dtype, device="cuda")
    _prepared_entry(group_size).launch(x, prepared.perm, prepared.qweight, prepared.zeros, prepared.scales,
                                       prepared.groups, prepared.contiguous_groups, y, tile)
    return y


def _spy_launches(monkeypatch, impls, record, group_sizes):
    """Wrap the launch of each prepared module of the implementations `impls`; returns the list of
    record(args) of their calls."""
    calls = []
    for group_size in group_sizes:
        for impl, kernel_module in _prepared_entry(group_size).modules.items():
            if impl not in impls:
                continue
            def spy(original):
                def launch(*args, **kwargs):
                    calls.append(record(args))
                    return original(*args, **kwargs)
                return launch

            wrap_launch(monkeypatch, kernel_module, spy)
    return calls


def _overlap_tiles():
    """The definition's overlap_dequant tiles, and the other block shapes the kernel takes (one warpgroup
    per 64 columns, 16 to 256 rows), so a tuned definition's choice is covered before it ships."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return []
    tiles = [bucket.params for bucket in _prepared_entry().tiles if bucket.params["impl"] == "overlap_gluon"]
    base = tiles[0] if tiles else None
    extra = [dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, SPLIT_K=split)
             for bm, bn, warps, stages, split in ((16, 64, 4, 4, 8), (128, 128, 8, 3, 2), (256, 64, 4, 3, 4))] if base else []
    return tiles + extra


def _tile_id(tile):
    return f"{tile['BLOCK_M']}x{tile['BLOCK_N']}w{tile['num_warps']}s{tile['num_stages']}k{tile['SPLIT_K']}"


@pytest.fixture
def overlap_launches(monkeypatch):
    """The Gluon kernel's launches, by BLOCK_M."""
    return _spy_launches(monkeypatch, {"overlap_gluon"}, lambda args: args[-1]["BLOCK_M"], (128, -1))


@pytest.mark.parametrize("tile", _overlap_tiles(), ids=_tile_id)
@pytest.mark.parametrize("m, k, n, group_size, dtype", [
    (64, 4096, 14336, 128, torch.float16),
    (37, 4096, 4096, 128, torch.bfloat16),    # ragged M, bf16
    (300, 14336, 264, 128, torch.float16),    # several row tiles, N past the last 128-column tile
    (17, 200, 136, -1, torch.float16),        # one group: K not a whole tile (TMA zero-fills x, tiles are padded)
    (130, 1160, 2112, -1, torch.bfloat16),    # an odd number of K blocks per split
], ids=["M64", "M37-bf16", "M300-N264", "M17-K200-N136", "M130-K1160-bf16"])
def test_prepared_overlap_dequant(checkpoints, overlap_launches, tile, m, k, n, group_size, dtype):
    ck = checkpoints(k, n, group_size=group_size, scale_dtype=dtype)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size)
    x = _x(m, k, dtype)
    expected = x.float() @ ck["w"]
    for attempt in range(2):  # twice: the split-K counters must be left clean for the next launch
        y = _launch_tile(prepared, x, tile, group_size)
        err = ref.rel_fro_error(y, expected)
        assert err < TOL, f"{_tile_id(tile)} M={m} K={k} N={n} call {attempt}: rel err {err:.3g}"
    assert overlap_launches == [tile["BLOCK_M"]] * 2, "the Gluon kernel did not run"


@pytest.mark.parametrize("case", ["aligned", "x_offset", "act_order"])
def test_prepared_overlap_gluon_refuses_what_tma_cannot_read(checkpoints, overlap_launches, case):
    """kdsl.ops at M = 64: the Gluon tile where TMA can read x, act-order included (the op gathers x's columns
    once, before the kernel); for x rows that start 2-byte aligned, its refusal passes the call to the Triton
    MMA tile with the same blocks."""
    if not _overlap_tiles():
        pytest.skip("needs an sm_90 GPU")
    ck = checkpoints(4096, 4096, g_idx="perm" if case == "act_order" else "default")
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    x = _x(64, 4096 + 1)[:, 1:] if case == "x_offset" else _x(64, 4096)
    y = kdsl.ops.gptq_gemm(x, prepared)
    assert ref.rel_fro_error(y, x.float() @ ck["w"]) < TOL
    assert overlap_launches == ([] if case == "x_offset" else [64])


# ---------------------------------------------------------------------------------------------
# mma_gemv tiles: the Gluon GEMV for M <= 8 on mma.sync, 16 columns per program, warps splitting K


def _mma_gemv_tiles():
    """The definition's mma_gemv tiles, and other chunk sizes and warp counts the kernel takes."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return []
    tiles = list({_gemv_tile_id(bucket.params): bucket.params for bucket in _prepared_entry().tiles
                  if bucket.params["impl"] == "gemv_mma_gluon"}.values())
    base = tiles[0] if tiles else None
    extra = [dict(base, BLOCK_K=bk, num_warps=warps) for bk, warps in ((128, 4), (512, 8), (256, 2))] if base else []
    return tiles + extra


def _gemv_tile_id(tile):
    return f"k{tile['BLOCK_K']}w{tile['num_warps']}"


@pytest.fixture
def mma_gemv_launches(monkeypatch):
    """The Gluon GEMV's launches, by M."""
    return _spy_launches(monkeypatch, {"gemv_mma_gluon"}, lambda args: args[0].shape[0], (128, 64, -1))


@pytest.mark.parametrize("tile", _mma_gemv_tiles(), ids=_gemv_tile_id)
@pytest.mark.parametrize("m, k, n, group_size, g_idx, dtype", [
    (1, 4096, 4096, 128, "default", torch.float16),
    (8, 4096, 14336, 128, "default", torch.float16),   # every row of the MMA's x operand
    (3, 14336, 4096, 128, "perm", torch.float16),      # act-order: x gathered through perm
    (5, 4096, 4096, -1, "default", torch.bfloat16),
    (1, 200, 136, -1, "default", torch.float16),       # K not a whole tile, N past the last 16 columns
    (2, 1160, 2112, -1, "perm", torch.bfloat16),       # the last warps' K runs past K
], ids=["M1", "M8-N14336", "M3-K14336-act_order", "M5-bf16", "M1-K200-N136", "M2-K1160-act_order-bf16"])
def test_prepared_mma_gemv(checkpoints, mma_gemv_launches, tile, m, k, n, group_size, g_idx, dtype):
    ck = checkpoints(k, n, group_size=group_size, g_idx=g_idx, scale_dtype=dtype)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size)
    x = _x(m, k, dtype)
    y = _launch_tile(prepared, x, tile, group_size)
    err = ref.rel_fro_error(y, x.float() @ ck["w"])
    # bf16 weights in the MMA operand carry bf16's 8-bit mantissa; fp16's carry 11 bits.
    tol = GEMV_TOL if dtype == torch.float16 else TOL
    assert err < tol, f"{_gemv_tile_id(tile)} M={m} K={k} N={n}: rel err {err:.3g}"
    assert mma_gemv_launches == [m], "the Gluon GEMV did not run"


def test_prepared_mma_gemv_x_view(checkpoints, mma_gemv_launches):
    """x rows that start 2-byte aligned, with a row stride that is no multiple of 8: narrower loads, same sums."""
    tiles = _mma_gemv_tiles()
    if not tiles:
        pytest.skip("needs an sm_90 GPU")
    ck = checkpoints(4096, 4096)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"])
    x = _x(4, 4096 + 1)[:, 1:]
    assert x.data_ptr() % 16 and x.stride(0) % 8
    y = _launch_tile(prepared, x, tiles[0])
    assert ref.rel_fro_error(y, x.float() @ ck["w"]) < GEMV_TOL
    assert mma_gemv_launches == [4]


@pytest.mark.parametrize("m, k, n, group_size, g_idx, gemv", [
    (2, 4096, 4096, 128, "default", True),
    (8, 4096, 14336, 128, "default", True),
    (4, 4096, 4096, 128, "perm", True),      # act-order: groups still whole plane tiles after the sort
    (4, 4096, 4096, 64, "default", False),   # two groups per plane tile: the M <= 16 MMA tile instead
    (4, 256, 16384, 128, "default", False),  # the widest N: the bucket's MMA tile
], ids=["M2", "M8-N14336", "M4-act_order", "M4-group64", "M4-N16384"])
def test_prepared_gemm_rows_take_the_mma_gemv_where_it_runs(checkpoints, mma_gemv_launches, monkeypatch,
                                                            m, k, n, group_size, g_idx, gemv):
    """kdsl.ops at M = 2-8: the definition's GEMV bucket where the mma.sync GEMV can run, else an MMA tile
    (never the Triton GEMV, which would run one row at a time)."""
    if not _mma_gemv_tiles():
        pytest.skip("needs an sm_90 GPU")
    launched_rows = _spy_launches(monkeypatch, {"gemv_mma_gluon", "gemv", "planes_mma", "overlap_gluon"},
                                  lambda args: args[-1]["BLOCK_M"], (128, 64))
    ck = checkpoints(k, n, group_size=group_size, g_idx=g_idx)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size)
    x = _x(m, k)
    err = ref.rel_fro_error(kdsl.ops.gptq_gemm(x, prepared), x.float() @ ck["w"])
    assert err < (GEMV_TOL if gemv else TOL), f"rel err {err:.3g}"
    assert mma_gemv_launches == ([m] if gemv else [])
    assert launched_rows == [1 if gemv else 16]


def test_prepared_mma_gemv_refuses_groups_inside_a_plane_tile(checkpoints, mma_gemv_launches, monkeypatch):
    """One row, groups that change inside a plane tile: the mma.sync GEMV refuses, and its alternative tile,
    the Triton GEMV, runs the call."""
    if not _mma_gemv_tiles():
        pytest.skip("needs an sm_90 GPU")
    triton_gemv = _spy_launches(monkeypatch, {"gemv"}, lambda args: args[0].shape[0], (64,))
    ck = checkpoints(4096, 4096, group_size=64)
    prepared = kdsl.ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=64)
    x = _x(1, 4096)
    y = kdsl.ops.gptq_gemm(x, prepared)
    assert ref.rel_fro_error(y, x.float() @ ck["w"]) < TOL
    assert mma_gemv_launches == [] and triton_gemv == [1]
