"""kdsl bench --model off the GPU: shapes, the layers it builds and quantizes, the table."""
import json

import pytest
import torch

from kdsl.bench import model as bench_model
from kdsl.ops import _plan as kdsl_plan
import kdsl.bench.cli  # noqa: F401  (the CLI imports the model bench without a GPU)


def test_a_shape_file_and_its_refusals(tmp_path):
    good = tmp_path / "tiny.json"
    good.write_text(json.dumps({"hidden": 256, "qkv": 384, "o_in": 256, "inter": 512, "layers": 2}))
    name, shape = bench_model.parse_shape(str(good))
    assert name == "tiny" and shape.weights() == 2 * (256 * 384 + 256 * 256 + 256 * 1024 + 512 * 256)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden": 256}))
    with pytest.raises(ValueError, match=r"--model .*bad\.json: expected JSON with integer hidden"):
        bench_model.parse_shape(str(bad))
    with pytest.raises(ValueError, match=r"neither a preset"):
        bench_model.parse_shape("llama-9")


@pytest.mark.parametrize("name", ["w4a16", "fp8"])
def test_the_quantized_layers_follow_the_float_model(name):
    shape = bench_model.Shape(hidden=256, qkv=384, o_in=256, inter=256, layers=2)
    quantized, dtype = bench_model.variant(name, shape, device="cpu")
    dense, _ = bench_model.variant("fp16" if name == "w4a16" else "bf16", shape, device="cpu")
    x = torch.randn(3, 256, dtype=dtype)
    with torch.no_grad():
        err = ((quantized(x).float() - dense(x).float()).norm() / dense(x).float().norm()).item()
    assert err < 0.05, err  # round-to-nearest weights through two residual layers


def test_the_decoder_adds_the_residual_stream_twice_a_layer():
    """The layers carry (delta, residual) and add them in the next norm's kernel (add_rms_norm): the forward is still
    x + o(attention(norm1(x))), then + down(silu_mul(gate_up(norm2(.)))), layer after layer, written out here."""
    shape = bench_model.Shape(hidden=256, qkv=384, o_in=256, inter=256, layers=3)
    model = bench_model.build(shape, torch.float32, device="cpu")
    x = torch.randn(3, 256)
    expected = x
    with torch.no_grad():
        for layer in model:
            h = expected + layer.o(layer.qkv(layer.norm1(expected))[:, :256])
            gate, up = layer.gate_up(layer.norm2(h)).chunk(2, dim=-1)
            expected = h + layer.down(torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["torchao-fp8", "torchao-int4"])
def test_a_peer_without_torchao_is_an_import_error(name, monkeypatch):
    """The torchao variants are peers where torchao imports; without it, variant() raises ImportError, which
    run_model_bench reports as "not available" and leaves out."""
    import sys
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    shape = bench_model.Shape(hidden=256, qkv=384, o_in=256, inter=256, layers=1)
    with pytest.raises(ImportError):
        bench_model.variant(name, shape, device="cpu")
    assert bench_model.BASES[name] == "bf16" and name in bench_model.VARIANTS


TINY_MLA = bench_model.MLA(q_lora=128, kv_lora=256, rope=64, heads=2, nope=128, v_head=128)


def test_an_mla_shape_file_and_its_refusals(tmp_path):
    """A shape file may give DeepSeek-V3's MLA decode path: its keys are checked like the rest, and qkv and o_in
    must be what MLA makes them (q_a + kv_a, the heads' v)."""
    mla = {"q_lora": 128, "kv_lora": 256, "rope": 64, "heads": 2, "nope": 128, "v_head": 128}
    good = tmp_path / "mla.json"
    good.write_text(json.dumps({"hidden": 256, "qkv": 448, "o_in": 256, "inter": 256, "layers": 1, "mla": mla}))
    _, shape = bench_model.parse_shape(str(good))
    assert shape.mla == TINY_MLA
    # qkv (q_a + kv_a), q_b, o, gate_up, down, and W_UK + W_UV per head
    assert shape.weights() == 256 * 448 + 128 * 2 * 192 + 256 * 256 + 256 * 512 + 256 * 256 + 2 * 256 * (128 + 128)
    for doc, match in (({"mla": {**mla, "heads": 4}}, "o_in heads \\* v_head \\(512\\)"),
                       ({"mla": {**mla, "latent": 1}}, "unknown mla keys \\['latent'\\]"),
                       ({"attention": "mla"}, "unknown keys \\['attention'\\]")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"hidden": 256, "qkv": 448, "o_in": 256, "inter": 256, "layers": 1, **doc}))
        with pytest.raises(ValueError, match=match):
            bench_model.parse_shape(str(bad))
    _, preset = bench_model.parse_shape("deepseek-v3-dense")
    assert preset.mla == bench_model.DEEPSEEK_V3_MLA and preset.qkv == 2112 and preset.o_in == 16384


def test_the_fp8_mla_layer_follows_the_float_model():
    """DeepSeek-V3's decode path with its absorbed BMMs in block FP8 (act_quant + kdsl.ops.fp8_bmm) against the
    bf16 model with torch.bmm: the same weights, quantized."""
    shape = bench_model.Shape(hidden=256, qkv=448, o_in=256, inter=256, layers=1, mla=TINY_MLA)
    quantized, dtype = bench_model.variant("fp8", shape, device="cpu")
    dense, _ = bench_model.variant("bf16", shape, device="cpu")
    assert type(quantized[0].absorbed).__name__ == "FP8AbsorbedMLA"
    assert type(dense[0].absorbed).__name__ == "AbsorbedMLA"
    x = torch.randn(3, 256, dtype=dtype)
    with torch.no_grad():
        want = dense(x).float()
        err = ((quantized(x).float() - want).norm() / want.norm()).item()
        # the attention stand-in alone: the absorbed BMMs of one layer, FP8 against bf16
        q = torch.randn(3, 2 * 192, dtype=dtype)
        bmm_want = dense[0].absorbed(q).float()
        bmm_err = ((quantized[0].absorbed(q).float() - bmm_want).norm() / bmm_want.norm()).item()
    assert err < 0.05, err
    assert 0 < bmm_err < 0.1, bmm_err  # e4m3 activations and weights: a few percent, never exact


def _aten_ops(model, x) -> set[str]:
    """The aten ops a forward of model runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record() as record:
        model(x)
    return record.ops


MATMULS = {"mm", "addmm", "bmm", "matmul", "linear"}


# The stand-ins allocate their outputs without writing them: SiLU * mul then reads whatever the memory holds.
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("mla", [None, TINY_MLA], ids=["llama-like", "mla"])
def test_the_glue_model_is_the_forward_without_its_matmuls(mla, monkeypatch):
    """The glue model runs the float model's norms, SiLU * mul and residual adds at the same shapes, and no matmul:
    its time is what a forward costs besides its linears (and MLA's absorbed BMMs). (The norms and SiLU * mul are
    kdsl kernels: under the interpreter no aten op of theirs shows.)"""
    # kdsl.nn.RMSNorm's first call records a launch plan that later calls replay with other aten ops: both models
    # take the ordinary path here, so their ops compare.
    monkeypatch.setattr(kdsl_plan, "RECORD", False)
    shape = bench_model.Shape(hidden=256, qkv=448 if mla else 384, o_in=256, inter=256, layers=2, mla=mla)
    glue, dtype = bench_model.variant(bench_model.GLUE["bf16"], shape, device="cpu")
    dense, _ = bench_model.variant("bf16", shape, device="cpu")
    x = torch.randn(3, 256, dtype=dtype)
    glue_ops, dense_ops = _aten_ops(glue, x), _aten_ops(dense, x)
    assert dense_ops & MATMULS and not glue_ops & MATMULS, (dense_ops, glue_ops)
    assert "add" in glue_ops and glue_ops - {"empty", "new_empty"} <= dense_ops
    with torch.no_grad():
        assert glue(x).shape == dense(x).shape and glue(x).dtype == dtype
    assert bench_model.variant(bench_model.GLUE["fp16"], shape, device="cpu")[1] == torch.float16


def test_speedups_and_the_linears_share_come_from_the_same_mode_and_m():
    rows = [{"model": model, "m": m, "mode": mode, "us": us}
            for model, m, mode, us in (("bf16", 1, "graph", 100.0), ("fp8", 1, "graph", 50.0),
                                       ("glue-bf16", 1, "graph", 20.0), ("bf16", 1, "eager", 300.0),
                                       ("fp8", 1, "eager", 400.0), ("glue-bf16", 16, "eager", 10.0),
                                       ("fp16", 1, "graph", 90.0), ("w4a16", 1, "graph", 30.0))]
    bench_model.add_ratios(rows)
    by = {(r["model"], r["mode"]): r for r in rows}
    assert by["fp8", "graph"]["speedup"] == 2.0 and by["fp8", "graph"]["linears_share"] == pytest.approx(0.6)
    assert by["bf16", "graph"]["speedup"] == 1.0 and by["bf16", "graph"]["linears_share"] == pytest.approx(0.8)
    assert by["fp8", "eager"]["speedup"] == 0.75 and by["fp8", "eager"]["linears_share"] is None  # no glue at M=1
    assert by["w4a16", "graph"]["speedup"] == 3.0 and by["w4a16", "graph"]["linears_share"] is None  # no glue-fp16
    assert by["glue-bf16", "graph"]["speedup"] is None and by["glue-bf16", "graph"]["linears_share"] is None
    table = bench_model.format_model_table([dict(r, roofline=None if "glue" in r["model"] else 0.5) for r in rows],
                                           "tiny")
    assert "60%" in table and "80%" in table and "glue-bf16" in table


def test_the_table_names_every_mode():
    rows = [{"model": "fp16", "m": 1, "mode": mode, "us": 10.0, "roofline": 0.5, "speedup": None} for mode in
            bench_model.MODES] + [{"model": "w4a16", "m": 1, "mode": "graph", "us": 4.0, "roofline": 0.9,
                                   "speedup": 2.5}]
    table = bench_model.format_model_table(rows, "tiny")
    assert "w4a16" in table and "2.50" in table and "compile us" in table


def test_layers_override_the_preset_and_need_model(capsys):
    from kdsl.cli import main

    assert main(["bench", "--layers", "3"]) == 2
    assert "--layers 3: only with --model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--model", "llama-3-8b", "--layers", "0"])
    assert exited.value.code == 2 and "--layers: must be >= 1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_mode_is_timed_in_steady_state():
    """The three modes run the same kernels, so timed the same way (calls back to back) a compiled model is
    within reach of its captured graph; one call timed alone from an idle GPU added the compiled path's host
    time (cudagraph trees' Python) to it, which the graph mode never paid. Models of one mode are timed together."""
    shape = bench_model.Shape(hidden=1024, qkv=1536, o_in=1024, inter=2048, layers=2)
    models = {name: bench_model.variant(name, shape) for name in ("fp16", "w4a16")}
    group = {name: (model, torch.randn(4, shape.hidden, device="cuda", dtype=dtype))
             for name, (model, dtype) in models.items()}
    timed = {mode: bench_model.time_models(group, mode) for mode in bench_model.MODES}
    for mode, by_model in timed.items():
        assert set(by_model) == {"fp16", "w4a16"}, mode
        for name, (us, host_us) in by_model.items():
            assert us > 0 and host_us > 0, (mode, name, us, host_us)
    for name in group:
        (graph_us, _), (compile_us, compile_host_us) = timed["graph"][name], timed["compile"][name]
        # Back to back, a compiled call takes the GPU's time (its graph's) or, where its host side is slower, the
        # host's pace: nothing on top of both, as one call from an idle GPU would show.
        assert compile_us < 1.3 * max(graph_us, compile_host_us), (name, timed)


def test_a_forwards_kernel_breakdown_and_its_section(monkeypatch, capsys):
    from kdsl.bench import profile

    seen = []

    def fake_kernel_times(fn, calls=1):
        seen.append(fn())  # the forward the breakdown profiles: the model on its input
        return {f"k{i}": float(10 - i) for i in range(10)}

    monkeypatch.setattr(profile, "kernel_times", fake_kernel_times)
    x = torch.ones(2, 3)
    assert bench_model.forward_kernels("w4a16", lambda t: t * 2, x) == {f"k{i}": float(10 - i) for i in range(10)}
    assert torch.equal(seen[0], x * 2)
    monkeypatch.setattr(profile, "kernel_times", lambda fn, calls=1: (_ for _ in ()).throw(RuntimeError("no CUPTI")))
    assert bench_model.forward_kernels("fp8", lambda t: t, x) is None
    assert "fp8: no kernel breakdown (RuntimeError: no CUPTI)" in capsys.readouterr().err
    rows = [{"model": "w4a16", "m": 1, "mode": "graph", "us": 60.0, "kernels_us": {f"k{i}": float(10 - i)
                                                                                    for i in range(10)}},
            {"model": "fp8", "m": 1, "mode": "graph", "us": 50.0, "kernels_us": None},
            {"model": "fp16", "m": 1, "mode": "eager", "us": 90.0}]
    text = bench_model.format_model_kernels(rows)
    assert "w4a16 M=1: kernels 55.0 us of 60.0 us per forward" in text
    assert "     10.00 us  k0" in text and "      3.00 us  k7" in text and "k8" not in text
    assert "      3.00 us  (2 more kernels)" in text  # k8 (2.0) and k9 (1.0)
    assert "fp8" not in text and "fp16" not in text
