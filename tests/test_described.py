"""A unit's launch from its one launch description (kdsl.kernels.described): what Python adds to the expressions
the C dispatcher compiles, checked on meta tensors (the GPU's paths, nothing launched) and CPU ones (the
interpreter's)."""
import pytest
import torch

from kdsl.runtime import registry


def _w4a16_entry(impl: str):
    """The sm_90 w4a16_gemm entry (k_planes, paired) for group 128 and one of its tiles naming `impl`."""
    for entry in registry.entries():
        if entry.op == "w4a16_gemm" and entry.scheme.startswith("w4a16.int4.g128") and entry.min_arch == 90:
            for bucket in entry.tiles:
                if bucket.params["impl"] == impl:
                    return entry, bucket.params
    raise AssertionError(f"no sm_90 w4a16_gemm tile names {impl}")


def _w4a16_call(m: int, n: int, k: int, device: str, perm: bool = False):
    """w4a16_gemm's launch arguments in the k_planes layout with paired (scale, zero) halves."""
    x = torch.empty(m, k, dtype=torch.float16, device=device)
    qweight = torch.empty(n // 128, k // 128, 128, 16, dtype=torch.int32, device=device)
    pairs = torch.empty(k // 128, 2 * n, dtype=torch.float16, device=device)
    groups = torch.empty(k, dtype=torch.int32, device=device)
    y = torch.empty(m, n, dtype=torch.float16, device=device)
    order = torch.empty(k, dtype=torch.int32, device=device) if perm else None
    return x, order, qweight, pairs[:, 1::2], pairs[:, 0::2], groups, True, y


def _launch(entry, tile, args):
    module = entry.modules[tile["impl"]]
    return module.unit.launch(module.generated(), *args, tile)


def test_a_view_of_another_element_type_starts_at_the_argument():
    """The Gluon GEMV reads the (scale, zero) pairs as int32: Python passes a view of the scales' memory in that
    type, at the scales' address, and the row stride in int32 words (the description's div(lds, 2))."""
    entry, tile = _w4a16_entry("gemv_mma_gluon")
    args = _w4a16_call(4, 4096, 4096, "meta")
    launch = _launch(entry, tile, args)
    scales = args[4]
    pairs = launch.params[3]
    assert pairs.dtype == torch.int32 and pairs.data_ptr() == scales.data_ptr()
    assert launch.params[8] == scales.stride(0) // 2
    assert launch.grid == (4096 // 16, 1, 1) and launch.constexprs["K"] == 4096


def test_a_call_the_kernel_would_compute_wrongly_is_refused():
    """overlap_gluon's TMA loads of x cannot follow act-order's permutation: its description's `raises` refuses the
    call on every device, before anything is launched (never a silently unpermuted product)."""
    entry, tile = _w4a16_entry("overlap_gluon")
    for device in ("meta", "cpu"):
        with pytest.raises(ValueError, match="perm: w4a16_gemm/overlap_gluon takes no act-order permutation"):
            _launch(entry, tile, _w4a16_call(64, 4096, 4096, device, perm=True))


def test_the_interpreter_gets_its_own_constexprs_and_no_sm_count():
    """On the CPU (Triton's interpreter) the description's `interpreted` constexprs replace the GPU's (fp32 math,
    no inline PTX), and with no SM count a K split takes the tile's cap; on the GPU's path (meta) the same call
    keeps the GPU's constexprs and splits for the device's SMs."""
    entry, tile = _w4a16_entry("planes_mma")
    tile = {**tile, "SPLIT_K": 4}
    gpu = _launch(entry, tile, _w4a16_call(16, 4096, 4096, "meta"))
    cpu = _launch(entry, tile, _w4a16_call(16, 4096, 4096, "cpu"))
    assert gpu.constexprs["FP32_MATH"] is False and gpu.constexprs["ASM_DEQUANT"] is True
    assert gpu.constexprs["SCALE_AFTER"] is (tile["BLOCK_M"] <= 16)
    assert cpu.constexprs["FP32_MATH"] is True and cpu.constexprs["ASM_DEQUANT"] is False
    assert cpu.constexprs["SCALE_AFTER"] is False
    assert cpu.constexprs["SPLIT_K"] == 4 and cpu.grid[1] == 4  # the cap: 32 K steps allow 4


def test_a_split_launch_gets_the_split_k_scratch():
    """With a K split the workspace and counters parameters are the kernel's scratch (sized by the description's
    expressions); without one they are the output itself, as the C dispatcher passes it."""
    entry, tile = _w4a16_entry("planes_mma")
    args = _w4a16_call(16, 4096, 4096, "cpu")
    y = args[-1]
    split = _launch(entry, {**tile, "SPLIT_K": 4}, args)
    ws, counters = split.params[7], split.params[8]
    tiles = split.grid[0]
    assert ws.dtype == torch.float32 and ws.numel() >= tiles * 4 * tile["BLOCK_M"] * tile["BLOCK_N"]
    assert counters.dtype == torch.int32 and counters.numel() >= tiles
    whole = _launch(entry, {**tile, "SPLIT_K": 1}, args)
    assert whole.constexprs["SPLIT_K"] == 1 and whole.params[7] is y and whole.params[8] is y


def test_a_pdl_tile_gets_its_launch_attribute_off_the_interpreter_only(monkeypatch):
    """fp8_bmm's pdl tiles: on the GPU's path the kernel takes PDL and the launch attribute Triton's launcher
    reads; under the interpreter, which has no grid dependency control, it launches as an ordinary kernel."""
    from kdsl.kernels import host

    entry = registry.select("fp8_bmm", arch=90)
    tile = next((b.params for b in entry.tiles if b.params["impl"] == "tma_persistent" and b.params.get("pdl")), None)
    if tile is None:
        pytest.skip("no sm_90 fp8_bmm tile takes pdl")

    def call(device):
        a = torch.empty(16, 128, 128, dtype=torch.float8_e4m3fn, device=device).transpose(0, 1)
        a_s = torch.empty(16, 128, 1, device=device).transpose(0, 1)
        b = torch.empty(128, 512, 128, dtype=torch.float8_e4m3fn, device=device)
        b_s = torch.empty(128, 4, 1, device=device)
        c = torch.empty(128, 16, 512, dtype=torch.bfloat16, device=device)
        return a, a_s, b, b_s, c

    with monkeypatch.context() as gpu_process:  # this test process runs Triton's interpreter: a GPU one does not
        gpu_process.setattr(host, "INTERPRETING", False)
        gpu = _launch(entry, tile, call("meta"))
    assert gpu.constexprs["PDL"] is True and gpu.constexprs["launch_pdl"] is True
    cpu = _launch(entry, tile, call("cpu"))
    assert cpu.constexprs["PDL"] is False and "launch_pdl" not in cpu.constexprs


def test_a_releasing_kernel_releases_where_the_device_can_launch_dependents(monkeypatch):
    """The sm_90 W4A16 GEMMs' descriptions say `releases`: Python sets their RELEASE constexpr where the device can
    launch dependents (sm_90+; not the interpreter, not a device that cannot), the exporter by the spec's arch."""
    from kdsl.aot import plan as aot_plan
    from kdsl.kernels import host

    entry, tile = _w4a16_entry("gemv_mma_gluon")
    with monkeypatch.context() as sm90:
        sm90.setattr(host, "dependent_launches", lambda device: True)
        assert _launch(entry, tile, _w4a16_call(1, 4096, 4096, "meta")).constexprs["RELEASE"] is True
    with monkeypatch.context() as older:
        older.setattr(host, "dependent_launches", lambda device: False)
        assert _launch(entry, tile, _w4a16_call(1, 4096, 4096, "meta")).constexprs["RELEASE"] is False

    releasing = {"gemv_mma_gluon", "planes_mma", "overlap_gluon"}
    exported = aot_plan.plan([90], ops=["w4a16_gemm"], dtypes=["f16"], generic_only=True)
    specs = [spec for spec in exported.specs if spec.impl in releasing]
    assert {spec.impl for spec in specs} == releasing
    assert all(spec.constexprs["RELEASE"] is True for spec in specs)
    others = [spec for spec in exported.specs if spec.impl not in releasing]
    assert others and all("RELEASE" not in spec.constexprs for spec in others)


def test_rms_norm_is_a_dependent_launch_that_releases_on_sm90(monkeypatch):
    """rms_norm / add_rms_norm wait for the kernel before them and release the one after where the device can
    launch dependents, and launch as ordinary kernels elsewhere (the interpreter)."""
    from kdsl.kernels import host
    from kdsl.kernels.block_fp8.rms_norm import launch_add_rms_norm

    entry = registry.select("add_rms_norm", arch=90)
    generated = entry.modules[entry.impl].generated()

    def launch(device):
        x = torch.empty(2, 4096, dtype=torch.bfloat16, device=device)
        return launch_add_rms_norm(generated, x, torch.empty_like(x), torch.empty(4096, dtype=torch.bfloat16,
                                   device=device), torch.empty_like(x), torch.empty_like(x), 1e-5, False,
                                   entry.tile_for(2))

    with monkeypatch.context() as sm90:
        sm90.setattr(host, "dependent_launches", lambda device: True)
        gpu = launch("meta").constexprs
    assert gpu["PDL"] is True and gpu["RELEASE"] is True and gpu["launch_pdl"] is True
    cpu = launch("cpu").constexprs
    assert cpu["PDL"] is False and cpu["RELEASE"] is False and "launch_pdl" not in cpu


def test_a_value_the_description_names_but_the_call_lacks_is_named():
    """A description naming an argument its op's `values` does not give fails naming it and the module, not with
    a bare KeyError from deep inside the evaluation."""
    from dataclasses import replace

    from kdsl.kernels import described

    entry = registry.select("fp8_gemm", arch=89)
    assert entry.impl == "portable"
    module, tile = entry.modules[entry.impl], entry.tiles[0].params
    description = module.unit.launch_descriptions[""]
    broken = replace(description, grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N}) * heads", "1", "1"))
    a = torch.empty(16, 256, dtype=torch.float8_e4m3fn, device="meta")
    values = description.values(a, torch.empty(16, 2, device="meta"),
                                torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                torch.empty(2, 2, device="meta"), torch.empty(16, 256, dtype=torch.bfloat16,
                                                                              device="meta"))
    with pytest.raises(KeyError, match="names 'heads'"):
        described.evaluate(broken, module.generated(), values, tile)
