"""The Python examples in examples/ run as a user runs them: a subprocess from another folder, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, as the README says)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_example(name: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", **env}
    environment = {k: v for k, v in environment.items() if v is not None}
    return subprocess.run([sys.executable, str(REPO / "examples" / name)], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=600)


def test_quantize_and_run_matches_the_float_model_on_the_cpu(tmp_path):
    done = run_example("quantize_and_run.py", tmp_path, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # One block per scheme: its kernel path and an error within the scheme's quantization error.
    for scheme in ("block_fp8.e4m3.w128x128.a128.f32", "gptq.int4.g128.gptq"):
        [header] = [i for i, line in enumerate(lines) if line.startswith(f"{scheme}: ")]
        assert lines[header + 1].strip().startswith("relative error vs the float model: ")
        assert lines[header + 1].endswith(": ok)")
        error = float(lines[header + 1].split(": ")[1].split()[0])
        assert 0 < error < 0.15  # quantized, so not bit-equal, and close


def test_quantize_and_run_refuses_to_fall_back_to_torch_silently(tmp_path):
    done = run_example("quantize_and_run.py", tmp_path, TRITON_INTERPRET=None, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2
    assert "TRITON_INTERPRET=1" in done.stderr
