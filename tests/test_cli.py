"""The command line: exit codes (0 ok, 1 negative answer, 2 usage error), messages, generate's defaults."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kdsl
from kdsl import registry
from kdsl.cli import build_parser, generate_out, main
from kdsl.runtime.manifest import shipped_definitions_dir, shipped_dir

FP8_SCHEME = "block_fp8.e4m3.w128x128.a128.f32"


@pytest.fixture(autouse=True)
def _no_user_folders(monkeypatch):
    """Only the shipped kernels, whatever the calling shell exports."""
    monkeypatch.delenv(registry.KERNEL_PATH_ENV, raising=False)
    monkeypatch.delenv(registry.GENERATED_ENV, raising=False)
    registry.reset()


def run(capsys, *args: str) -> tuple[int, str, str]:
    """main(args) in this process: (exit code, stdout, stderr); argparse's exits give their code."""
    try:
        code = main(list(args))
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def subprocess_kdsl(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (registry.KERNEL_PATH_ENV, registry.GENERATED_ENV)}
    return subprocess.run([sys.executable, "-m", "kdsl", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_version(capsys, tmp_path):
    assert run(capsys, "--version") == (0, f"kdsl {kdsl.__version__}\n", "")
    done = subprocess_kdsl("--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kdsl {kdsl.__version__}\n"


def test_help_documents_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    epilog = out[out.index("exit status:"):]
    for status in ("0", "1", "2"):
        assert f"\n  {status}  " in epilog


@pytest.mark.parametrize("args", [("explain", "fp8_gem", "--arch", "sm_90"), ("list", "--op", "nosuchop")])
def test_unknown_op_lists_the_known_ops(capsys, args):
    code, out, err = run(capsys, *args)
    known = sorted({e.op for e in registry.entries()})
    assert code == 2
    assert out == ""
    assert err.startswith("error: unknown op") and args[1 if args[0] == "explain" else 2] in err
    assert ", ".join(known) in err


def test_explain_exits_1_when_no_kernel_fits_and_0_when_one_does(capsys):
    code, out, err = run(capsys, "explain", "fp8_gemm", "--arch", "sm_80")
    assert code == 1
    assert "no kernel fits" in out and "refused: needs sm_89 or newer" in out  # the trace is still printed
    code, out, err = run(capsys, "explain", "fp8_gemm", "--arch", "sm_90", "--m", "1")
    assert code == 0, err
    assert "CHOSEN" in out


def test_explain_unknown_scheme_lists_the_op_schemes(capsys):
    code, out, err = run(capsys, "explain", "fp8_gemm", "--scheme", "block_fp8.e5m2", "--arch", "sm_90")
    assert code == 2 and out == ""
    assert err.startswith("error: unknown scheme 'block_fp8.e5m2' for op fp8_gemm")
    schemes = sorted({e.scheme for e in registry.entries() if e.op == "fp8_gemm"})
    assert ", ".join(schemes) in err
    assert "gptq." not in err  # only the op's schemes


def test_explain_bad_arch_is_a_usage_error(capsys):
    code, out, err = run(capsys, "explain", "fp8_gemm", "--arch", "hopper")
    assert code == 2
    assert "error: argument --arch" in err and "sm_90" in err


@pytest.mark.parametrize("option, value", [("--m", "-5"), ("--n", "-1")])
def test_negative_sizes_are_refused(capsys, option, value):
    code, _, err = run(capsys, "explain", "fp8_gemm", "--arch", "sm_90", option, value)
    assert code == 2
    assert f"argument {option}: must be >= 0" in err
    assert run(capsys, "explain", "fp8_gemm", "--arch", "sm_90", option, "0")[0] == 0


def test_explain_batch_shows_the_tile_for_that_many_batches(capsys):
    code, few, _ = run(capsys, "explain", "fp8_bmm", "--arch", "sm_90", "--m", "1", "--n", "512", "--batch", "16")
    assert code == 0 and "'batch_max': 16" in few.splitlines()[1] and "passed over" not in few
    code, many, _ = run(capsys, "explain", "fp8_bmm", "--arch", "sm_90", "--m", "1", "--n", "512", "--batch", "128")
    assert code == 0 and "batch=128" in many and "'batch_max': None" in many.splitlines()[1]
    assert "passed over at run time" in many and "the call has 128" in many
    code, _, err = run(capsys, "explain", "fp8_bmm", "--arch", "sm_90", "--batch", "0")
    assert code == 2 and "argument --batch: must be >= 1" in err


def test_explain_k_shows_a_tile_refused_for_its_k(capsys):
    base = ("explain", "w4a16_gemm", "--arch", "sm_90", "--m", "12", "--n", "4096")
    code, short, _ = run(capsys, *base, "--k", "4096")
    assert code == 0 and "k=4096" in short and "gemv_mma_gluon" in short.splitlines()[1] and "passed over" not in short
    code, long_k, _ = run(capsys, *base, "--k", "14336")
    assert code == 0 and "planes_mma" in long_k.splitlines()[1]
    assert "(gemv_mma_gluon) passed over at run time" in long_k and "K = 14336" in long_k and "k_max" in long_k
    code, _, err = run(capsys, *base, "--k", "0")
    assert code == 2 and "argument --k: must be >= 1" in err


@pytest.mark.parametrize("op, scheme, experts, ranges", [
    ("moe_w4a16", "w4a16.int4.g128", 128, ["T <= 128", "128 < T <= 512", "512 < T <= 1024", "T > 1024"]),
    ("moe_fp8", None, 256, ["T <= 128", "128 < T <= 512", "512 < T <= 1024", "1024 < T <= 4096",
                            "4096 < T <= 8192", "T > 8192"]),
])
def test_explain_moe_routing_shows_tokens_per_expert_and_the_tile_per_t(capsys, op, scheme, experts, ranges):
    """--tokens/--experts/--topk: M is the tokens per routed expert, the tile is the one the op launches for that
    routing (entry.tile_for(M, I)), and each of the entry's tiles is shown with the token counts it serves."""
    from kdsl.cli import _tile_text
    from kdsl.ops.moe import tokens_per_expert

    entry = registry.select(op, scheme, arch="sm_90")
    scheme_args = ("--scheme", scheme) if scheme else ()
    bounds = [1, 128, 129, 512, 513, 1024, 1025, 4096, 4097]
    for tokens in bounds:
        code, out, err = run(capsys, "explain", op, "--arch", "sm_90", *scheme_args, "--tokens", str(tokens),
                             "--experts", str(experts), "--topk", "8", "--n", "2048")
        assert code == 0, err
        m = tokens_per_expert(tokens * 8, experts)
        assert out.splitlines()[0].endswith(f"m={m} n=2048")
        assert f"M = tokens per routed expert = ceil(T * k / min(T * k, E)) = ceil({tokens * 8} / " \
               f"{min(tokens * 8, experts)}) = {m}" in out
        # T * k * 4 <= E (T = 1 at E >= 32) skips the routing kernel: each (token, slot) a block of its own.
        assert ("no routing kernel" in out) == (tokens * 8 * 4 <= experts)
        assert ("the routing kernels sort" in out) == (tokens * 8 * 4 > experts)
        assert ("in one program" in out) == (tokens * 8 * 4 > experts and tokens * 8 <= 128)
        assert ("in three launches" in out) == (tokens * 8 > 128)
        table = out[out.index("tiles by T"):].splitlines()[1:]
        assert [line.split("(")[0].strip() for line in table] == ranges
        marked = [line for line in table if line.endswith(f"<- T = {tokens}")]
        assert len(marked) == 1 and _tile_text(entry.tile_for(m, 2048)) in marked[0]
        # The marked range holds T.
        span = marked[0].split("(")[0].strip()
        low = int(span.split(" < ")[0]) if " < " in span else 0
        high = int(span.split("<= ")[1]) if "<=" in span else None
        assert low < tokens and (high is None or tokens <= high)


@pytest.mark.parametrize("args, message", [
    (("fp8_gemm", "--tokens", "4", "--experts", "8", "--topk", "2"), "describe a MoE layer's routing"),
    (("moe_fp8", "--tokens", "4", "--experts", "8"), "--topk: needed with --tokens, --experts"),
    (("moe_fp8", "--tokens", "4", "--experts", "8", "--topk", "2", "--m", "3"), "--m and --tokens both set M"),
    (("moe_fp8", "--tokens", "4", "--experts", "8", "--topk", "9"), "--topk 9 is more than the 8 experts"),
    (("moe_fp8", "--tokens", "0", "--experts", "8", "--topk", "2"), "argument --tokens: must be >= 1"),
])
def test_explain_moe_routing_usage_errors(capsys, args, message):
    code, out, err = run(capsys, "explain", *args, "--arch", "sm_90")
    assert code == 2 and out == "" and message in err


def test_explain_without_an_arch_to_select_for(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "explain", "fp8_gemm")
    assert code == 2
    assert err.startswith("error: no CUDA device") and "--arch" in err
    monkeypatch.setenv(registry.FORCE_ARCH_ENV, "hopper")
    registry.reset()
    code, _, err = run(capsys, "explain", "fp8_gemm", "--arch", "sm_90")
    assert code == 2
    assert err.startswith("error: KDSL_ARCH='hopper'")


def test_list_says_where_each_kernel_comes_from(capsys, monkeypatch, tmp_path):
    code, out, _ = run(capsys, "list")
    assert code == 0
    assert out.count("  from shipped\n") == len(registry.entries())
    # A kernel names the modules it launches, shared by the schemes that differ only in the constexprs it passes.
    assert ("gptq_gemm__int4_g32_gptq_v2__splitk_sm80\n    op gptq_gemm  impl splitk  scheme gptq.int4.g32.gptq_v2  "
            "arch sm_80+  from shipped\n    modules gptq_gemm__int4__splitk_sm80.py  constexprs GROUP_SIZE=32 "
            "ZERO_OFFSET=0\n") in out
    # A user folder (here a copy of the shipped kernels) shadows them: list names it.
    user = tmp_path / "mine"
    shutil.copytree(shipped_dir(), user, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv(registry.KERNEL_PATH_ENV, str(user))
    registry.reset()
    code, out, _ = run(capsys, "list", "--op", "act_quant")
    assert code == 0
    assert f"  from {user.resolve()}\n" in out and "from shipped" not in out


def test_generate_defaults_are_the_shipped_folders(capsys, monkeypatch):
    args = build_parser().parse_args(["generate"])
    assert args.defs == shipped_definitions_dir() and args.out is None and not args.into_package
    # The shipped definitions render into the shipped kernels' folder (a checkout's generated/).
    assert generate_out(args.defs, args.out) == shipped_dir().resolve()
    monkeypatch.setenv("COLUMNS", "1000")  # keep the paths on one line of help
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0
    assert f"(default: {shipped_definitions_dir()})" in out and f"(default: {shipped_dir()}, the kernels" in out
    assert "./generated for your own --defs" in out


@pytest.fixture
def my_defs(tmp_path, repo_root) -> Path:
    """A user's definitions folder: a copy of the shipped block FP8 file (8 kernels, quick to render)."""
    defs = tmp_path / "my_defs"
    defs.mkdir()
    shutil.copy(repo_root / "kernel_defs" / "block_fp8.toml", defs / "mine.toml")
    return defs


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_generate_with_own_defs_writes_to_the_working_directory(capsys, monkeypatch, tmp_path, my_defs):
    shipped = snapshot(shipped_dir())
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run(capsys, "generate", "--defs", str(my_defs))
    assert code == 0, err
    assert f"in {work / 'generated'}/" in err
    assert (work / "generated" / "manifest.json").is_file()
    written = json.loads((work / "generated" / "manifest.json").read_text())
    modules = {m["module"] for kernel in written["kernels"] for m in kernel["modules"]}
    assert {p.name for p in (work / "generated").glob("*.py")} == modules and len(modules) == 9
    assert snapshot(shipped_dir()) == shipped  # the shipped kernels are untouched


def test_own_defs_never_default_to_the_shipped_kernels(capsys, monkeypatch, tmp_path, my_defs, repo_root):
    """generate --defs mine at the top of a checkout: ./generated is the shipped kernels, refused unless named."""
    top = tmp_path / "checkout"
    shutil.copytree(repo_root / "generated", top / "generated", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv(registry.GENERATED_ENV, str(top / "generated"))  # this copy stands for the shipped kernels
    monkeypatch.chdir(top)
    before = snapshot(top / "generated")
    code, out, err = run(capsys, "generate", "--defs", str(my_defs))
    assert code == 2 and out == ""
    assert err.startswith("error: --out defaults to ./generated for your own --defs")
    assert f"--out {(top / 'generated').resolve()} to replace kdsl's" in err
    assert snapshot(top / "generated") == before
    # Named explicitly, it is the user's choice: their kernels replace the ones the folder's manifest lists.
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", "generated")
    assert code == 0, err
    assert "removed" in err and len(list((top / "generated").glob("*.py"))) == 9


def test_generate_refuses_to_write_inside_the_package_unless_asked(capsys, monkeypatch, tmp_path, my_defs):
    from kdsl.runtime import manifest

    package = tmp_path / "site-packages" / "kdsl"
    (package / "generated").mkdir(parents=True)
    monkeypatch.setattr(manifest, "_PACKAGE_DIR", package)  # as if kdsl were installed there
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(package / "generated"))
    assert code == 2
    assert f"error: --out {package / 'generated'}: is inside the kdsl package ({package})" in err
    assert "--out DIR" in err and "--into-package" in err
    assert list((package / "generated").iterdir()) == []
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(package / "generated"),
                       "--into-package")
    assert code == 0, err
    assert (package / "generated" / "manifest.json").is_file()
    # --check writes nothing, so it may look inside the package.
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(package / "generated"), "--check")
    assert code == 0, err


def test_generate_removes_only_what_it_wrote(capsys, tmp_path, my_defs, repo_root):
    out = tmp_path / "kernels"
    assert run(capsys, "generate", "--defs", str(repo_root / "kernel_defs"), "--out", str(out))[0] == 0
    w4a16 = sorted(out.glob("w4a16_gemm__*.py"))
    assert w4a16
    (out / "notes.py").write_text("# my own helper\n")
    (out / "settings.json").write_text("{}\n")
    # A module with kdsl's header that the manifest does not list: a copy the user made, kept.
    (out / "copy_of_a_kernel.py").write_text((out / w4a16[0].name).read_text())
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(out))
    assert code == 0, err
    assert not any(p.exists() for p in w4a16)  # listed in the folder's manifest, with the header: removed
    assert (out / "notes.py").read_text() == "# my own helper\n" and (out / "settings.json").is_file()
    assert (out / "copy_of_a_kernel.py").is_file()
    assert f"kept {out / 'notes.py'} (kdsl did not write it)" in err
    # --check names what generate leaves alone, and fails: the folder is not what the definitions render.
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(out), "--check")
    assert code == 1
    assert f"stray: {out / 'notes.py'}" in err and "remove it by hand" in err


def test_generate_never_overwrites_a_file_it_did_not_write(capsys, tmp_path, my_defs):
    out = tmp_path / "generated"
    out.mkdir()
    (out / "manifest.json").write_text('{"another": "tool"}\n')
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(out))
    assert code == 2
    assert f"error: --out {out}/ holds manifest.json, which kdsl did not write; refusing to overwrite it" in err
    assert "nothing written" in err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # nothing written, no temporary files


def test_generate_stages_every_file_before_replacing_any(capsys, monkeypatch, tmp_path, my_defs):
    out = tmp_path / "kernels"
    out.mkdir()
    real = Path.write_text
    written = []

    def fail_on_the_third(self, *args, **kwargs):
        written.append(self.name)
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", fail_on_the_third)
    code, _, err = run(capsys, "generate", "--defs", str(my_defs), "--out", str(out))
    assert code == 2
    assert f"error: --out {out}: cannot write there" in err and "No space left on device" in err
    assert "Traceback" not in err
    assert list(out.iterdir()) == []  # neither a module nor a staged temporary file


@pytest.mark.parametrize("argv, code, message", [
    (["generate", "--out", "{file}"], 2, "error: --out {file}: is a file, not a folder"),
    (["generate", "--defs", "{missing}"], 2, "error: --defs {missing}: is not a folder of kernel definitions"),
    (["generate", "--check", "--out", "{missing}"], 1,
     "error: --out {missing}: the folder does not exist, so there is nothing to check"),
])
def test_generate_argument_errors_are_one_line_naming_the_flag(capsys, tmp_path, argv, code, message):
    names = {"file": tmp_path / "a_file.txt", "missing": tmp_path / "missing"}
    names["file"].write_text("not a folder\n")
    got, out, err = run(capsys, *[a.format(**names) for a in argv])
    assert got == code
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [next(line for line in err.splitlines() if line.startswith("error:"))]
    assert lines[0].startswith(message.format(**names))
    assert "Traceback" not in err and "differs" not in err
    assert not names["missing"].exists()


@pytest.mark.parametrize("command", [["explain", "fp8_gemm"], ["aot", "--out", "x"]])
def test_unknown_arch_is_refused_listing_the_known_ones(capsys, command):
    code, out, err = run(capsys, *command, "--arch", "sm_999")
    assert code == 2 and out == ""
    assert ("argument --arch: unknown arch 'sm_999'; known archs: sm_80, sm_86, sm_89, sm_90, sm_100, sm_120"
            in err)
    assert run(capsys, "explain", "fp8_gemm", "--arch", "sm_100")[0] in (0, 1)  # known: an answer, not a usage error


def test_generate_names_the_absolute_folder_and_how_to_use_it(capsys, monkeypatch, tmp_path, repo_root):
    monkeypatch.chdir(tmp_path)
    out_dir = (tmp_path / "mine").resolve()
    code, _, err = run(capsys, "generate", "--defs", str(repo_root / "kernel_defs"), "--out", "mine")
    assert code == 0, err
    assert f"unchanged in {out_dir}/" in err
    assert (out_dir / "manifest.json").is_file()
    assert f"export KDSL_KERNEL_PATH={out_dir}" in err
    assert f'kdsl.registry.add_generated("{out_dir}")' in err
    # A folder the runtime already reads gets no warning.
    monkeypatch.setenv(registry.KERNEL_PATH_ENV, str(out_dir))
    code, _, err = run(capsys, "generate", "--defs", str(repo_root / "kernel_defs"), "--out", "mine")
    assert code == 0, err
    assert "warning" not in err


def test_generate_from_another_directory(repo_root, tmp_path):
    out_dir = (tmp_path / "kernels").resolve()
    done = subprocess_kdsl("generate", "--defs", repo_root / "kernel_defs", "--out", out_dir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"in {out_dir}/" in done.stderr
    assert "warning:" in done.stderr and f"export KDSL_KERNEL_PATH={out_dir}" in done.stderr
    assert (out_dir / "manifest.json").is_file()
    # --defs defaults to the shipped definitions wherever the command runs.
    done = subprocess_kdsl("generate", "--check", "--out", out_dir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"{out_dir}/ is up to date" in done.stderr
