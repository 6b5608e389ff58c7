"""Registry: which generated kernel runs where, and why the others were refused."""
from __future__ import annotations

import subprocess
import sys

import types

import pytest
import torch

import kdsl
from kdsl import registry

FP8_SCHEME = kdsl.BlockFP8()
TMA = "fp8_gemm__e4m3_w128x128_a128_f32__tma_persistent_sm90"
PORTABLE = "fp8_gemm__e4m3_w128x128_a128_f32__portable_sm89"


def test_sm90_picks_the_tma_kernel():
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    assert entry.name == TMA
    assert entry.op == "fp8_gemm"
    assert entry.impl == "tma_persistent"
    assert (entry.min_arch, entry.max_arch) == (90, 90)


@pytest.mark.parametrize("arch", ["sm_89", "sm_100", "sm_120", 89, 100])
def test_portable_elsewhere(arch):
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch=arch)
    assert entry.name == PORTABLE
    assert entry.impl == "portable"
    assert entry.min_arch == 89 and entry.max_arch is None


def test_scheme_may_be_given_by_name():
    assert registry.select("fp8_gemm", FP8_SCHEME.name, arch="sm_90").name == TMA
    # No scheme: any scheme's kernel for the op.
    assert registry.select("fp8_gemm", None, arch="sm_90").name == TMA


@pytest.mark.parametrize("arch", ["sm_80", "sm_86"])
def test_no_fp8_gemm_before_ada(arch):
    with pytest.raises(kdsl.NoKernelError) as info:
        registry.select("fp8_gemm", FP8_SCHEME, arch=arch)
    error = info.value
    assert isinstance(error, LookupError)
    message = str(error)
    assert arch in message
    assert PORTABLE in message and TMA in message
    assert "needs sm_89 or newer" in message
    assert "needs sm_90 or newer" in message
    assert {name for name, _ in error.refusals} == {PORTABLE, TMA}


@pytest.mark.parametrize("op", ["act_quant", "weight_quant", "weight_dequant"])
@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_100"])
def test_quant_ops_everywhere_from_ada(op, arch):
    entry = registry.select(op, FP8_SCHEME, arch=arch)
    assert entry.op == op and entry.min_arch == 89 and entry.max_arch is None


@pytest.mark.parametrize("op", ["act_quant", "weight_quant", "weight_dequant"])
def test_quant_ops_refused_on_ampere(op):
    with pytest.raises(kdsl.NoKernelError, match="needs sm_89 or newer"):
        registry.select(op, FP8_SCHEME, arch="sm_86")


def test_explain_sm90():
    text = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_90", m=1)
    assert "CHOSEN" in text
    chosen_line = next(line for line in text.splitlines() if "CHOSEN" in line)
    assert TMA in chosen_line
    assert "tile bucket 0" in chosen_line
    portable_line = next(line for line in text.splitlines() if PORTABLE in line)
    assert "more specific" in portable_line


def test_explain_sm100_gives_the_refusal_reason():
    text = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_100", m=4096)
    chosen_line = next(line for line in text.splitlines() if "CHOSEN" in line)
    assert PORTABLE in chosen_line and "tile bucket 2" in chosen_line
    tma_line = next(line for line in text.splitlines() if TMA in line)
    assert "refused" in tma_line and "sm_90" in tma_line


def test_explain_when_nothing_fits_does_not_raise():
    text = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_80")
    assert "CHOSEN" not in text
    assert "needs sm_89 or newer" in text and "needs sm_90 or newer" in text


# The Hopper variant: M <= 16; M <= 64 for N >= 16384, N >= 4096 (each a Gluon tile and its Triton
# alternative), then every N; M <= 128 the same; M <= 512 and the rest (Gluon, then its alternative).
# Without N the tile for every N serves.
@pytest.mark.parametrize("m, bucket", [(1, 0), (16, 0), (17, 5), (64, 5), (65, 10), (128, 10), (129, 11), (512, 11),
                                       (513, 13), (100_000, 13)])
def test_tile_bucket_for_m(m, bucket):
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90", m=m)
    assert entry.bucket_index(m) == bucket
    tile = entry.tile_for(m)
    assert tile == entry.tiles[bucket].params
    bound = entry.tiles[bucket].m_max
    assert bound is None or m <= bound
    assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(tile)


def _buckets(*bounds):
    """KernelEntry tile buckets for (m_max, n_min) pairs, each tagged with its index."""
    from kdsl.runtime.manifest import TileBucket
    return tuple(TileBucket(m_max, n_min, {"index": index, "impl": "tested"}) for index, (m_max, n_min) in enumerate(bounds))


@pytest.mark.parametrize("m, n, index", [
    (16, 4096, 0), (16, None, 0),
    (17, 16384, 1), (64, 8192, 1),      # wide N: the bucket's first tile
    (64, 8191, 2), (17, 2048, 3),       # narrower: the next that serves it
    (64, None, 3),                      # N unknown: the tile for every N
    (65, 100_000, 4), (4096, None, 4),
])
def test_tile_for_m_and_n(m, n, index):
    import dataclasses
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    tiled = dataclasses.replace(entry, tiles=_buckets((16, None), (64, 8192), (64, 4096), (64, None), (None, None)))
    assert tiled.bucket_index(m, n) == index
    assert tiled.tile_for(m, n)["index"] == index


@pytest.mark.parametrize("m, n, refused, index", [
    (4, 4096, (), 1),                   # nothing refused: the first tile serving M and N
    (4, 4096, (1,), 2),                 # refused: the next tile serving M and N
    (4, 20_000, (0,), 1),               # the wide tile refused: the bucket's tile for every N
    (4, 4096, (1, 2), 3),
    (4, 4096, (1, 2, 3), 3),            # every tile refused: the last
    (100, None, (), 3),
])
def test_tile_for_passes_over_refused_tiles(m, n, refused, index):
    import dataclasses
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")
    asked = []

    def refusal(params, call):
        assert (call.m, call.n) == (m, n)
        asked.append(params["index"])
        return "refused" if params["index"] in refused else None

    tiled = dataclasses.replace(entry, tiles=_buckets((8, 16384), (8, None), (16, None), (None, None)),
                                modules={"tested": types.SimpleNamespace(refusal_reason=refusal)})
    assert tiled.tile_for(m, n, registry.Call(m=m, n=n))["index"] == index
    assert all(tiled.tiles[i].serves(m, n) for i in asked), "only tiles serving M and N are asked"


def test_explain_shows_the_tile_n_picks():
    entry = registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_90")
    wide = [i for i, bucket in enumerate(entry.tiles) if bucket.n_min is not None]
    assert wide, "the sm_90 prepared GPTQ variant tiles its last M bucket by N"
    bucket = entry.tiles[wide[0]]
    m = bucket.m_max or 4096
    text = registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=m, n=bucket.n_min)
    assert f"tile bucket {wide[0]}:" in text and f"n={bucket.n_min}" in text
    narrow = registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=m, n=bucket.n_min - 1)
    assert f"tile bucket {wide[0]}:" not in narrow


def test_decode_and_prefill_tiles_differ():
    entry = registry.select("fp8_gemm", FP8_SCHEME, arch="sm_89")
    assert entry.tile_for(1)["BLOCK_M"] < entry.tile_for(4096)["BLOCK_M"]


def test_kdsl_arch_env_forces_the_arch(monkeypatch):
    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    registry.reset()
    assert registry.device_arch() == 90
    assert registry.select("fp8_gemm", FP8_SCHEME).name == TMA
    assert registry.dispatch("fp8_gemm", FP8_SCHEME.name, torch.device("cpu")).name == TMA

    monkeypatch.setenv("KDSL_ARCH", "sm_89")
    registry.reset()
    assert registry.select("fp8_gemm", FP8_SCHEME).name == PORTABLE


def test_env_is_read_once_until_reset(monkeypatch):
    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    registry.reset()
    assert registry.select("fp8_gemm", FP8_SCHEME).name == TMA
    monkeypatch.setenv("KDSL_ARCH", "sm_89")
    assert registry.select("fp8_gemm", FP8_SCHEME).name == TMA  # cached settings
    registry.reset()
    assert registry.select("fp8_gemm", FP8_SCHEME).name == PORTABLE


def test_bad_kdsl_arch(monkeypatch):
    monkeypatch.setenv("KDSL_ARCH", "hopper")
    registry.reset()
    with pytest.raises(ValueError, match="KDSL_ARCH"):
        registry.select("fp8_gemm", FP8_SCHEME)


def test_cpu_tensors_select_the_interpreter_tier():
    assert registry.device_arch(torch.device("cpu")) == 89
    assert registry.dispatch("fp8_gemm", FP8_SCHEME.name, torch.device("cpu")).name == PORTABLE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_no_device_and_no_arch_is_a_clear_error():
    with pytest.raises(RuntimeError, match="KDSL_ARCH"):
        registry.select("fp8_gemm", FP8_SCHEME)


@pytest.mark.parametrize("pattern", [TMA, "*tma_persistent*", "fp8_gemm__*_sm90"])
def test_kdsl_disable_falls_back_to_portable(monkeypatch, pattern):
    monkeypatch.setenv("KDSL_DISABLE", f"something_else, {pattern}")
    registry.reset()
    assert registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90").name == PORTABLE
    text = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_90")
    tma_line = next(line for line in text.splitlines() if TMA in line)
    assert "disabled by KDSL_DISABLE" in tma_line


def test_kdsl_disable_everything(monkeypatch):
    monkeypatch.setenv("KDSL_DISABLE", "fp8_gemm__*")
    registry.reset()
    with pytest.raises(kdsl.NoKernelError, match="disabled by KDSL_DISABLE"):
        registry.select("fp8_gemm", FP8_SCHEME, arch="sm_90")


def test_unknown_scheme_lists_scheme_refusals():
    wanted = "block_fp8.e4m3.w64x64.a64.f32"
    with pytest.raises(kdsl.NoKernelError) as info:
        registry.select("fp8_gemm", wanted, arch="sm_90")
    message = str(info.value)
    assert wanted in message
    assert PORTABLE in message and TMA in message
    assert "refused: scheme block_fp8.e4m3.w128x128.a128.f32" in message


def test_other_block_fp8_scheme_object_is_refused():
    with pytest.raises(kdsl.NoKernelError, match="refused: scheme"):
        registry.select("fp8_gemm", kdsl.BlockFP8(weight_block=(64, 64), act_group=64), arch="sm_90")


def test_unknown_op():
    with pytest.raises(kdsl.NoKernelError, match="fp4_gemm") as info:
        registry.select("fp4_gemm", FP8_SCHEME, arch="sm_90")
    assert info.value.refusals == []


def test_bad_scheme_type():
    with pytest.raises(TypeError, match="scheme"):
        registry.select("fp8_gemm", 42, arch="sm_90")


def test_dispatch_caches_the_entry():
    cpu = torch.device("cpu")
    first = registry.dispatch("fp8_gemm", FP8_SCHEME.name, cpu)
    second = registry.dispatch("fp8_gemm", FP8_SCHEME.name, cpu)
    assert first is second
    assert first is registry.select("fp8_gemm", FP8_SCHEME, arch=89)
    registry.reset()
    third = registry.dispatch("fp8_gemm", FP8_SCHEME.name, cpu)
    assert third.name == first.name


def test_entries_cover_the_manifest():
    names = {e.name for e in registry.entries()}
    assert {TMA, PORTABLE} <= names
    for entry in registry.entries():
        assert entry.module_path.is_file(), entry.name


def test_entry_loads_its_module_lazily_and_once():
    entry = registry.select("weight_dequant", FP8_SCHEME, arch="sm_89")
    module = entry.load()
    assert entry.load() is module
    assert callable(entry.launch)


def _cli(repo_root, *args):
    return subprocess.run([sys.executable, "-m", "kdsl", *args], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)


def test_cli_list(repo_root):
    result = _cli(repo_root, "list")
    assert result.returncode == 0, result.stderr
    for entry in registry.entries():
        assert entry.name in result.stdout
    result = _cli(repo_root, "list", "--op", "fp8_gemm")
    assert result.returncode == 0, result.stderr
    assert TMA in result.stdout and PORTABLE in result.stdout
    assert "act_quant__" not in result.stdout


def test_cli_explain(repo_root):
    result = _cli(repo_root, "explain", "fp8_gemm", "--arch", "sm_90", "--m", "1")
    assert result.returncode == 0, result.stderr
    chosen_line = next(line for line in result.stdout.splitlines() if "CHOSEN" in line)
    assert TMA in chosen_line and "tile bucket 0" in chosen_line
    assert PORTABLE in result.stdout


def test_cli_explain_bad_arch(repo_root):
    result = _cli(repo_root, "explain", "fp8_gemm", "--arch", "hopper")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr


def test_prepared_gptq_has_hopper_tiles_and_a_fallback_range():
    """The shipped definition tunes w4a16_gemm for sm_90 and keeps an sm_80+ variant."""
    hopper = registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_90")
    ampere = registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_86")
    assert hopper.name.endswith("_sm90") and ampere.name.endswith("_sm80")
    assert registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_100").name == ampere.name
    assert hopper.tile_for(1)["BLOCK_M"] == 1 and hopper.tile_for(1)["impl"] == "gemv_mma_gluon"  # the GEMV bucket


def test_explain_shows_the_tiles_the_kernel_passes_over_at_run_time():
    """Group 64 changes inside the k_planes GEMV's 128-row plane tiles: at M = 4 the mma.sync GEMV tile refuses,
    and explain names it, its reason, and the MMA tile that runs instead (the one kdsl.ops launches)."""
    entry = registry.select("w4a16_gemm", "w4a16.int4.g64", arch="sm_90")
    gemv = entry.bucket_index(4, 4096)
    assert entry.tiles[gemv].params["impl"] == "gemv_mma_gluon"
    text = registry.explain("w4a16_gemm", "w4a16.int4.g64", arch="sm_90", m=4, n=4096)
    runs = entry.tile_for(4, 4096, registry.Call(m=4, n=4096))
    ran = next(i for i, bucket in enumerate(entry.tiles) if bucket.params is runs)
    assert ran != gemv
    # The module serves every group size: explain names it with the group size this kernel passes.
    assert (f"CHOSEN (sm_90..sm_90), tile bucket {ran}: planes_mma (w4a16_gemm__int4__planes_mma_sm90, "
            "GROUP_SIZE=64)") in text
    assert f"tile bucket {gemv} (gemv_mma_gluon) passed over at run time" in text and "plane tile" in text
    plain = registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=4, n=4096)
    assert f"tile bucket {gemv}:" in plain and "passed over" not in plain


# --- which path runs: generated kernel, Triton interpreter, torch fallback --------------------------------------

def test_run_path_names_what_the_ops_run(monkeypatch):
    assert registry.run_path(torch.device("cuda")) == "generated kernel"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.run_path("cpu") == "Triton interpreter"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert registry.run_path("cpu") == "torch fallback"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert registry.run_path(torch.device("cpu")) == "torch fallback"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line for a machine without a CUDA device")
@pytest.mark.parametrize("interpret", [True, False])
def test_explain_says_what_runs_on_this_machine(interpret, monkeypatch):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    last = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_90", m=1).splitlines()[-1]
    if interpret:
        assert last == ("  on this machine (no CUDA device): CPU tensors run the generated kernels selected for sm_89 "
                        "through Triton's interpreter (TRITON_INTERPRET=1)")
    else:
        assert last == ("  on this machine (no CUDA device): CPU tensors run the torch fallback, no generated kernel "
                        "(TRITON_INTERPRET=1 runs the kernels selected for sm_89 through Triton's interpreter)")
    monkeypatch.setenv(registry.FORCE_ARCH_ENV, "sm_90")
    registry.reset()
    assert "selected for sm_90" in registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_89").splitlines()[-1]


@pytest.mark.gpu
def test_explain_on_a_gpu_names_its_arch():
    major, minor = torch.cuda.get_device_capability()
    last = registry.explain("fp8_gemm", FP8_SCHEME, arch="sm_89").splitlines()[-1]
    assert last.startswith(f"  on this machine: CUDA tensors run the generated kernels selected for sm_{major}{minor};")


def test_schemes_sharing_a_module_launch_its_kernel_with_their_own_constexprs():
    """One module serves every GPTQ group size and checkpoint format: two schemes' kernels launch the same @jit
    kernel, each with its own GROUP_SIZE and ZERO_OFFSET (constexprs, which the launcher's compiled-kernel cache keys
    on, so each gets its own binary as each copied module did)."""
    g128 = registry.select("gptq_dequant", "gptq.int4.g128.gptq", arch="sm_80")
    g32 = registry.select("gptq_dequant", "gptq.int4.g32.gptq_v2", arch="sm_80")
    assert g128.name != g32.name and g128.module_path == g32.module_path
    k, n = 256, 64
    qweight = torch.zeros((k // 8, n), dtype=torch.int32)
    w = torch.empty((n, k), dtype=torch.float16)
    launches = []
    for entry in (g128, g32):
        groups = k // entry.constexprs["GROUP_SIZE"]
        qzeros, scales = torch.zeros((groups, n // 8), dtype=torch.int32), torch.ones((groups, n), dtype=torch.float16)
        module = entry.modules[entry.impl]
        launches.append(module.unit.launch(module.generated(), qweight, qzeros, scales, None, w, entry.tile_for(None)))
    assert launches[0].kernel is launches[1].kernel
    assert {name: launches[0].constexprs[name] for name in ("GROUP_SIZE", "ZERO_OFFSET")} == {"GROUP_SIZE": 128,
                                                                                            "ZERO_OFFSET": 1}
    assert {name: launches[1].constexprs[name] for name in ("GROUP_SIZE", "ZERO_OFFSET")} == {"GROUP_SIZE": 32,
                                                                                            "ZERO_OFFSET": 0}
