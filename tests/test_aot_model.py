"""`kdsl aot --model CHECKPOINT_DIR` and `--shapes FILE`: only the specializations one model needs, read from
config.json and the safetensors headers of a tiny checkpoint written here; the compile output (progress on
stderr, no runpy warnings or nanobind leak reports, the size and time at the end); an export that fails leaves
--out as it was."""
from __future__ import annotations

import ctypes
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kdsl.ops import block_fp8 as block_fp8_ops
from kdsl.aot import export as export_module
from kdsl.aot.export import ExportError, compile_specs, export
from kdsl.aot.plan import exact_values, plan
from kdsl.aot.model import ModelError, from_checkpoint, from_shapes, safetensors_header
from kdsl.cli import _Progress, main

CC = shutil.which("cc") or shutil.which("gcc")
CUDA_INCLUDE = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "include"
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_SCHEME = "block_fp8.e4m3.w128x128.a128.f32"
# (N, K) of the tiny checkpoints' quantized linears.
LINEARS = {"model.layers.0.mlp.up_proj": (384, 256), "model.layers.0.mlp.down_proj": (256, 384)}


def write_fp8_checkpoint(folder: Path, config: dict | None = None, skip_scale: bool = False) -> Path:
    """A DeepSeek-style block-FP8 checkpoint: two quantized linears, a bf16 embedding and a bias."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"torch_dtype": "bfloat16", "quantization_config": FP8}))
    tensors = {"model.embed_tokens.weight": torch.zeros(16, 256, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.bias": torch.zeros(384, dtype=torch.bfloat16)}
    for name, (n, k) in LINEARS.items():
        tensors[f"{name}.weight"] = torch.zeros(n, k).to(torch.float8_e4m3fn)
        if not skip_scale:
            tensors[f"{name}.weight_scale_inv"] = torch.ones(-(-n // 128), k // 128)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_int4_checkpoint(folder: Path, method: str = "gptq") -> Path:
    """A GPTQ (qweight [K / 8, N]) or AWQ (qweight [K, N / 8]) checkpoint in fp16, group size 128, split over two
    shards as published checkpoints are."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"torch_dtype": "float16", "quantization_config": {"quant_method": method, "bits": 4, "group_size": 128}}
    if method == "gptq":
        config["quantization_config"].update(desc_act=False, sym=True, damp_percent=0.01)
    (folder / "config.json").write_text(json.dumps(config))
    for index, (name, (n, k)) in enumerate(LINEARS.items()):
        packed = [k // 8, n] if method == "gptq" else [k, n // 8]
        save_file({f"{name}.qweight": torch.zeros(packed, dtype=torch.int32),
                   f"{name}.qzeros": torch.zeros(k // 128, n // 8, dtype=torch.int32),
                   f"{name}.scales": torch.zeros(k // 128, n, dtype=torch.float16)},
                  str(folder / f"model-0000{index + 1}-of-00002.safetensors"))
    return folder


# ---- what a checkpoint needs ---------------------------------------------------------------------------------

def test_safetensors_header_gives_names_dtypes_and_shapes_without_the_data(tmp_path):
    folder = write_fp8_checkpoint(tmp_path / "ckpt")
    header = safetensors_header(folder / "model.safetensors")
    assert header["model.layers.0.mlp.up_proj.weight"] == ("F8_E4M3", (384, 256))
    assert header["model.layers.0.mlp.down_proj.weight_scale_inv"] == ("F32", (2, 3))
    # Only the header is read: the same answer from a file cut right after it.
    path = folder / "model.safetensors"
    length = int.from_bytes(path.read_bytes()[:8], "little")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:8 + length])
    assert safetensors_header(cut) == header
    cut.write_bytes(b"\x00\x01")
    with pytest.raises(ModelError, match=f"{cut}: not a safetensors file"):
        safetensors_header(cut)


def test_fp8_checkpoint_needs_act_quant_and_fp8_gemm_at_its_sizes(tmp_path):
    needs = from_checkpoint(write_fp8_checkpoint(tmp_path / "ckpt"))
    assert needs.schemes == [FP8_SCHEME] and needs.dtypes == ["bf16"]
    assert set(needs.problems) == {"act_quant", "fp8_gemm"}
    assert {(p["N"], p["K"]) for p in needs.problems["fp8_gemm"]()} == {(384, 256), (256, 384)}
    assert {p["K"] for p in needs.problems["act_quant"]()} == {256, 384}
    # Every M bucket of the kernels gets its representative M values.
    assert {p["M"] for p in needs.problems["fp8_gemm"]()} == set(block_fp8_ops.FP8_GEMM_MS)
    assert "2 quantized linear(s), 2 N x K: 256x384, 384x256" in needs.found[0]


def test_a_model_plan_is_smaller_than_the_full_export_and_keeps_every_tile(tmp_path):
    needs = from_checkpoint(write_fp8_checkpoint(tmp_path / "ckpt"))
    for arch in (89, 90):
        mine = plan([arch], ["act_quant", "fp8_gemm"], needs.schemes, needs.dtypes, problems=needs.problems)
        full = plan([arch], ["act_quant", "fp8_gemm"])
        assert 0 < len(mine.specs) < len(full.specs)
        chosen = [(abi.op, entry.name) for abi, _, _, entry, _ in mine.selected]
        assert chosen == [(abi.op, entry.name) for abi, _, _, entry, _ in full.selected]
        assert {s.dtypes.get("out_dtype", s.dtypes.get("x_dtype")) for s in mine.specs} == {"bf16"}
        # Every exported tile still has its assumption-free specialization, so a call of any size finds a cubin.
        assert {(s.entry, s.bucket) for s in mine.specs} == {(s.entry, s.bucket) for s in full.specs}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_checkpoints_need_w4a16_gemm_at_their_sizes(tmp_path, method):
    needs = from_checkpoint(write_int4_checkpoint(tmp_path / method, method))
    assert needs.dtypes == ["f16"]
    assert "w4a16.int4.g128" in needs.schemes
    assert {(p["N"], p["K"]) for p in needs.problems["w4a16_gemm"]()} == {(384, 256), (256, 384)}
    mine = plan([90], ["w4a16_gemm"], needs.schemes, needs.dtypes, problems=needs.problems)
    same_scheme = plan([90], ["w4a16_gemm"], ["w4a16.int4.g128"], ["f16"])
    assert [s for _, s, *_ in mine.selected] == ["w4a16.int4.g128"]
    assert 0 < len(mine.specs) < len(same_scheme.specs)
    # The Gluon GEMV unrolls K: its cubins are compiled for the model's K only.
    abi, _, _, entry, _ = mine.selected[0]
    unrolled = [exact_values(abi, entry, i) for i in range(len(entry.tiles))]
    assert {k for values in unrolled if values for k in values["K"]} == {256, 384}


def test_mla_config_adds_the_per_head_fp8_bmm(tmp_path):
    config = {"torch_dtype": "bfloat16", "quantization_config": FP8, "num_attention_heads": 16,
              "kv_lora_rank": 512, "qk_nope_head_dim": 128, "v_head_dim": 128}
    needs = from_checkpoint(write_fp8_checkpoint(tmp_path / "mla", config))
    bmm = needs.problems["fp8_bmm"]()
    assert {(p["B"], p["N"], p["K"]) for p in bmm} == {(16, 512, 128), (16, 128, 512)}


def test_shape_file_needs_its_sizes_and_act_quant_for_each_fp8_gemm(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"fp8_gemm": [{"m": [1, 16], "n": 2112, "k": 7168}],
                                  "weight_dequant": [{"n": 7168, "k": 16384}]}))
    needs = from_shapes(str(shapes))
    assert needs.schemes is None and needs.dtypes is None
    assert {(p["M"], p["N"], p["K"]) for p in needs.problems["fp8_gemm"]()} == {(1, 2112, 7168), (16, 2112, 7168)}
    assert {(p["M"], p["K"]) for p in needs.problems["act_quant"]()} == {(1, 7168), (16, 7168)}
    assert any(line.startswith("weight_dequant: not exported yet") for line in needs.found)


def test_a_preset_with_ops_aot_does_not_export_leaves_them_out_by_name():
    """The deepseek-v3 preset holds the MoE layers, which kdsl/aot/abi.py does not describe: each is named as left
    out, and the ops it does describe are planned (this raised KeyError: 'moe_fp8'), the grouped GEMMs at the
    preset's routing: T tokens' T * 8 slots over min(T * 8, 256) experts, each expert's rows padded to 128."""
    needs = from_shapes("deepseek-v3")
    for op in ("moe_fp8", "moe_w4a16", "weight_dequant"):
        assert any(line.startswith(f"{op}: not exported yet") for line in needs.found), needs.found
    assert {"fp8_gemm", "act_quant", "w4a16_gemm", "fp8_bmm", "fp8_grouped_gemm",
            "fp8_grouped_gemm_masked"} <= set(needs.problems)
    gate_up = {p["M"] for p in needs.problems["fp8_grouped_gemm"]() if (p["E"], p["N"], p["K"]) == (256, 4096, 7168)}
    assert gate_up == {8 * 128, 128 * 128, 256 * 128}  # T = 1, 16, and 64 .. 4096 (at most 128 slots an expert)
    masked = needs.problems["fp8_grouped_gemm_masked"]()
    assert {(p["max_m"], p["expected_m"]) for p in masked if p["N"] == 4096} == {
        (1, 0), (1, 1), (16, 0), (16, 1), (64, 0), (64, 2), (128, 0), (128, 4)}
    assert {(256 * 16, 7168), (8 * 128, 7168)} <= {(p["M"], p["K"]) for p in needs.problems["act_quant"]()}


@pytest.mark.parametrize("change, message", [
    ("no config", "config.json: missing"),
    ("no quantization_config", "config.json: no quantization_config object"),
    ("quant_method bitsandbytes", "quantization_config: "),
    ("no safetensors", "no *.safetensors files"),
    ("no scale", "model.layers.0.mlp.down_proj.weight: float8 without "
                 "model.layers.0.mlp.down_proj.weight_scale_inv"),
])
def test_model_errors_name_the_flag_and_the_file(capsys, tmp_path, change, message):
    config = {"torch_dtype": "bfloat16", "quantization_config": FP8}
    if change == "no quantization_config":
        del config["quantization_config"]
    elif change.startswith("quant_method"):
        config["quantization_config"] = {"quant_method": "bitsandbytes"}
    folder = write_fp8_checkpoint(tmp_path / "ckpt", config, skip_scale=change == "no scale")
    if change == "no config":
        (folder / "config.json").unlink()
    elif change == "no safetensors":
        (folder / "model.safetensors").unlink()
    code = main(["aot", "--arch", "sm_89", "--model", str(folder), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: --model {folder}") and message in err, err
    if change.startswith("quant_method"):
        assert "bitsandbytes" in err
    assert not (tmp_path / "out").exists()


def test_model_cli_usage_errors(capsys, tmp_path):
    folder = write_fp8_checkpoint(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as done:
        main(["aot", "--arch", "sm_89", "--model", str(folder), "--shapes", "llama", "--out", "x"])
    assert done.value.code == 2
    assert "--shapes: not allowed with argument --model" in capsys.readouterr().err
    assert main(["aot", "--arch", "sm_89", "--model", str(folder), "--op", "w4a16_gemm", "--out", "x"]) == 2
    assert f"model {folder} runs none of --op w4a16_gemm; it runs act_quant, fp8_gemm" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["aot", "--arch", "sm_89", "--model", str(folder), "--out", str(a_file)]) == 2
    assert f"error: --out {a_file}: is a file, not a folder" in capsys.readouterr().err
    # --shapes through the command: sm_80 has no FP8 kernel, so nothing to export (exit 1), and nothing written.
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"fp8_gemm": [{"m": 1, "n": 2112, "k": 7168}]}))
    assert main(["aot", "--arch", "sm_80", "--shapes", str(shapes), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{shapes}: fp8_gemm 3 problems, act_quant 3 problems" in err and "nothing to export" in err
    assert not (tmp_path / "out").exists()
    assert main(["aot", "--arch", "sm_90", "--shapes", str(tmp_path / "none.json"), "--out", "x"]) == 2
    assert f"error: --shapes {tmp_path / 'none.json'}: not a preset" in capsys.readouterr().err


# ---- the export ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_export(tmp_path_factory):
    """`kdsl aot --arch sm_89 --model` on the tiny FP8 checkpoint (14 portable specializations, seconds)."""
    root = tmp_path_factory.mktemp("aot_model")
    folder = write_fp8_checkpoint(root / "ckpt")
    out = root / "export"
    done = subprocess.run([sys.executable, "-m", "kdsl", "aot", "--arch", "sm_89", "--model",
                           str(folder), "--out", str(out)], capture_output=True, text=True, timeout=600)
    return out, done


def test_model_export_compiles_only_what_it_needs_and_says_so(model_export):
    out, done = model_export
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "aot_manifest.json").read_text())
    assert {(o["op"], o["scheme"], o["arch"]) for o in manifest["ops"]} == {
        ("act_quant", FP8_SCHEME, "sm_89"), ("fp8_gemm", FP8_SCHEME, "sm_89")}
    specs = manifest["specializations"]
    assert len(specs) < len(plan([89], ["act_quant", "fp8_gemm"]).specs)
    assert {tuple(s["dtypes"].values()) for s in specs} == {("bf16",)}
    # Progress on stderr, none of the workers' interpreter noise, the size and time at the end on stdout.
    assert f"compiled {len(specs)}/{len(specs)} specializations in " in done.stderr
    assert "RuntimeWarning" not in done.stderr and "nanobind" not in done.stderr and "Traceback" not in done.stderr
    summary = done.stdout.splitlines()[0]
    size = sum({s["cubin"]: s["size"] for s in specs}.values()) / 2 ** 20
    assert re.fullmatch(rf"exported {len(specs)} specializations of 2 kernel\(s\) to {re.escape(str(out))}/: "
                        rf"{size:.1f} MiB of cubins in \d+ files, (\d+ min )?\d+ s", summary), summary
    # Nothing staged is left beside --out.
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.skipif(CC is None or shutil.which("make") is None, reason="needs cc and make")
def test_model_export_builds_a_library_with_the_models_entry_points(model_export, tmp_path):
    out, done = model_export
    assert done.returncode == 0, done.stderr
    build = tmp_path / "build"
    shutil.copytree(out, build)
    made = subprocess.run(["make", "-C", str(build), f"CUDA_INCLUDE={CUDA_INCLUDE}", f"CC={CC}",
                           "CFLAGS=-O2 -Wall -Wextra -Werror"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    lib = ctypes.CDLL(str(build / "libkdsl_aot.so"))
    lib.kdsl_aot_archs.restype = ctypes.c_char_p
    assert lib.kdsl_aot_archs().decode() == "sm_89"
    assert hasattr(lib, "kdsl_act_quant") and hasattr(lib, "kdsl_fp8_gemm")
    assert not hasattr(lib, "kdsl_fp8_bmm") and not hasattr(lib, "kdsl_gptq_gemm")


def test_the_compile_workers_leave_no_shutdown_noise_on_stderr(tmp_path, capfd, monkeypatch):
    """A Gluon compile makes Triton's nanobind bindings report leaks at interpreter exit: the worker silences its
    stderr once every job is answered (a failing job is still reported, through its answer)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_cache"))  # a real compile, not a cache hit
    result = plan([90], ["w4a16_gemm"], ["w4a16.int4.g128"], ["f16"], generic_only=True)
    gluon = next(s for s in result.specs if s.impl == "gemv_mma_gluon")
    broken = type(gluon)(**{**gluon.__dict__, "name": "broken", "kernel": "no_such_kernel", "compiled": {}})
    lines = []
    failures = compile_specs([gluon, broken], tmp_path, 1, progress=lines.append)
    err = capfd.readouterr().err
    assert [spec.name for spec, _ in failures] == ["broken"] and "no_such_kernel" in failures[0][1]
    assert gluon.compiled["size"] > 0
    assert "nanobind" not in err and "RuntimeWarning" not in err


def test_a_failed_export_leaves_out_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "export"
    out.mkdir()
    (out / "aot_manifest.json").write_text("{}\n")

    def fail(specs, folder, jobs, progress, tick):
        (folder / "cubins").mkdir()
        (folder / "cubins" / "half.cubin").write_bytes(b"\x7fELF")
        return [(specs[0], "the compile worker exited")]

    monkeypatch.setattr(export_module, "compile_specs", fail)
    with pytest.raises(ExportError, match="the compile worker exited"):
        export(out, [89], ["act_quant"], dtypes=["bf16"], progress=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["aot_manifest.json"]


# ---- progress --------------------------------------------------------------------------------------------------

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_bar_on_a_terminal_and_a_line_per_tenth_in_a_log():
    terminal = _Terminal()
    bar = _Progress(terminal)
    for done in range(1, 51):
        bar.tick(done, 50)
    bar.line("skipped x: why")
    bar.tick(50, 50)
    bar.close()
    text = terminal.getvalue()
    assert text.count("\n") == 2  # the line, and the end of the bar
    assert "\r[" + "#" * 30 + "] compiled 50/50 specializations in " in text
    assert "\r\x1b[Kskipped x: why\n" in text
    log = io.StringIO()
    bar = _Progress(log)
    for done in range(1, 201):
        bar.tick(done, 200)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("compiled 20/200 specializations in ")
    assert lines[-1].startswith("compiled 200/200 specializations in ") and "left" not in lines[-1]
