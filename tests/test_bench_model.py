"""kdsl bench --model off the GPU: shapes, the layers it builds and quantizes, the table."""
import json

import pytest
import torch

from kdsl.bench import model as bench_model
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
