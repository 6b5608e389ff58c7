"""Install anywhere: what a wheel carries, user kernel folders beside the shipped ones, per-kernel digests,
and the same refusal of unserved schemes on every path."""
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

import kdsl
from kdsl.codegen import plan_kernels, render_all, write
from kdsl.runtime.manifest import ManifestError
from kdsl.schema import load_definitions

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_declares_what_the_interpreter_imports_and_the_python_it_needs():
    project = _pyproject()["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "numpy" for dep in project["dependencies"])
    assert project["requires-python"] == ">=3.11"  # kdsl.schema reads TOML with tomllib


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, capture_output=True)
    (path,) = out.glob("kdsl-*.whl")
    return path


def test_wheel_carries_every_module_definition_template_and_kernel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"kdsl/{p.relative_to(REPO / 'kdsl')}" for p in (REPO / "kdsl").rglob("*")
               if p.suffix in (".py", ".j2") and "__pycache__" not in p.parts}
    assert sources - names == set()
    assert {f"kdsl/kernel_defs/{p.name}" for p in (REPO / "kernel_defs").glob("*.toml")} <= names
    assert {f"kdsl/generated/{p.name}" for p in (REPO / "generated").iterdir() if p.suffix in (".py", ".json")} <= names


def test_wheel_carries_the_license_and_the_typed_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kdsl/py.typed" in names
    [license_file] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert zipfile.ZipFile(wheel).read(license_file) == (REPO / "LICENSE").read_bytes()
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()


def _install(wheel: Path, target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)


def test_installed_wheel_runs_kernels_from_another_folder(wheel, tmp_path):
    target = tmp_path / "site"
    _install(wheel, target)
    script = """
import torch, kdsl
from kdsl.runtime.manifest import shipped_definitions_dir, shipped_dir
print(shipped_dir(), shipped_definitions_dir(), kdsl.__file__)
x, w = torch.randn(3, 256), torch.randn(128, 256)
q, s = kdsl.ops.act_quant(x)
wq, ws = kdsl.ops.weight_quant(w)
y = kdsl.ops.fp8_gemm(q, s, wq, ws, out_dtype=torch.float32)
ref = (q.float() * s.repeat_interleave(128, 1)) @ (wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3), (y - ref).abs().max()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_INTERPRET": "1"}
    env.pop("KDSL_GENERATED", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    generated, defs, module = result.stdout.split()[:3]
    assert generated == str(target / "kdsl" / "generated")
    assert defs == str(target / "kdsl" / "kernel_defs")
    assert module.startswith(str(target))
    assert result.stdout.split()[-1] == "ok"


def _installed_kdsl(target: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m kdsl ARGS` from the wheel installed in target, as a user runs it: from their own folder."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    for name in ("KDSL_GENERATED", "KDSL_KERNEL_PATH", "TRITON_INTERPRET"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "kdsl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_generate_from_a_wheel_install_leaves_the_shipped_kernels_intact(wheel, tmp_path):
    """`kdsl generate --defs my_defs` (with and without --out) writes the user's kernels into their own folder;
    the installed package's kernels are never touched, and `kdsl list` still lists every one of them."""
    target = tmp_path / "site"
    _install(wheel, target)
    shipped = target / "kdsl" / "generated"
    before = _files(shipped)
    shipped_count = len(json.loads((REPO / "generated" / "manifest.json").read_text())["kernels"])
    work = tmp_path / "work"
    defs = work / "my_defs"
    defs.mkdir(parents=True)
    (defs / "fp8.toml").write_text((REPO / "kernel_defs" / "block_fp8.toml").read_text())

    done = _installed_kdsl(target, "generate", "--defs", "my_defs", cwd=work)
    assert done.returncode == 0, done.stderr
    assert "0 removed" in done.stderr and f"in {work / 'generated'}/" in done.stderr
    assert (work / "generated" / "manifest.json").is_file()
    done = _installed_kdsl(target, "generate", "--defs", "my_defs", "--out", "mine", cwd=work)
    assert done.returncode == 0, done.stderr
    assert _files(work / "mine") == _files(work / "generated")
    # Into the package itself: refused, naming --out (and the flag that allows it).
    for args in (["generate"], ["generate", "--defs", "my_defs", "--out", str(shipped)]):
        done = _installed_kdsl(target, *args, cwd=work)
        assert done.returncode == 2, done.stderr
        assert f"error: --out {shipped}: is inside the kdsl package" in done.stderr and "--out DIR" in done.stderr
    assert _files(shipped) == before
    # The shipped definitions still render the shipped kernels, and the registry lists all of them.
    done = _installed_kdsl(target, "generate", "--check", cwd=work)
    assert done.returncode == 0, done.stderr
    done = _installed_kdsl(target, "list", cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"{shipped_count} kernel(s)"
    assert done.stdout.count("  from shipped\n") == shipped_count


# --- user kernel folders --------------------------------------------------------------------------

def _generate(defs: Path, out: Path) -> None:
    write(render_all(plan_kernels(load_definitions(defs))), out)


@pytest.fixture
def user_kernels(tmp_path) -> Path:
    """A user's folder whose act_quant kernel has the shipped one's name (other tiles): it shadows it."""
    defs = tmp_path / "my_defs"
    defs.mkdir()
    text = (REPO / "kernel_defs" / "block_fp8.toml").read_text()
    start = text.index("tiles = [{ m_max = 1, block_m = 1, num_warps = 1 }")  # act_quant's, the file's first
    end = text.index("}]", start) + 2
    (defs / "block_fp8.toml").write_text(text[:start] + "tiles = [{ block_m = 4, num_warps = 1 }]" + text[end:])
    _generate(defs, tmp_path / "my_kernels")
    yield tmp_path / "my_kernels"
    kdsl.registry.remove_generated(tmp_path / "my_kernels")


def _act_quant_entry():
    return kdsl.registry.select("act_quant", "block_fp8.e4m3.w128x128.a128.f32", arch="sm_90")


def test_add_generated_shadows_a_shipped_kernel_of_the_same_name(user_kernels):
    shipped = _act_quant_entry()
    assert shipped.origin == "shipped"
    kdsl.registry.add_generated(user_kernels)
    mine = _act_quant_entry()
    assert mine.name == shipped.name and mine.origin == str(user_kernels.resolve())
    assert mine.module_path.parent == user_kernels.resolve()
    assert mine.tile_for(1)["BLOCK_M"] == 4
    text = kdsl.registry.explain("act_quant", arch="sm_90")
    assert f"{shipped.name} [{user_kernels.resolve()}]: CHOSEN" in text
    assert f"{shipped.name}: shadowed by {shipped.name} [{user_kernels.resolve()}]" in text
    # and the user's module is the one that runs
    x = torch.randn(5, 256)
    q, s = kdsl.ops.act_quant(x)
    assert mine.load().__file__ == str(mine.module_path)
    assert torch.isfinite(s).all() and q.shape == x.shape
    kdsl.registry.remove_generated(user_kernels)
    assert _act_quant_entry().origin == "shipped"


def test_kernel_path_environment_variable_adds_folders(user_kernels, monkeypatch):
    monkeypatch.setenv(kdsl.registry.KERNEL_PATH_ENV, str(user_kernels))
    kdsl.registry.reset()
    assert [origin for origin, _ in kdsl.registry.kernel_folders()] == [str(user_kernels.resolve()), "shipped"]
    assert _act_quant_entry().origin == str(user_kernels.resolve())


def test_add_generated_names_a_folder_without_kernels(tmp_path):
    with pytest.raises(ManifestError, match=str(tmp_path / "nothing" / "manifest.json")):
        kdsl.registry.add_generated(tmp_path / "nothing")
    assert [origin for origin, _ in kdsl.registry.kernel_folders()] == ["shipped"]


# --- digests ---------------------------------------------------------------------------------------

def test_a_definition_edit_rewrites_only_the_modules_it_renders(tmp_path):
    defs = tmp_path / "kernel_defs"
    defs.mkdir()
    for path in (REPO / "kernel_defs").glob("*.toml"):
        (defs / path.name).write_text(path.read_text())
    out = tmp_path / "generated"
    _generate(defs, out)
    fp8 = defs / "block_fp8.toml"
    fp8.write_text(fp8.read_text().replace("tiles = [{ num_warps = 8 }]", "tiles = [{ num_warps = 4 }]", 1))
    changed = write(render_all(plan_kernels(load_definitions(defs))), out).changed
    assert changed == ["manifest.json", "weight_quant__e4m3_w128x128_a128_f32__blockwise_sm89.py"]
    fp8.write_text("# a comment changes no kernel\n" + fp8.read_text())
    assert write(render_all(plan_kernels(load_definitions(defs))), out).changed == []


# --- one refusal on every path ---------------------------------------------------------------------

UNSERVED = [
    ("act_quant", lambda: kdsl.ops.act_quant(torch.randn(2, 128), group_size=64), "group_size = 64"),
    ("weight_quant", lambda: kdsl.ops.weight_quant(torch.randn(64, 64), block_size=(64, 64)), r"block_size = \(64, 64\)"),
    ("weight_dequant", lambda: kdsl.ops.weight_dequant(torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
                                                       torch.ones(1, 1), block_size=(64, 64)), r"block_size = \(64, 64\)"),
    ("gptq_dequant", lambda: kdsl.ops.gptq_dequant(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                                   torch.ones(1, 8, dtype=torch.float16), group_size=16), "bits = 4, group_size = 16"),
]


@pytest.mark.parametrize("interpret", [True, False], ids=["kernels", "fallback"])
@pytest.mark.parametrize("op, call, asked", UNSERVED, ids=[u[0] for u in UNSERVED])
def test_unserved_schemes_are_refused_the_same_way_with_and_without_kernels(op, call, asked, interpret, monkeypatch):
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(kdsl.SchemeNotServedError, match=f"{op}: {asked}.* selects scheme .* served: "):
        call()


def test_scheme_from_hf_refuses_a_scheme_no_kernel_serves():
    with pytest.raises(kdsl.SchemeNotServedError, match=r"block_fp8\.e4m3\.w64x64\.a64\.f32.*served: block_fp8\.e4m3\.w128x128"):
        kdsl.scheme_from_hf({"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "dynamic"})
    assert kdsl.scheme_from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]}).weight_block == (128, 128)


USER_FP8_SCHEME = """
description = "block FP8 with 128x64 weight blocks and 64-wide activation groups"

[[schemes]]
kind = "block_fp8"
weight_block = [128, 64]
act_group = 64

[[variants]]
op = "act_quant"
impl = "rowwise"
min_arch = "sm_89"
tiles = [{ block_m = 4, num_warps = 2 }]

[[variants]]
op = "weight_quant"
impl = "blockwise"
min_arch = "sm_89"
tiles = [{ num_warps = 4 }]

[[variants]]
op = "fp8_gemm"
impl = "portable"
min_arch = "sm_89"
tiles = [{ block_m = 16, block_n = 64, block_k = 64, num_stages = 2 }]
"""


def test_ops_take_block_and_group_sizes_from_a_generated_scheme(tmp_path):
    """A user's scheme with 128x64 weight blocks and 64-wide groups: the ops pick it from the manifest by the
    arguments and the scale tensors' shapes, with no block size of theirs in kdsl.ops' code."""
    defs = tmp_path / "defs"
    defs.mkdir()
    (defs / "fp8_128x64.toml").write_text(USER_FP8_SCHEME)
    _generate(defs, tmp_path / "kernels")
    with pytest.raises(kdsl.SchemeNotServedError, match="group_size = 64"):
        kdsl.ops.act_quant(torch.randn(2, 128), group_size=64)
    kdsl.registry.add_generated(tmp_path / "kernels")
    try:
        x, w = torch.randn(3, 256), torch.randn(200, 256)
        q, s = kdsl.ops.act_quant(x, group_size=64)
        wq, ws = kdsl.ops.weight_quant(w, block_size=(128, 64))
        assert s.shape == (3, 4) and ws.shape == (2, 4)
        y = kdsl.ops.fp8_gemm(q, s, wq, ws, out_dtype=torch.float32)
        ref = (q.float() * s.repeat_interleave(64, 1)) @ (
            wq.float() * ws.repeat_interleave(128, 0)[:200].repeat_interleave(64, 1)).T
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3), (y - ref).abs().max()
        # the shipped 128x128 scheme still serves its own shapes
        q2, s2 = kdsl.ops.act_quant(x)
        wq2, ws2 = kdsl.ops.weight_quant(w)
        assert kdsl.ops.fp8_gemm(q2, s2, wq2, ws2).shape == (3, 200)
    finally:
        kdsl.registry.remove_generated(tmp_path / "kernels")
