"""kdsl.ops.w4a16_dequant, and w4a16_gemm's dequantize + cuBLAS path from its variant's dequant_min_m rows up
(issue 47), on the CPU: generated kernels in Triton's interpreter against tests/reference_gptq.py.

Layouts: checkpoint-order words with biased zeros (the sm_80 variant, selected for sm_89 as the interpreter
does), k_planes with paired zeros (the sm_90 variant, KDSL_ARCH=sm_90), and, from a small definition of our own
added to the registry, checkpoint words with packed zeros and k_planes with biased zeros. The reference
dequantizes the checkpoint in fp32 (w[k, n] = (q - zero) * scale); w4a16_dequant returns it in the prepared K
order, rounded once to the activation dtype: bit for bit in fp16, within one bf16 ulp in bf16 (the interpreter
truncates fp32 -> bf16). GPU checks are marked gpu at the end.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kdsl
import reference_gptq as ref
from conftest import wrap_launch
from kdsl import ops
from kdsl.schema import DefinitionError, parse_definition

TOL = 1e-2
LAYOUT_ARCH = {"checkpoint": "sm_89", "k_planes": "sm_90"}  # as tests/test_gptq_prepare.py selects them
GROUPS = [(128, "none"), (128, "perm"), (64, "perm"), (64, "random"), (32, "none"), (32, "perm"), (-1, "none"),
          (-1, "perm")]


@pytest.fixture(params=list(LAYOUT_ARCH))
def weights_layout(request, monkeypatch):
    monkeypatch.setenv("KDSL_ARCH", LAYOUT_ARCH[request.param])
    kdsl.registry.reset()
    yield request.param
    kdsl.registry.reset()


def _checkpoint(k, n, group_size, g_idx, dtype=torch.float16, fmt="gptq"):
    return ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=fmt, g_idx=g_idx, scale_dtype=dtype)


def _prepare(ck, group_size, fmt="gptq"):
    return ops.gptq_prepare(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size,
                            checkpoint_format=fmt)


def _expected_w(ck, prepared, group_size, fmt="gptq") -> torch.Tensor:
    """fp32 [N, K]: the reference weight, K in the prepared order (prepared row k is checkpoint row perm[k])."""
    w = ref.dequant_ref(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size,
                        checkpoint_format=fmt)  # [K, N]
    if prepared.perm is not None:
        w = w[prepared.perm.long()]
    return w.T


def assert_rounded_once(w: torch.Tensor, expected: torch.Tensor) -> None:
    """w is expected (fp32) rounded to w's dtype: exactly in fp16, within one ulp in bf16 (interpreter truncation)."""
    assert w.shape == expected.shape and w.is_contiguous()
    if w.dtype == torch.float16:
        assert torch.equal(w, expected.to(torch.float16))
    else:
        assert torch.all((w.float() - expected).abs() <= expected.abs() * 2.0**-7)


def _ref_gemm(x, ck, group_size, fmt="gptq"):
    return ref.gemm_ref(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], group_size=group_size,
                        checkpoint_format=fmt)


def _gemm_entry(prepared):
    return kdsl.registry.dispatch("w4a16_gemm", prepared.scheme, prepared.device)


def _min_m(prepared) -> int:
    return _gemm_entry(prepared).dequant["min_m"]


# ---------------------------------------------------------------------------------------------
# w4a16_dequant


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, g_idx", GROUPS)
def test_dequant_matches_the_reference(group_size, g_idx, dtype, weights_layout):
    # K = 384: three 128-row tiles; N = 200: not a multiple of the 128-column tile (k_planes pads, stores mask)
    ck = _checkpoint(384, 200, group_size, g_idx, dtype)
    prepared = _prepare(ck, group_size)
    assert prepared.layout["weights"] == weights_layout
    assert (prepared.perm is not None) == (g_idx in ("perm", "random") and group_size != -1)
    w = ops.w4a16_dequant(prepared)
    assert w.dtype == dtype and w.shape == (200, 384)
    assert_rounded_once(w, _expected_w(ck, prepared, group_size))
    # What the op documents: x gathered by perm, times w.T, is the GEMM
    x = torch.randn(3, 384).to(dtype)
    xs = x if prepared.perm is None else x.index_select(1, prepared.perm)
    assert ref.rel_fro_error(xs.float() @ w.float().T, _ref_gemm(x, ck, group_size)) < TOL


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_dequant_formats_and_awq(fmt, weights_layout):
    ck = _checkpoint(256, 64, 64, "perm", fmt=fmt)
    prepared = _prepare(ck, 64, fmt)
    assert_rounded_once(ops.w4a16_dequant(prepared), _expected_w(ck, prepared, 64, fmt))
    # AWQ prepares into the same layout: its dequant matches awq_dequant's [N, K]
    qweight = torch.randint(-2**31, 2**31 - 1, (256, 8), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (4, 8), dtype=torch.int32)
    scales = (torch.rand(4, 64) * 0.02 + 0.001).half()
    awq = ops.awq_prepare(qweight, qzeros, scales, group_size=64)
    assert torch.equal(ops.w4a16_dequant(awq), ops.awq_dequant(qweight, qzeros, scales, group_size=64))


def test_dequant_runs_its_kernel_and_the_fallback_agrees(weights_layout, launched, monkeypatch):
    ck = _checkpoint(256, 72, 128, "perm")
    prepared = _prepare(ck, 128)
    w = ops.w4a16_dequant(prepared)
    arch = 90 if weights_layout == "k_planes" else 80
    assert launched == [f"w4a16_dequant__int4_g128__blockwise_sm{arch}"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors: the torch fallback, no generated kernel
    assert torch.equal(ops.w4a16_dequant(prepared), w)
    assert launched == [f"w4a16_dequant__int4_g128__blockwise_sm{arch}"]


def test_dequant_checks(weights_layout):
    ck = _checkpoint(256, 40, 64, "none")
    prepared = _prepare(ck, 64)
    with pytest.raises(TypeError, match="prepared: expected weights from kdsl.ops.gptq_prepare"):
        ops.w4a16_dequant(ck["qweight"])
    stale = type(prepared)(**{**prepared.__dict__, "layout": {"zeros": "packed", "weights": "checkpoint"}})
    with pytest.raises(ValueError, match="prepare them again"):
        ops.w4a16_dequant(stale)


# ---------------------------------------------------------------------------------------------
# w4a16_gemm: dequantize + cuBLAS from dequant_min_m rows up


def test_definition_declares_the_threshold_per_arch():
    for arch, layout in (("sm_90", {"zeros": "paired", "weights": "k_planes"}),
                         ("sm_80", {"zeros": "biased", "weights": "checkpoint"})):
        gemm = kdsl.registry.select("w4a16_gemm", "w4a16.int4.g128", arch=arch)
        assert gemm.dequant == {"op": "w4a16_dequant", "min_m": 1024, "max_n": 8192}
        dequant, why = kdsl.registry.dequant_for(gemm, int(arch[3:]))
        assert why == "" and dequant.op == "w4a16_dequant" and dequant.layout == layout == gemm.layout


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, g_idx", [(128, "none"), (64, "perm"), (32, "random"), (-1, "perm")])
def test_gemm_above_the_threshold_dequantizes_then_multiplies(group_size, g_idx, dtype, weights_layout, launched):
    ck = _checkpoint(256, 80, group_size, g_idx, dtype)
    prepared = _prepare(ck, group_size)
    min_m = _min_m(prepared)
    x = torch.randn(2, min_m // 2, 256).to(dtype)  # leading dims: min_m rows in all
    y = ops.gptq_gemm(x, prepared)
    assert y.shape == (2, min_m // 2, 80) and y.dtype == dtype
    assert ref.rel_fro_error(y, _ref_gemm(x, ck, group_size)) < TOL
    arch = 90 if weights_layout == "k_planes" else 80
    assert launched == [f"w4a16_dequant__{prepared.scheme.split('.', 1)[1].replace('.', '_')}__blockwise_sm{arch}"]
    # the same product as the op's own dequant then torch.matmul, bit for bit; with act-order, on w's columns put
    # back in the checkpoint's order (x is not gathered), w [K, N] row-major as the op writes it
    w = ops.w4a16_dequant(prepared)
    if prepared.perm is None:
        expected = torch.mm(x.reshape(-1, 256), w.t())
    else:
        w_checkpoint_order = torch.empty_like(w)
        w_checkpoint_order[:, prepared.perm.long()] = w
        expected = torch.mm(x.reshape(-1, 256), w_checkpoint_order.t().contiguous())
    assert torch.equal(y.reshape(-1, 80), expected)


def test_gemm_below_the_threshold_and_without_a_dequantizer_runs_the_gemm(weights_layout, launched, monkeypatch):
    ck = _checkpoint(256, 80, 128, "perm")
    prepared = _prepare(ck, 128)
    x = torch.randn(33, 256).half()
    assert ref.rel_fro_error(ops.w4a16_gemm(x, prepared), _ref_gemm(x, ck, 128)) < TOL
    assert launched and not any(name.startswith("w4a16_dequant") for name in launched)
    # Dequantizers disabled: the GEMM tiles serve every M, and explain says so
    monkeypatch.setenv("KDSL_DISABLE", "w4a16_dequant*")
    kdsl.registry.reset()
    launched.clear()
    assert "no dequantize + cuBLAS path from M = 1024 up" in kdsl.registry.explain(
        "w4a16_gemm", prepared.scheme, arch=LAYOUT_ARCH[weights_layout], m=2048, n=80)
    x = torch.randn(_min_m(prepared), 256).half()
    assert ref.rel_fro_error(ops.w4a16_gemm(x, prepared), _ref_gemm(x, ck, 128)) < TOL
    assert launched and not any(name.startswith("w4a16_dequant") for name in launched)


def test_explain_shows_the_choice(capsys):
    text = kdsl.registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=2048, n=4096)
    assert ("w4a16_gemm__int4_g128__planes_mma_sm90: CHOSEN (sm_90..sm_90), M = 2048 >= dequant_min_m = 1024: "
            "dequantize + cuBLAS, no GEMM tile runs") in text
    assert "w4a16_dequant__int4_g128__blockwise_sm90 (w4a16_dequant/blockwise)" in text
    assert "torch.matmul(x, w.T)" in text
    below = kdsl.registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_80", m=16, n=4096)
    assert "tile bucket 1: mma" in below
    assert ("from M = 1024 up (dequant_min_m), N <= 8192 (dequant_max_n): dequantize + cuBLAS instead "
            "(w4a16_dequant__int4_g128__blockwise_sm80") in below
    from kdsl.cli import main
    assert main(["explain", "w4a16_gemm", "--arch", "sm_90", "--m", "2048"]) == 0
    assert "dequantize + cuBLAS, no GEMM tile runs" in capsys.readouterr().out


def test_compiled_op_takes_the_same_path(monkeypatch, launched):
    """Under torch.compile the prepared GEMM is one opaque op; its implementation takes the dequant path inside."""
    import torch._dynamo.testing

    monkeypatch.setenv("KDSL_ARCH", "sm_90")
    kdsl.registry.reset()
    ck = _checkpoint(256, 80, 64, "perm")
    prepared = _prepare(ck, 64)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x: ops.w4a16_gemm(x, prepared) * 2, backend=counter, fullgraph=True)
    x = torch.randn(_min_m(prepared), 256).half()
    torch._dynamo.reset()
    got = fn(x)
    assert torch.equal(got, ops.w4a16_gemm(x, prepared) * 2)
    assert counter.frame_count == 1
    assert launched == ["w4a16_dequant__int4_g64__blockwise_sm90"] * 2
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Other layouts and thresholds, from a definition of our own


def _definition(layout: str, min_m: int, arch: str) -> str:
    arch_range = f'min_arch = "{arch}"' + (f'\nmax_arch = "{arch}"' if arch == "sm_90" else "")
    impl = "planes_mma" if "k_planes" in layout else "mma"
    return f"""
description = "test: w4a16 dequant path on another layout"

[[schemes]]
kind = "w4a16"
group_size = 64

[[variants]]
op = "w4a16_gemm"
impl = "{impl}"
{arch_range}
layout = {layout}
dequant_min_m = {min_m}
tiles = [
  {{ m_max = 16, block_m = 16, block_n = 64, block_k = 128, num_warps = 4 }},
  {{ block_m = 32, block_n = 64, block_k = 128, num_warps = 4 }},
]

[[variants]]
op = "w4a16_dequant"
impl = "blockwise"
{arch_range}
layout = {layout}
tiles = [{{ block_n = 64, block_k = 128, num_warps = 4 }}]
"""


@pytest.fixture(params=[('{ zeros = "packed" }', "sm_89", {"zeros": "packed", "weights": "checkpoint"}),
                        ('{ zeros = "biased", weights = "k_planes" }', "sm_90", {"zeros": "biased", "weights": "k_planes"})],
                ids=["checkpoint-packed", "k_planes-biased"])
def own_kernels(request, tmp_path, monkeypatch):
    """Our definition generated into a folder the registry picks from: its sm_89 kernels rank above the shipped
    sm_80 ones, its sm_90 kernels shadow the shipped ones of the same name. Yields the layout prepared for."""
    layout, arch, prepared_layout = request.param
    defs = tmp_path / "defs"
    defs.mkdir()
    (defs / "w4a16.toml").write_text(_definition(layout, 40, arch))
    from kdsl.cli import main
    assert main(["generate", "--defs", str(defs), "--out", str(tmp_path / "out")]) == 0
    monkeypatch.setenv("KDSL_ARCH", arch)
    kdsl.registry.add_generated(tmp_path / "out")
    yield prepared_layout
    kdsl.registry.remove_generated(tmp_path / "out")


@pytest.mark.parametrize("g_idx", ["none", "perm", "random"])
def test_other_layouts_and_a_threshold_of_our_own(own_kernels, g_idx, monkeypatch):
    ck = _checkpoint(256, 72, 64, g_idx)
    prepared = _prepare(ck, 64)
    assert prepared.layout == own_kernels
    assert_rounded_once(ops.w4a16_dequant(prepared), _expected_w(ck, prepared, 64))
    launches = []  # conftest's `launched`, for the kernels added after it would have wrapped the shipped ones
    kdsl.registry.plans.clear()
    monkeypatch.setattr(kdsl.ops._plan, "RECORD", False)
    for entry in kdsl.registry.entries():
        for kernel_module in entry.modules.values():
            def spy(original, _name=kernel_module.path.stem):
                def launch(*args, **kwargs):
                    launches.append(_name)
                    return original(*args, **kwargs)
                return launch

            wrap_launch(monkeypatch, kernel_module, spy)
    for m in (39, 40):  # dequant_min_m = 40: 39 rows take the GEMM tile, 40 the dequantizer
        launches.clear()
        x = torch.randn(m, 256).half()
        assert ref.rel_fro_error(ops.w4a16_gemm(x, prepared), _ref_gemm(x, ck, 64)) < TOL
        assert [name.startswith("w4a16_dequant") for name in launches] == [m == 40], launches


# ---------------------------------------------------------------------------------------------
# The definition's rules for dequant_min_m

SCHEME = '[[schemes]]\nkind = "w4a16"\ngroup_size = 128\n'
GEMM = ('[[variants]]\nop = "w4a16_gemm"\nimpl = "mma"\nmin_arch = "sm_80"\nlayout = { zeros = "biased" }\n'
        'dequant_min_m = 512\ntiles = [{ block_m = 64, block_n = 64, block_k = 128 }]\n')
DEQUANT = ('[[variants]]\nop = "w4a16_dequant"\nimpl = "blockwise"\nmin_arch = "sm_80"\nlayout = { zeros = "biased" }\n'
           'tiles = [{ block_n = 128, block_k = 128 }]\n')


def _problems(text: str) -> str:
    with pytest.raises(DefinitionError) as error:
        parse_definition("defs/w4a16.toml", text)
    return str(error.value)


def test_schema_rules_for_dequant_min_m():
    assert parse_definition("defs/w4a16.toml", SCHEME + GEMM + DEQUANT).definition.variants[0].dequant_min_m == 512
    assert ("variants[0].dequant_min_m: needs a w4a16_dequant variant with min_arch = 'sm_80' and the same layout "
            "in this definition") in _problems(SCHEME + GEMM)
    assert "variants[0].dequant_min_m: variants[1] (w4a16_dequant) reads layout { zeros = \"packed\"" in _problems(
        SCHEME + GEMM + DEQUANT.replace('"biased"', '"packed"'))
    assert "needs a w4a16_dequant variant with min_arch = 'sm_80'" in _problems(
        SCHEME + GEMM + DEQUANT.replace('min_arch = "sm_80"', 'min_arch = "sm_86"'))
    assert "dequant_min_m" in _problems(SCHEME + GEMM.replace("512", "0") + DEQUANT)
    gptq = ('[[schemes]]\nkind = "gptq"\ngroup_size = 128\n[[variants]]\nop = "gptq_gemm"\nimpl = "splitk"\n'
            'min_arch = "sm_80"\ndequant_min_m = 512\ntiles = [{ block_m = 64 }]\n')
    assert "variants[0].dequant_min_m: gptq_gemm has no dequantize + cuBLAS path" in _problems(gptq)
    assert "block_k: 64; the k_planes layout's tiles take block_k = 128" in _problems(
        SCHEME + DEQUANT.replace('{ zeros = "biased" }', '{ zeros = "paired", weights = "k_planes" }')
        .replace("block_k = 128", "block_k = 64"))


# ---------------------------------------------------------------------------------------------
# GPU (KDSL_TEST_GPU=1 python -m pytest tests/test_w4a16_dequant.py -m gpu)

GPU_SHAPES = [(4096, 14336), (14336, 4096)]  # (K, N)


def _gpu_checkpoint(k, n, group_size=128, g_idx="none", dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    return ref.make_checkpoint(k, n, group_size=group_size, g_idx=g_idx, scale_dtype=dtype, device="cuda",
                               generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["native", "sm_80"], ids=["native-layout", "sm80-checkpoint-layout"])
@pytest.mark.parametrize("group_size, g_idx, dtype", [(128, "none", torch.float16), (128, "perm", torch.bfloat16),
                                                      (32, "none", torch.float16), (64, "random", torch.float16),
                                                      (-1, "none", torch.bfloat16)])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_gpu_dequant_is_exact(shape, group_size, g_idx, dtype, arch, monkeypatch):
    if arch != "native":
        monkeypatch.setenv("KDSL_ARCH", arch)  # the sm_80 variant's layout and kernel, on this GPU
    kdsl.registry.reset()
    k, n = shape
    ck = _gpu_checkpoint(k, n, group_size, g_idx, dtype)
    prepared = _prepare(ck, group_size)
    w = ops.w4a16_dequant(prepared)
    expected = _expected_w(ck, prepared, group_size)
    assert w.shape == (n, k) and w.is_contiguous()
    assert torch.equal(w, expected.to(dtype))  # one rounding, on the GPU exact in both dtypes


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["native", "sm_80"], ids=["native-layout", "sm80-checkpoint-layout"])
@pytest.mark.parametrize("m", [1024, 2048, 8192])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_gpu_large_m_takes_the_dequant_path(shape, m, arch, monkeypatch, launched):
    if arch != "native":
        monkeypatch.setenv("KDSL_ARCH", arch)
    kdsl.registry.reset()
    k, n = shape
    ck = _gpu_checkpoint(k, n, 128, "perm")
    prepared = _prepare(ck, 128)
    x = torch.randn(m, k, device="cuda").half()
    y = ops.gptq_gemm(x, prepared)
    dequant = _gemm_entry(prepared).dequant
    if m >= dequant["min_m"] and n <= dequant.get("max_n", n):
        assert len(launched) == 1 and launched[0].startswith("w4a16_dequant__int4_g128__blockwise_sm")
    else:  # the shipped definitions keep layers wider than dequant_max_n on the GEMM tiles
        assert not any(name.startswith("w4a16_dequant") for name in launched)
    assert ref.rel_fro_error(y, _ref_gemm(x, ck, 128)) < TOL
    # Captured in a CUDA graph (scratch w from the caching allocator's graph pool), replayed on new x
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_y = ops.gptq_gemm(static_x, prepared)
    static_x.copy_(torch.randn(m, k, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    assert ref.rel_fro_error(static_y, _ref_gemm(static_x, ck, 128)) < TOL
    assert ref.rel_fro_error(static_y, ops.gptq_gemm(static_x, prepared).float()) < 1e-3


@pytest.mark.gpu
def test_gpu_compiled_reduce_overhead_large_m():
    kdsl.registry.reset()
    ck = _gpu_checkpoint(4096, 4096, 128, "none")
    prepared = _prepare(ck, 128)
    fn = torch.compile(lambda x: torch.nn.functional.silu(ops.w4a16_gemm(x, prepared)), mode="reduce-overhead",
                       fullgraph=True)
    x = torch.randn(2048, 4096, device="cuda").half()
    with torch.no_grad():
        for _ in range(3):
            got = fn(x).clone()
    assert ref.rel_fro_error(got, torch.nn.functional.silu(ops.w4a16_gemm(x, prepared)).float()) < 1e-3
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_bench_prepared_row_takes_the_dequant_path(launched):
    """`kdsl bench --op gptq_gemm`'s gptq_gemm[prepared] row at M >= dequant_min_m times this path, checked."""
    from kdsl.bench import timing
    from kdsl.bench.cases import gptq_gemm
    from kdsl.bench.shapes import Case

    with timing.full_fp32_matmul():
        setup = gptq_gemm.setup(Case("gptq_gemm", m=2048, n=4096, k=4096))
    launched.clear()
    out = setup.kdsl["gptq_gemm[prepared]"]()
    assert len(launched) == 1 and launched[0].startswith("w4a16_dequant__int4_g128__blockwise_sm"), launched
    error, why = setup.check(out)
    assert why is None, (error, why)


def test_dequant_max_n_keeps_wide_layers_on_the_gemm_tiles(monkeypatch):
    """The shipped definitions bound the path at N <= 8192 (wider layers' GEMM tiles beat it on an H200)."""
    text = kdsl.registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=2048, n=28672)
    assert "N <= 8192 (dequant_max_n)" in text and "no GEMM tile runs" not in text
    assert "no GEMM tile runs" in kdsl.registry.explain("w4a16_gemm", "w4a16.int4.g128", arch="sm_90", m=2048, n=4096)


def test_dequant_max_n_needs_dequant_min_m():
    text = """
[[schemes]]
kind = "w4a16"
group_size = 128

[[variants]]
op = "w4a16_gemm"
impl = "mma"
min_arch = "sm_80"
layout = { zeros = "biased" }
dequant_max_n = 8192
tiles = [{ block_m = 16, block_n = 64, block_k = 128, num_warps = 4 }]
"""
    with pytest.raises(DefinitionError, match=r"dequant_max_n: bounds the dequantize \+ cuBLAS path, which needs "
                                              r"dequant_min_m"):
        parse_definition(Path("defs.toml"), text)
