"""`kdsl aot` on the CPU: export for sm_90 (and the sm_80 refusal), compile every generated C file with the
system compiler against the cuda.h Triton ships, and check the C dispatcher's choices (kernel, tile bucket,
specialization, kernel arguments, grid) against kdsl.registry and the generated modules' own launch()
over a grid of (M, N, K, alignment) cases, with the CUDA driver stubbed. GPU runs: the examples in
examples/aot/ (docs/aot.md)."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kdsl
from kdsl.aot import abi as abis
from kdsl.ops import moe as moe_ops
from kdsl.aot import runtime as aot_runtime
from kdsl.aot.export import export
from kdsl.aot.plan import int_key, plan
from kdsl.cli import main
from kdsl.kernels import expressions, host
from kdsl.kernels.base import Generated, Launch
from kdsl.runtime import launcher

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc or gcc) on PATH")
CUDA_INCLUDE = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "include"
OPS = ("act_quant", "fp8_gemm")


def _fp8_gemm_ci_problems():
    """A CI-sized subset of fp8_gemm's representative problems: every exported sm_90 tile (tma_persistent's
    Triton tiles, M <= 128, split and not) and the portable fallback's (M > 128)."""
    for m in (1, 16, 64, 128, 4096):
        for n in (2112, 7168):
            for dtype in ("bf16", "f32"):
                yield dict(M=m, N=n, K=7168, lda=7168, ldb=7168, ldc=n, lda_s=56, ldb_s=56, out_dtype=dtype)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """act_quant and fp8_gemm for sm_90, bf16 and f32 (fp8_gemm on a CI-sized subset of its problems: the TMA
    kernel's wgmma specializations take 1-3 s each to compile)."""
    import dataclasses

    out = tmp_path_factory.mktemp("aot") / "sm90"
    kdsl.registry.reset()
    lines = []
    saved = abis.OPS["fp8_gemm"]
    abis.OPS["fp8_gemm"] = dataclasses.replace(saved, problems=_fp8_gemm_ci_problems)
    try:
        export(out, [90], list(OPS), dtypes=["bf16", "f32"], progress=lines.append)
    finally:
        abis.OPS["fp8_gemm"] = saved
    return out, lines


@pytest.fixture(scope="module")
def manifest(exported):
    return json.loads((exported[0] / "aot_manifest.json").read_text())


def compile_c(out: Path, sources: list, target: Path, extra=()) -> None:
    command = [CC, "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{out / 'include'}", f"-I{out / 'src'}",
               f"-I{CUDA_INCLUDE}", f'-DKDSL_CUBIN_DIR="{out / "cubins"}"', *map(str, sources), *extra,
               "-o", str(target), "-ldl", "-lpthread"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---- what is exported -------------------------------------------------------------------------------------

def test_launch_expressions_are_read_not_run():
    """abi.evaluate walks the parsed expression: the subset the C dispatcher also compiles, and nothing else."""
    assert abis.evaluate("cdiv(M, 64) * 2 + (K % 16 == 0) - nonzero(perm)", dict(M=65, K=32, perm=0)) == 5
    assert abis.evaluate("dtype_size(KDSL_F32) * least(M, 3)", dict(M=7)) == 12
    for outside in ("__import__('os')", "M / 2", "M // 2", "x.real", "M < K < 3", "open(M)", "1.5", "M and K"):
        with pytest.raises(abis.ExpressionError, match="outside the launch subset"):
            abis.evaluate(outside, dict(M=1, K=2, x=3))
    with pytest.raises(abis.ExpressionError, match="N has no value"):
        abis.evaluate("cdiv(M, N)", dict(M=1))


def test_manifest_lists_ops_kernels_and_cubin_hashes(exported, manifest):
    import hashlib

    out, lines = exported
    assert manifest["archs"] == ["sm_90"]
    assert {(o["op"], o["impl"], o["arch"]) for o in manifest["ops"]} == {
        ("act_quant", "rowwise", "sm_90"), ("fp8_gemm", "tma_persistent", "sm_90")}
    # The TMA kernel's wgmma tiles are exported; fp8_gemm/deferred_gluon's tiles are named with the reason and
    # routed as if disabled: to their alternatives (the Triton tiles with the same blocks); calls TMA cannot take
    # go to the portable kernel (the fallback).
    [fp8] = [o for o in manifest["ops"] if o["op"] == "fp8_gemm"]
    assert fp8["fallback"]["entry"] == "fp8_gemm__e4m3_w128x128_a128_f32__portable_sm89"
    [skipped] = [s for s in manifest["not_exported"] if "deferred_gluon" in s["kernel"]]
    assert "Gluon" in skipped["reason"]
    assert any(line.startswith("skipped fp8_gemm__") and "deferred_gluon" in line for line in lines)
    assert any(line.startswith("routed fp8_gemm__") and "KDSL_DISABLE=fp8_gemm__e4m3_w128x128_a128_f32__tma_"
               in line for line in lines)
    assert {s["impl"] for s in manifest["specializations"] if s["op"] == "fp8_gemm"} == {"tma_persistent", "portable"}
    tma = [s for s in manifest["specializations"] if s["impl"] == "tma_persistent"]
    tma_entry = kdsl.registry.select("fp8_gemm", arch=90)
    assert {s["bucket"] for s in tma} == {i for i, t in enumerate(tma_entry.tiles) if t.params["impl"] == "tma_persistent"}
    for spec in tma:  # three 2-D descriptors each, with the compiled kernel's box and swizzle
        assert [d["param"] for d in spec["tma"]] == ["a_desc", "b_desc", "c_desc"]
        assert all(len(d["box"]) == 2 and d["shape_params"] == d["stride_params"] == 2 for d in spec["tma"])
    for spec in manifest["specializations"]:
        data = (out / spec["cubin"]).read_bytes()
        assert data[:4] == b"\x7fELF"
        assert hashlib.sha256(data).hexdigest() == spec["sha256"]
        assert spec["arch"] == "sm_90" and spec["global_scratch_size"] == 0
    # Progress: one line per compiled kernel.
    assert sum(line.startswith("[") for line in lines) == len(manifest["specializations"])


def test_each_bucket_has_an_assumption_free_specialization(manifest):
    seen = {}
    for spec in manifest["specializations"]:
        if all(p["claim"] == "" and (p["kind"] in ("ptr", "desc") or p["type"] == "i32") for p in spec["params"]):
            seen.setdefault((spec["entry"], spec["bucket"]), set()).update(spec["dtypes"].values())
    entries = {(s["entry"], s["bucket"]) for s in manifest["specializations"]}
    assert set(seen) == entries
    # A K split tile's assumption-free specializations are unsplit ones; each dtype has one.
    assert all(v == {"bf16", "f32"} for v in seen.values())


def test_sm80_has_no_fp8_kernel_and_says_why(capsys, tmp_path):
    code = main(["aot", "--arch", "sm_80", "--op", "act_quant", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 1
    assert "nothing to export" in err and "needs sm_89 or newer" in err
    assert not (tmp_path / "x").exists()


def test_plan_for_sm89_and_sm90_picks_what_the_registry_picks(monkeypatch):
    kdsl.registry.reset()
    ops = (*OPS, "fp8_bmm")
    result = plan([89, 90], list(ops), generic_only=True)
    for abi, scheme, arch, entry, _ in result.selected:
        assert entry is kdsl.registry.select(abi.op, scheme, arch=arch)
    assert {(a.op, arch) for a, _, arch, *_ in result.selected} == {(op, arch) for op in ops for arch in (89, 90)}
    # fp8_gemm on sm_90 has a fallback: the registry's choice with its TMA kernel disabled.
    [(key, (fallback, _))] = result.fallbacks.items()
    tma = kdsl.registry.select("fp8_gemm", key[1], arch=90)
    monkeypatch.setenv(kdsl.registry.DISABLE_ENV, tma.name)
    kdsl.registry.reset()
    assert key[::2] == ("fp8_gemm", 90) and fallback.name == kdsl.registry.select("fp8_gemm", key[1], arch=90).name
    kdsl.registry.reset()


def test_a_dtype_an_op_does_not_take_leaves_it_out_with_the_reason():
    result = plan([80, 90], ["gptq_dequant", "act_quant"], dtypes=["f32"], generic_only=True)
    assert {abi.op for abi, *_ in result.selected} == {"act_quant"}
    assert any("gptq_dequant" in what and "no --dtype given applies to gptq_dequant (its dtypes: bf16, f16)" in why
               for what, why in result.skipped)


@pytest.mark.parametrize("argv, code, text", [
    (["aot", "--arch", "sm_90", "--op", "nope", "--out", "x"], 2, "unknown op 'nope'"),
    (["aot", "--arch", "sm_90", "--op", "weight_quant", "--out", "x"], 2, "cannot be exported yet"),
    (["aot", "--arch", "sm_90", "--scheme", "block_fp8.nope", "--out", "x"], 2, "not served"),
])
def test_cli_usage_errors_exit_2(capsys, argv, code, text):
    assert main(argv) == code
    assert text in capsys.readouterr().err


def test_cli_help_and_argparse_errors(capsys):
    with pytest.raises(SystemExit) as done:
        main(["aot", "--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "--arch" in help_text and "docs/aot.md" in help_text and "Exit 1" in help_text
    with pytest.raises(SystemExit) as done:
        main(["aot", "--out", "x"])  # no --arch
    assert done.value.code == 2


# ---- the C ------------------------------------------------------------------------------------------------

@needs_cc
def test_library_builds_with_the_generated_makefile_and_loads_without_cuda(exported, tmp_path):
    out = exported[0]
    build = tmp_path / "build"
    shutil.copytree(out, build)
    done = subprocess.run(["make", "-C", str(build), f"CUDA_INCLUDE={CUDA_INCLUDE}", f"CC={CC}",
                           "CFLAGS=-O2 -Wall -Wextra -Werror"], capture_output=True, text=True)
    if done.returncode and shutil.which("make") is None:
        pytest.skip("no make")
    assert done.returncode == 0, done.stderr
    # Loads and answers without a CUDA driver: the driver is opened on first use, and missing is an error code.
    script = f"""
import ctypes, sys
lib = ctypes.CDLL({str(build / 'libkdsl_aot.so')!r})
lib.kdsl_last_error.restype = ctypes.c_char_p
lib.kdsl_aot_archs.restype = ctypes.c_char_p
i64 = ctypes.c_int64
f = lib.kdsl_act_quant
f.argtypes = [ctypes.c_void_p, ctypes.c_int, i64, ctypes.c_void_p, ctypes.c_void_p, i64, i64, ctypes.c_void_p]
print(lib.kdsl_aot_archs().decode())
print(f(16, 0, 128, 16, 16, 4, 100, None), lib.kdsl_last_error().decode())
print(f(16, 0, 128, 16, 16, 4, 128, None), lib.kdsl_last_error().decode())
print(f(16, 1, 128, 16, 16, 4, 128, None), lib.kdsl_last_error().decode())
"""
    env = {**os.environ, "KDSL_AOT_LIBCUDA": str(tmp_path / "no_libcuda.so")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    archs, bad_k, no_driver, f16 = done.stdout.splitlines()
    assert archs == "sm_90"
    assert bad_k == "1 act_quant: K = 100 must be a multiple of the group size 128"
    assert no_driver.startswith("3 act_quant: cannot open the CUDA driver")
    assert f16.startswith("2 act_quant: x_dtype 1 was not exported")


STUB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include "kdsl_aot_internal.h"
/*INCLUDES*/

static int arch;
static CUresult init(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
static CUresult current(CUcontext *c) { *c = (CUcontext)0x1000; return CUDA_SUCCESS; }
static CUresult device(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
static CUresult attribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? arch / 10
     : a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? arch % 10
     : a == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? 132 : 232448;
  return CUDA_SUCCESS;
}
/* Split-K scratch: distinct, 256-byte aligned fake addresses; the counters' zeroing is recorded. */
static CUdeviceptr next_allocation = 0x40000000;
static int zeroed;
static CUresult mem_alloc(CUdeviceptr *p, size_t bytes) { *p = next_allocation; next_allocation += (bytes + 0xffff) & ~(size_t)0xffff; return CUDA_SUCCESS; }
static CUresult memset_d32(CUdeviceptr p, unsigned v, size_t n, CUstream s) { (void)p; (void)v; (void)n; (void)s; zeroed++; return CUDA_SUCCESS; }
/* The embedded image must be the cubin (an ELF file), or .incbin went wrong. */
static CUresult load(CUmodule *m, const void *image) {
  *m = (CUmodule)0x2000;
  return memcmp(image, "\x7f" "ELF", 4) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_IMAGE;
}
static CUresult function(CUfunction *f, CUmodule m, const char *name) { (void)m; (void)name; *f = (CUfunction)0x3000; return CUDA_SUCCESS; }
static CUresult attribute_set(CUfunction f, CUfunction_attribute a, int v) { (void)f; (void)a; (void)v; return CUDA_SUCCESS; }
/* TMA: every encode is printed (" |E,type,rank,base,dims..,strides..,box..,element strides..,interleave,swizzle,
 * l2,oob"), and the map remembers its number; the launch prints, per map argument, that number and the int32 and
 * int64 arguments after it (" |A,number,shape..,strides.."), decoded with the spec's metadata. */
static char tma_text[4096];
static int encodes;
static void note(const char *format, long long value) {
  size_t used = strlen(tma_text);
  snprintf(tma_text + used, sizeof tma_text - used, format, value);
}
static CUresult encode(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank, void *base, const cuuint64_t *dims,
                       const cuuint64_t *strides, const cuuint32_t *box, const cuuint32_t *element_strides,
                       CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                       CUtensorMapFloatOOBfill oob) {
  memset(map, 0, sizeof *map);
  map->opaque[0] = (cuuint64_t)encodes++;
  note(" |E,%lld", (long long)type);
  note(",%lld", (long long)rank);
  note(",%lld", (long long)(uintptr_t)base);
  for (cuuint32_t i = 0; i < rank; i++) note(",%lld", (long long)dims[i]);
  for (cuuint32_t i = 0; i + 1 < rank; i++) note(",%lld", (long long)strides[i]);
  for (cuuint32_t i = 0; i < rank; i++) note(",%lld", (long long)box[i]);
  for (cuuint32_t i = 0; i < rank; i++) note(",%lld", (long long)element_strides[i]);
  note(",%lld", (long long)interleave);
  note(",%lld", (long long)swizzle);
  note(",%lld", (long long)l2);
  note(",%lld", (long long)oob);
  return CUDA_SUCCESS;
}
static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, CUstream s, void **params, void **extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)extra;
  const kdsl__spec *spec = kdsl_aot_test_last_launch()->spec;
  int at = 0, maps = 0;
  for (int i = 0; i < spec->nparams; i++) {
    if (spec->claims[i] == '1') continue;
    if (spec->types[i] != 'T') { at++; continue; }
    const kdsl__tma_meta *meta = &spec->tma[maps++];
    if ((uintptr_t)params[at] % 64 != 0) return CUDA_ERROR_MISALIGNED_ADDRESS;  /* CUtensorMap wants 64 bytes */
    note(" |A,%lld", (long long)((const CUtensorMap *)params[at++])->opaque[0]);
    for (int d = 0; d < meta->shape_params; d++) note(",%lld", (long long)*(const int32_t *)params[at++]);
    for (int d = 0; d < meta->stride_params; d++) note(",%lld", (long long)*(const int64_t *)params[at++]);
  }
  return CUDA_SUCCESS;
}
static CUresult error_string(CUresult r, const char **s) { (void)r; *s = "stub"; return CUDA_SUCCESS; }

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  arch = atoi(argv[1]);
  kdsl__driver stub = {init, current, device, attribute, load, function, attribute_set, launch, error_string,
                       mem_alloc, memset_d32, encode};
  kdsl_aot_test_set_driver(&stub);
  (void)zeroed;
  char op[128];
  long long v[32];
  while (scanf("%127s", op) == 1) {
    kdsl_status status;
    memset((void *)kdsl_aot_test_last_launch(), 0, sizeof(kdsl__launch_record));
    tma_text[0] = '\0', encodes = 0;
/*CALLS*/
    const kdsl__launch_record *r = kdsl_aot_test_last_launch();
    if (status != KDSL_OK) {
      printf("error %d %s\n", (int)status, kdsl_last_error());
    } else if (!r->spec) {
      printf("ok, nothing launched\n");
    } else {
      printf("%s %u %u %u", r->spec->name, r->grid[0], r->grid[1], r->grid[2]);
      for (int i = 0; i < r->nvalues; i++) printf(" %lld", (long long)r->values[i]);
      printf("%s\n", tma_text);
    }
    fflush(stdout);
  }
  return 0;
}
"""


def probe_source(out: Path) -> str:
    """The stub-driver probe for every function an export has: reads `FUNCTION ARG...` lines, prints the
    launch (spec, grid, kernel arguments) or the error."""
    ops = json.loads((out / "aot_manifest.json").read_text())["ops"]
    calls, headers = [], sorted({f'#include "kdsl_{o["op"]}.h"' for o in ops})
    for function, op in sorted({(o["function"], o["op"]) for o in ops}):
        abi = abis.OPS[op]
        arguments = []
        for index, arg in enumerate(abi.args):
            if arg.ctype == "ptr":
                arguments.append(f"({'const ' if arg.const else ''}void *)v[{index}]")
            elif arg.ctype == "dtype":
                arguments.append(f"(kdsl_dtype)v[{index}]")
            else:
                arguments.append(f"v[{index}]")
        calls.append(f'    if (strcmp(op, "{function}") == 0) {{\n'
                     f'      for (int i = 0; i < {len(abi.args)}; i++) if (scanf("%lld", &v[i]) != 1) return 2;\n'
                     f'      status = {function}({", ".join(arguments)}, 0);\n    }} else')
    calls.append("      return 3;")
    return STUB.replace("/*INCLUDES*/", "\n".join(headers)).replace("/*CALLS*/", "\n".join(calls))


def build_probe(out: Path, folder: Path):
    (folder / "probe.c").write_text(probe_source(out))
    target = folder / "probe"
    compile_c(out, [folder / "probe.c", *sorted((out / "src").glob("*.c"))], target)

    def run(arch: int, lines: list[str]) -> list[str]:
        done = subprocess.run([str(target), str(arch)], input="\n".join(lines) + "\n", capture_output=True,
                              text=True, check=True)
        return done.stdout.splitlines()
    return run


@pytest.fixture(scope="module")
def probe(exported, tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    return build_probe(exported[0], tmp_path_factory.mktemp("probe"))


class Fake:
    """What a generated launch() reads of a tensor: shape, strides, dtype, address, device type."""

    def __init__(self, shape, strides, dtype, address):
        self.shape, self._strides, self.dtype, self._address = tuple(shape), tuple(strides), dtype, address
        self.device = types.SimpleNamespace(type="cuda", index=0)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def data_ptr(self):
        return self._address

    def dim(self):
        return len(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    def as_strided(self, shape, strides):
        return Fake(shape, strides, self.dtype, self._address)

    def view(self, *shape):
        """A reinterpreting view along a unit-stride last axis (the Gluon kernels' (scale, zero) int32 pairs), or a
        reshape of a contiguous tensor (view(-1, 16))."""
        if not isinstance(shape[0], torch.dtype):
            numel = 1
            for size in self.shape:
                numel *= size
            known = 1
            for size in shape:
                known *= size if size != -1 else 1
            shape = tuple(numel // known if size == -1 else size for size in shape)
            strides, step = [], 1
            for size in reversed(shape):
                strides.insert(0, step)
                step *= size
            return Fake(shape, tuple(strides), self.dtype, self._address)
        dtype = shape[0]
        ratio = dtype.itemsize // self.dtype.itemsize
        assert self._strides[-1] == 1 and ratio >= 1 and all(s % ratio == 0 for s in self._strides[:-1])
        return Fake(self.shape[:-1] + (self.shape[-1] // ratio,), tuple(s // ratio for s in self._strides[:-1]) + (1,),
                    dtype, self._address)


def _recording_module(entry, path=None):
    """A generated module imported apart (the entry's own, or `path`), and `calls`: module.launch(*args) appends
    (grid, params, options) of each launch its implementation's unit describes (kdsl.kernels.base.KernelImpl.launch),
    launching nothing; the SM count and split-K scratch faked (132 SMs, as the C probe's driver says; scratch at
    recognizable addresses), and dependent launches on (an sm_90 device: kernels that release their dependents do,
    as their sm_90 export does)."""
    path = Path(path or entry.module_path)
    spec = importlib.util.spec_from_file_location(f"aot_record_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    calls = []

    def scratch(kernel, device, need, tiles):
        return (Fake((need,), (1,), torch.float32, 0x7000000), Fake((tiles,), (1,), torch.int32, 0x7100000))

    unit = next(m.unit for m in entry.modules.values() if m.path.name == path.name)
    # the entry's scheme's GROUP_SIZE, ... and the numbers its launch description names
    generated = Generated(module, path.stem, entry.constexprs, abis.scheme_values(entry))

    def launch(*args):
        saved = host.sm_count, host.scratch_buffers, host.dependent_launches
        host.sm_count, host.scratch_buffers = (lambda device: 132), scratch
        host.dependent_launches = lambda device: True
        try:
            described = unit.launch(generated, *args)
            for one in [described] if isinstance(described, Launch) else described:
                calls.append((tuple(one.grid) + (1,) * (3 - len(one.grid)), one.params, one.constexprs))
        finally:
            host.sm_count, host.scratch_buffers, host.dependent_launches = saved
    return types.SimpleNamespace(launch=launch), calls


DT = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}


def _cases():
    base = 1 << 20
    for m in (1, 2, 15, 16, 17, 64, 128, 129, 1000, 4096):
        for k in (128, 256, 1536, 7168):
            for misaligned in (False, True):
                for dtype in ("bf16", "f32"):
                    ldx = k + (8 if misaligned else 0)
                    yield "act_quant", dict(x=base + (8 if misaligned else 0), x_dtype=dtype, ldx=ldx, q=2 * base,
                                            s=3 * base, M=m, K=k)
        for n in (8, 24, 576, 2112, 7168):
            for k in (128, 1536, 7168):
                for misaligned in (False, True):
                    pad = 8 if misaligned else 0
                    yield "fp8_gemm", dict(a=base + pad, lda=k + pad, a_s=2 * base, lda_s=k // 128, b=3 * base,
                                           ldb=k, b_s=4 * base + 4 * pad, ldb_s=k // 128 + pad, c=5 * base,
                                           ldc=n + pad, out_dtype="bf16" if m % 2 else "f32", M=m, N=n, K=k)


def _fp8_bmm_tensors(call: dict) -> tuple:
    """A kdsl_fp8_bmm probe call's a, a_s, b, b_s and c as stand-ins with its sizes, strides and addresses."""
    heads, m, n, k = call["B"], call["M"], call["N"], call["K"]
    ks = k // 128
    a = Fake((heads, m, k), (call["stride_ab"], call["stride_am"], 1), torch.float8_e4m3fn, call["a"])
    a_s = Fake((heads, m, ks), (call["stride_asb"], call["stride_asm"], call["stride_ask"]), torch.float32,
               call["a_s"])
    b = Fake((heads, n, k), (call["stride_bb"], call["stride_bn"], 1), torch.float8_e4m3fn, call["b"])
    b_s = Fake((heads, -(-n // 128), ks), (call["stride_bsb"], call["stride_bsn"], call["stride_bsk"]),
               torch.float32, call["b_s"])
    c = Fake((heads, m, n), (call["stride_cb"], call["stride_cm"], 1), DT[call["out_dtype"]], call["c"])
    return a, a_s, b, b_s, c


def _fp8_gemm_tensors(call):
    m, n, k = call["M"], call["N"], call["K"]
    return (Fake((m, k), (call["lda"], 1), torch.float8_e4m3fn, call["a"]),
            Fake((m, k // 128), (call["lda_s"], 1), torch.float32, call["a_s"]),
            Fake((n, k), (call["ldb"], 1), torch.float8_e4m3fn, call["b"]),
            Fake((-(-n // 128), k // 128), (call["ldb_s"], 1), torch.float32, call["b_s"]),
            Fake((m, n), (call["ldc"], 1), DT[call["out_dtype"]], call["c"]))


def _tma_takes(*pairs) -> bool:
    """Whether Triton's host TensorDescriptor accepts these (tensor, block) operands (16-byte bases and strides)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    try:
        for t, block in pairs:
            TensorDescriptor(t, list(t.shape), [t.stride(d) for d in range(len(t.shape))], block)
    except AssertionError:
        return False
    return True


def _triton_descriptor(desc, tma: dict) -> tuple[list, list]:
    """What Triton's own launcher does with a host TensorDescriptor (its nvidia driver's make_tensordesc_arg, the
    descriptor fill faked): the cuTensorMapEncodeTiled arguments its C fill_tma_descriptor passes, as the probe
    prints them, and the kernel arguments after the CUtensorMap."""
    import inspect

    import triton
    from triton.backends.nvidia import driver as nvidia

    filled = []

    def fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding, *rest):
        filled.append((address, swizzle, elem_size, elem_type, list(block), list(shape), list(strides), padding))
        return "map"
    utils = types.SimpleNamespace(fill_tma_descriptor_tiled=fill, fill_tma_descriptor=fill)
    meta = dict(swizzle=tma["swizzle"], elem_size=tma["elem_size"], elem_type=tma["elem_type"],
                block_size=tma["box"], fp4_padded=False, is_im2col=False)
    saved = triton.runtime.driver._active
    triton.runtime.driver._active = types.SimpleNamespace(utils=utils)
    try:
        extra = (None,) if len(inspect.signature(nvidia.make_tensordesc_arg).parameters) == 3 else ()
        expanded = nvidia.make_tensordesc_arg(desc, meta, *extra)
    finally:
        triton.runtime.driver._active = saved
    [(address, swizzle, elem_size, elem_type, block, shape, strides, padding)] = filled
    rank = len(shape)
    # driver.c: sizes and box innermost first, byte strides of the outer dimensions, element strides 1,
    # INTERLEAVE_NONE (0), the swizzle, L2_PROMOTION_L2_128B (2), OOB fill NONE (0) for zero padding.
    encode = [elem_type, rank, address, *shape[::-1], *[s * elem_size for s in strides[:-1]][::-1], *block[::-1],
              *[1] * rank, 0, swizzle, 2, 1 if padding else 0]
    assert expanded[0] == "map"
    return encode, list(expanded[1:])


def _descriptor_types() -> tuple:
    """Host TMA descriptors launch() may pass: Triton's and Gluon's (which names its shared layout)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor, GluonTensorDescriptor


def _check_tma(answer: str, spec: dict, params) -> None:
    """The probe's TMA records (encodes, map arguments) against Triton's for the recorded launch's descriptors."""
    TensorDescriptor = _descriptor_types()

    records = [token.split(",") for token in answer.split() if token.startswith("|")]
    encodes = [list(map(int, r[1:])) for r in records if r[0] == "|E"]
    arguments = [list(map(int, r[1:])) for r in records if r[0] == "|A"]
    descriptors = [p for p in params if isinstance(p, TensorDescriptor)]
    assert len(encodes) == len(arguments) == len(descriptors) == len(spec.get("tma", []))
    for index, (desc, tma) in enumerate(zip(descriptors, spec["tma"])):
        encode, expanded = _triton_descriptor(desc, tma)
        assert encodes[index] == encode, (spec["name"], tma["param"])
        assert arguments[index] == [index, *expanded], (spec["name"], tma["param"])


def _launch_values(params) -> list:
    """A recorded launch's parameters as the probe prints them: addresses, integers, and a descriptor's index."""
    TensorDescriptor = _descriptor_types()

    values, described = [], 0
    for p in params:
        if isinstance(p, TensorDescriptor):
            values.append(described)
            described += 1
        else:
            values.append(p.data_ptr() if isinstance(p, Fake) else p)
    return values


def _keys(params) -> tuple:
    TensorDescriptor = _descriptor_types()

    return tuple(("desc", "") if isinstance(p, TensorDescriptor) else aot_runtime.argument_key(p) for p in params)


def _expected_spec(specs, entry, bucket, dtype, keys, options):
    """Exactly Triton's specialization of the recorded launch if it was exported, else the most specific one
    whose assumptions the call meets (the rule kdsl__pick implements). launch_pdl is a launch attribute, not a
    compile option: the C launcher does not set it (see the pdl note in abi.FP8_BMM)."""
    options = {k: v for k, v in options.items() if k != "launch_pdl"}
    def usable(spec):
        for (kind, claim), p in zip(keys, spec["params"]):
            if p["kind"] == "desc":
                continue
            if p["claim"] == "1" and claim != "1" or p["claim"] == "D" and claim not in ("D",) or (
                    p["kind"] == "int" and p["type"] == "i32" and kind != "i32"):
                return False
        return True
    candidates = [s for s in specs if s["entry"] == entry.name and s["bucket"] == bucket
                  and set(s["dtypes"].values()) == {dtype} and {**s["constexprs"], **s["options"]} == options]
    exact = [s for s in candidates if all(key == (p["type"], p["claim"]) or key[0] == p["kind"] == "desc"
                                          for key, p in zip(keys, s["params"]))]
    if exact:
        return exact[0], True
    best = max((s for s in candidates if usable(s)), key=lambda s: sum(p["claim"] != "" for p in s["params"]))
    return best, False


def _disabled(monkeypatch, op, name):
    """The registry's choice for op on sm_90 with the entry `name` disabled (KDSL_DISABLE)."""
    monkeypatch.setenv(kdsl.registry.DISABLE_ENV, name)
    kdsl.registry.reset()
    try:
        return kdsl.registry.select(op, arch=90)
    finally:
        monkeypatch.delenv(kdsl.registry.DISABLE_ENV)
        kdsl.registry.reset()


def test_dispatcher_matches_the_registry_and_the_generated_launch(probe, manifest, monkeypatch):
    """act_quant and fp8_gemm on sm_90. fp8_gemm: the registry's tma_persistent tile with its Gluon tiles left out
    (the first Triton tile serving M and N) for operands TMA takes; other calls (M > 128, where only Gluon tiles
    serve, or operands TMA refuses) run the registry's choice with tma_persistent disabled. Specialization, kernel
    arguments, grid, K split and its scratch, and every CUtensorMap against the generated launch() and Triton."""
    kdsl.registry.reset()
    specs = manifest["specializations"]
    tma_entry = kdsl.registry.select("fp8_gemm", arch=90)
    assert tma_entry.impl == "tma_persistent"
    portable = _disabled(monkeypatch, "fp8_gemm", tma_entry.name)
    assert portable.impl == "portable"
    act_entry = kdsl.registry.select("act_quant", arch=90)
    recorders = {e.name: _recording_module(e) for e in (act_entry, tma_entry, portable)}
    cases = list(_cases())
    problems = {op: list(abis.OPS[op].problems()) for op in OPS}
    problems["fp8_gemm"] = list(_fp8_gemm_ci_problems())
    lines = []
    for op, call in cases:
        abi = abis.OPS[op]
        values = [abis.DTYPE_CODES[call[a.name]] if a.ctype == "dtype" else call[a.name] for a in abi.args]
        lines.append(" ".join([abis.OPS[op].function, *map(str, values)]))
    answers = probe(90, lines)
    assert len(answers) == len(cases)
    exact_hits, through = 0, {"tma": 0, "fallback": 0, "split": 0}
    for (op, call), answer in zip(cases, answers):
        m = call["M"]
        if op == "act_quant":
            entry = act_entry
            k = call["K"]
            tile = entry.tile_for(m)
            args = (Fake((m, k), (call["ldx"], 1), DT[call["x_dtype"]], call["x"]),
                    Fake((m, k), (k, 1), torch.float8_e4m3fn, call["q"]),
                    Fake((m, k // 128), (k // 128, 1), torch.float32, call["s"]), tile)
        else:
            n = call["N"]
            a, a_s, b, b_s, c = _fp8_gemm_tensors(call)
            triton_tiles = [t for t in tma_entry.tiles if t.serves(m, n) and t.params["impl"] == "tma_persistent"]
            if triton_tiles and _tma_takes((a, [16, 128]), (b, [16, 128]), (c, [16, 16])):
                entry, tile = tma_entry, triton_tiles[0].params
                through["tma"] += 1
            else:
                entry = portable
                tile = entry.tile_for(m, n)
                through["fallback"] += 1
            args = (a, a_s, b, b_s, c, tile)
        module, calls = recorders[entry.name]
        calls.clear()
        module.launch(*args)
        [(grid, params, options)] = calls
        dtype = call.get("x_dtype") or call.get("out_dtype")
        bucket = next(i for i, bt in enumerate(entry.tiles) if bt.params is tile)
        spec, exact = _expected_spec(specs, entry, bucket, dtype, _keys(params), options)
        name, *numbers = answer.split()
        assert name == spec["name"], (op, call, answer)
        numbers = [int(v) for v in numbers if not v.startswith("|")]
        assert tuple(numbers[:3]) == grid, (op, call)
        expected = _launch_values(params)
        if options.get("SPLIT_K", 1) > 1:  # ws_ptr, count_ptr: the C side's own per-context scratch
            assert all(v >= 0x40000000 and v % 256 == 0 for v in numbers[3 + 6:3 + 8]), answer
            del numbers[3 + 6:3 + 8], expected[6:8]
            through["split"] += 1
        assert numbers[3:] == expected, (op, call)
        _check_tma(answer, spec, params)
        # A call shaped like one of the op's representative problems, aligned, runs exactly what the JIT compiles.
        problem = {k: call[k] for k in next(iter(problems[op]))}
        if problem in problems[op]:
            assert exact, (op, call)
            exact_hits += 1
    assert exact_hits > 20 and min(through.values()) > 20, (exact_hits, through)


def test_fp8_gemm_gluon_tiles_route_to_their_alternatives():
    """fp8_gemm/deferred_gluon's tiles are left out as Gluon by what their module is, and the dispatcher sends
    their calls where the registry sends a call the Gluon kernel refuses: the alternative tile after each,
    tma_persistent's Triton kernel with the same blocks (aligned calls; misaligned ones go to the fallback)."""
    from kdsl.aot.plan import exported_buckets, left_out_reason, needs_fallback, route
    from kdsl.runtime.manifest import Call

    kdsl.registry.reset()
    entry = kdsl.registry.select("fp8_gemm", arch=90)
    abi = abis.OPS["fp8_gemm"]
    gluon = [i for i, t in enumerate(entry.tiles) if t.params["impl"] == "deferred_gluon"]
    assert gluon and all("Gluon" in left_out_reason(abi, entry, i) for i in gluon)
    assert not set(gluon) & set(exported_buckets(abi, entry)) and needs_fallback(abi, entry)
    for m in (1, 2, 16, 17, 64, 65, 100, 128, 129, 512, 4096):
        for n in (8, 2112, 4096, 7168, 16384, 24576):
            call = Call(m=m, n=n, device_type="cpu", dtype="bf16", align=16)  # a call the Gluon kernel refuses
            want = next(i for i, t in enumerate(entry.tiles) if t.params is entry.tile_for(m, n, call))
            aligned = dict(M=m, N=n, K=7168, lda=7168, ldb=7168, ldc=n, out_dtype="bf16", a=16, b=16, c=16)
            assert route(abi, entry, aligned) == want, (m, n)
            assert route(abi, entry, dict(aligned, lda=7168 + 8)) is None, (m, n)


def test_descriptor_expansion_is_read_from_the_ptx_and_refused_when_it_differs():
    """A host descriptor's kernel parameters come from the compiled kernel's PTX: the CUtensorMap then its shape
    (int32s) and strides (int64s), as Triton 3.6 and 3.9 pass them; any other layout fails the export, naming the
    parameter, instead of launching with misplaced arguments."""
    from kdsl.aot.worker import expansion

    params = [dict(name="a_desc", kind="desc", type="tensordesc<fp8e4nv[16, 128]>", claim="", rank=2),
              dict(name="as_ptr", kind="ptr", type="*fp32", claim="D"),
              dict(name="M", kind="int", type="i32", claim="1"),
              dict(name="N", kind="int", type="i32", claim="")]
    described, hidden = expansion(params, ["map", "u32", "u32", "u64", "u64", "u64", "u32", "u64", "u64"], "k")
    assert described == [dict(param="a_desc", shape_params=2, stride_params=2)] and hidden == 2
    with pytest.raises(RuntimeError, match="a_desc is not passed as a CUtensorMap"):  # lowered to a pointer
        expansion(params, ["u64", "u64", "u64", "u64", "u64", "u64", "u32"], "k")
    with pytest.raises(RuntimeError, match="a_desc expands to 1 int32 and 2 int64"):
        expansion(params, ["map", "u32", "u64", "u64", "u64", "u32"], "k")
    with pytest.raises(RuntimeError, match="trailing PTX parameters"):
        expansion(params, ["map", "u32", "u32", "u64", "u64", "u64", "u32", "u32"], "k")


def test_triton_launcher_expands_descriptors_as_the_c_launcher_passes_them():
    """Triton's own launcher rule (3.9: triton.backends.driver.expand_signature) for a lowered host descriptor:
    the CUtensorMap, then rank int32 and rank int64 -- what kdsl__launch passes after reading the PTX."""
    driver = pytest.importorskip("triton.backends.driver")
    if not hasattr(driver, "expand_signature"):
        pytest.skip("this Triton expands descriptors inside make_launcher")
    meta = [dict(swizzle=3, elem_size=1, elem_type=0, block_size=[1, 16, 128], fp4_padded=False)]
    assert driver.expand_signature(["tensordesc<fp8e4nv[1, 16, 128]>", "*fp32"], meta, "nvTmaDesc") == [
        "nvTmaDesc", "i32", "i32", "i32", "i64", "i64", "i64", "*fp32"]


def test_dispatcher_refusals_name_the_problem(probe):
    good = dict(a=16, lda=256, a_s=16, lda_s=2, b=16, ldb=256, b_s=16, ldb_s=2, c=16, ldc=64, out_dtype=0,
                M=4, N=64, K=256)

    def line(**changes):
        values = {**good, **changes}
        return "kdsl_fp8_gemm " + " ".join(str(values[a.name]) for a in abis.OPS["fp8_gemm"].args)
    answers = probe(90, [line(N=60), line(K=200), line(lda=100), line(out_dtype=7), line(c=0), line(M=0),
                         line(ldb_s=1)])
    assert answers[0] == "error 1 fp8_gemm: N = 60 must be a multiple of 8"
    assert answers[1] == "error 1 fp8_gemm: K = 200 must be a multiple of 128"
    assert answers[2] == "error 1 fp8_gemm: lda = 100 and ldb = 256 must be >= K = 256"
    assert answers[3] == "error 1 fp8_gemm: out_dtype = 7 is not one of KDSL_BF16, KDSL_F16, KDSL_F32"
    assert answers[4] == "error 1 fp8_gemm: a, a_s, b, b_s and c must not be NULL"
    assert answers[5] == "ok, nothing launched"  # M = 0
    assert answers[6].startswith("error 1 fp8_gemm: lda_s = 2 must be >= K / 128 and ldb_s = 1")
    # An sm_80 or sm_100 device: the sm_90 cubins cannot run there, said as such.
    [older] = probe(80, [line()])
    assert older == "error 2 fp8_gemm: this library has kernels for sm_90 only; the device is sm_80"
    [newer] = probe(100, [line()])
    assert newer.startswith("error 2") and "sm_100" in newer


# ---- Python's side: exported cubins instead of the JIT ----------------------------------------------------

def test_argument_key_is_tritons_specialization():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for value in (1, 0, 16, 17, -16, 2 ** 31 - 16, 2 ** 31, 2 ** 40 + 3):
        kind, claim = int_key(value)
        native = native_specialize_impl(BaseBackend, value, False, True, True)
        assert (kind, claim) == (("i32", "1") if native[0] == "constexpr" else (native[0], native[1]))
    for t in (torch.empty(8, dtype=torch.bfloat16), torch.empty(9, dtype=torch.float32)[1:],
              torch.empty(4, dtype=torch.float8_e4m3fn)):
        native = native_specialize_impl(BaseBackend, t, False, True, True)
        assert aot_runtime.argument_key(t) == (native[0], native[1])


def test_load_serves_exported_launches_through_the_launcher(exported, manifest, monkeypatch):
    """kdsl.aot.load makes the launcher ask the export first (a backend; no module is patched): a launch the
    export covers runs its cubin (driver faked here), one it does not goes to the JIT; unload() stops it."""
    entry = kdsl.registry.select("act_quant", arch=90)
    module = entry.load()
    original = getattr(module, entry.name)
    library = kdsl.aot.load(exported[0])
    try:
        assert getattr(module, entry.name) is original and aot_runtime._serve in launcher._BACKENDS
        launches, jitted = [], []

        class Driver:
            def launch(self, function, grid, threads, shared, stream, arguments):
                launches.append((function, grid, threads, [a.value for a in arguments]))

        class Jit:  # the module's kernel, as the launcher sees it (by its name)
            __name__ = entry.name
            arg_names = original.arg_names

            def __getitem__(self, grid):
                return lambda *params, **options: jitted.append((grid, params, options))
        library.driver = Driver()
        library.function = lambda spec, device=None: spec["name"]
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
        monkeypatch.setattr(launcher, "_INTERPRETING", True)  # the JIT call, not the compiled-kernel cache
        x = torch.empty((32, 256), dtype=torch.bfloat16)
        q = torch.empty((32, 256), dtype=torch.float8_e4m3fn)
        s = torch.empty((32, 2), dtype=torch.float32)
        tile = entry.tile_for(32)
        options = dict(BLOCK_M=tile["BLOCK_M"], ROUND_FIRST=False, num_warps=tile["num_warps"])
        before = aot_runtime.stats()
        kernel = Jit()
        launcher.run(Launch(kernel, (4, 2), (x, q, s, 32, 256, 256), options))
        [(name, grid, threads, arguments)] = launches
        spec = next(sp for sp in manifest["specializations"] if sp["name"] == name)
        assert [(p["type"], p["claim"]) for p in spec["params"]] == [
            ("*bf16", "D"), ("*fp8e4nv", "D"), ("*fp32", "D"), ("i32", "D"), ("i32", "D"), ("i32", "D")]
        assert grid == (4, 2, 1) and threads == 32 * tile["num_warps"]
        assert arguments == [x.data_ptr(), q.data_ptr(), s.data_ptr(), 32, 256, 256] + [0] * spec["hidden"]
        one_row = entry.tile_for(1)  # M = 1 has a tile of its own, and M = 1 compiled in: not passed
        launcher.run(Launch(kernel, (1, 2), (x, q, s, 1, 256, 256),
                            dict(options, BLOCK_M=one_row["BLOCK_M"], num_warps=one_row["num_warps"])))
        assert launches[-1][3] == [x.data_ptr(), q.data_ptr(), s.data_ptr(), 256, 256] + [0] * spec["hidden"]
        launcher.run(Launch(kernel, (4, 2), (x, q, s, 32, 256, 256), {**options, "BLOCK_M": 64}))  # never exported
        assert len(jitted) == 1 and len(launches) == 2
        after = aot_runtime.stats()
        assert (after["aot"] - before["aot"], after["jit"] - before["jit"]) == (2, 1)
    finally:
        kdsl.aot.unload()
    assert aot_runtime._serve not in launcher._BACKENDS and getattr(module, entry.name) is original


def test_kdsl_aot_env_loads_the_export_as_the_registry_imports_a_module(exported):
    """KDSL_AOT=DIR in a fresh process: the first generated module imported loads DIR, and the launcher asks it
    about every launch (kdsl.aot adds its hook to the runtime when kdsl is imported; the runtime imports nothing
    of it); the module itself is left as it is."""
    script = """
import kdsl
from kdsl.aot import runtime
from kdsl.runtime import launcher
entry = kdsl.registry.select("act_quant", arch=90)
module = entry.load()
print(isinstance(getattr(module, entry.name), runtime.AotKernel), runtime._serve in launcher._BACKENDS,
      runtime.loaded().folder)
"""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "KDSL_AOT": str(exported[0]),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", str(exported[0])]


def test_a_folder_without_a_manifest_is_named(tmp_path):
    with pytest.raises(aot_runtime.AotError, match="aot_manifest.json does not exist"):
        kdsl.aot.load(tmp_path)


THREADS = r"""
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "kdsl_aot_internal.h"
#include "kdsl_act_quant.h"

static int loads, launches;
static pthread_mutex_t count_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current_context;
static CUresult init(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
static CUresult current(CUcontext *c) { *c = current_context; return CUDA_SUCCESS; }
static CUresult device(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
static CUresult attribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? 0 : 232448;
  return CUDA_SUCCESS;
}
static CUresult load(CUmodule *m, const void *image) {
  (void)image;
  usleep(2000);  /* a slow load widens any window for a second load of the same cubin */
  pthread_mutex_lock(&count_lock);
  loads++;
  pthread_mutex_unlock(&count_lock);
  *m = (CUmodule)0x2000;
  return CUDA_SUCCESS;
}
static CUresult function(CUfunction *f, CUmodule m, const char *name) { (void)m; (void)name; *f = (CUfunction)0x3000; return CUDA_SUCCESS; }
static CUresult attribute_set(CUfunction f, CUfunction_attribute a, int v) { (void)f; (void)a; (void)v; return CUDA_SUCCESS; }
static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, CUstream s, void **params, void **extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)params; (void)extra;
  pthread_mutex_lock(&count_lock);
  launches++;
  pthread_mutex_unlock(&count_lock);
  return CUDA_SUCCESS;
}
static CUresult error_string(CUresult r, const char **s) { (void)r; *s = "stub"; return CUDA_SUCCESS; }
static CUresult mem_alloc(CUdeviceptr *p, size_t bytes) { (void)bytes; *p = 0x40000000; return CUDA_SUCCESS; }
static CUresult memset_d32(CUdeviceptr p, unsigned v, size_t n, CUstream s) { (void)p; (void)v; (void)n; (void)s; return CUDA_SUCCESS; }

static void *worker(void *arg) {
  long index = (long)arg;
  current_context = (CUcontext)(0x1000 + 0x100 * (index % 2));  /* two contexts, four threads each */
  for (int i = 0; i < 50; i++) {
    long long m = i % 2 ? 1 : 32;  /* two specializations */
    if (kdsl_act_quant((void *)4096, KDSL_BF16, 256, (void *)8192, (void *)12288, m, 256, 0) != KDSL_OK) {
      printf("error %s\n", kdsl_last_error());
      return (void *)1;
    }
  }
  return NULL;
}

int main(void) {
  kdsl__driver stub = {init, current, device, attribute, load, function, attribute_set, launch, error_string,
                       mem_alloc, memset_d32, NULL};
  kdsl_aot_test_set_driver(&stub);
  /* No context on this thread: an error code, not a crash or an exit. */
  kdsl_status status = kdsl_act_quant((void *)4096, KDSL_BF16, 256, (void *)8192, (void *)12288, 4, 256, 0);
  printf("no context: %d %s\n", (int)status, kdsl_last_error());
  pthread_t threads[8];
  for (long i = 0; i < 8; i++) pthread_create(&threads[i], NULL, worker, (void *)i);
  long failed = 0;
  for (int i = 0; i < 8; i++) {
    void *result;
    pthread_join(threads[i], &result);
    failed |= (long)result;
  }
  printf("failed %ld loads %d launches %d\n", failed, loads, launches);
  return 0;
}
"""


@needs_cc
def test_cubins_load_once_per_context_from_many_threads(exported, tmp_path):
    out = exported[0]
    (tmp_path / "threads.c").write_text(THREADS)
    compile_c(out, [tmp_path / "threads.c", *sorted((out / "src").glob("*.c"))], tmp_path / "threads")
    done = subprocess.run([str(tmp_path / "threads")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    no_context, counts = done.stdout.splitlines()
    assert no_context.startswith("no context: 4 act_quant: no CUDA context is current on this thread")
    # 8 threads x 50 calls; 2 specializations x 2 contexts = 4 loads, however the threads interleave.
    assert counts == "failed 0 loads 4 launches 400"


# ---- sm_80: gptq_dequant, whose launch computes constexprs from the call (act-order, uniform groups) -------

GPTQ_SCHEMES = ("gptq.int4.g128.gptq", "gptq.int4.gall.gptq_v2")


@pytest.fixture(scope="module")
def exported80(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "sm80"
    kdsl.registry.reset()
    export(out, [80], ["gptq_dequant"], schemes=list(GPTQ_SCHEMES), progress=lambda line: None)
    return out


def test_sm80_export_has_one_function_per_scheme(exported80):
    manifest = json.loads((exported80 / "aot_manifest.json").read_text())
    assert sorted(o["function"] for o in manifest["ops"]) == [
        "kdsl_gptq_dequant__gptq_int4_g128_gptq", "kdsl_gptq_dequant__gptq_int4_gall_gptq_v2"]
    header = (exported80 / "include" / "kdsl_gptq_dequant.h").read_text()
    assert "kdsl_status kdsl_gptq_dequant__gptq_int4_g128_gptq(const void *qweight" in header
    # Both values of each run-time constexpr were compiled (act-order or not).
    variants = {(s["entry"], tuple(s["variant"])) for s in manifest["specializations"]}
    for entry in {s["entry"] for s in manifest["specializations"]}:
        assert {v for e, v in variants if e == entry} >= {(0, 1), (1, 0)}


@needs_cc
def test_gptq_dequant_dispatcher_matches_the_registry_and_the_generated_launch(exported80, tmp_path):
    run = build_probe(exported80, tmp_path)
    manifest = json.loads((exported80 / "aot_manifest.json").read_text())
    specs = manifest["specializations"]
    functions = {o["scheme"]: o["function"] for o in manifest["ops"]}
    base = 1 << 20
    cases = []
    for scheme in GPTQ_SCHEMES:
        group = 128 if "g128" in scheme else None
        for n in (8, 24, 4096, 11008):
            for k in (128, 4096, 11008):
                groups = 1 if group is None else k // group
                for act_order in (False, True):
                    for pad in (0, 8):
                        for dtype in ("f16", "bf16"):
                            cases.append((scheme, dict(
                                qweight=base + 4 * pad, ldqw=n + pad, qzeros=2 * base, ldqz=n // 8,
                                scales=3 * base, lds=n + pad, scales_dtype=dtype,
                                g_idx=4 * base if act_order else 0, w=5 * base, N=n, K=k), groups))
    answers = run(80, [" ".join([functions[scheme], *(str(abis.DTYPE_CODES[call[a.name]]) if a.ctype == "dtype"
                                                      else str(call[a.name]) for a in abis.OPS["gptq_dequant"].args)])
                       for scheme, call, _ in cases])
    assert len(answers) == len(cases)
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}
    recorders = {}
    for (scheme, call, groups), answer in zip(cases, answers):
        entry = kdsl.registry.select("gptq_dequant", scheme, arch=80)
        if scheme not in recorders:
            recorders[scheme] = _recording_module(entry)
        module, calls = recorders[scheme]
        calls.clear()
        n, k = call["N"], call["K"]
        tile = entry.tile_for(n)
        module.launch(Fake((k // 8, n), (call["ldqw"], 1), torch.int32, call["qweight"]),
                      Fake((groups, n // 8), (call["ldqz"], 1), torch.int32, call["qzeros"]),
                      Fake((groups, n), (call["lds"], 1), dt[call["scales_dtype"]], call["scales"]),
                      Fake((k,), (1,), torch.int32, call["g_idx"]) if call["g_idx"] else None,
                      Fake((n, k), (k, 1), dt[call["scales_dtype"]], call["w"]), tile)
        [(grid, params, options)] = calls
        keys = tuple(aot_runtime.argument_key(p) for p in params)
        bucket = entry.tiles.index(next(b for b in entry.tiles if b.params is tile))
        spec, _ = _expected_spec(specs, entry, bucket, call["scales_dtype"], keys, options)
        name, *numbers = answer.split()
        assert name == spec["name"], (scheme, call, answer)
        numbers = list(map(int, numbers))
        assert tuple(numbers[:3]) == grid
        assert numbers[3:] == [p.data_ptr() if isinstance(p, Fake) else p for p in params]
    # Refusals name the problem.
    good = dict(qweight=16, ldqw=64, qzeros=16, ldqz=8, scales=16, lds=64, scales_dtype=0, g_idx=0, w=16, N=64, K=256)

    def line(**changes):
        values = {**good, **changes}
        args = abis.OPS["gptq_dequant"].args
        return "kdsl_gptq_dequant__gptq_int4_g128_gptq " + " ".join(str(values[a.name]) for a in args)
    k_bad, dtype_bad = run(80, [line(K=192), line(scales_dtype=2)])
    assert k_bad == "error 1 gptq_dequant: K = 192 must be a multiple of the group size 128"
    assert dtype_bad == "error 1 gptq_dequant: scales_dtype = 2 is not one of KDSL_F16, KDSL_BF16"
    # sm_80 cubins run on sm_86 (same major, newer minor), not on sm_90.
    [ampere] = run(86, [line()])
    assert ampere.startswith("gptq_dequant__int4_g128_gptq__blockwise_sm80__sm80_b0_")
    [hopper] = run(90, [line()])
    assert hopper == "error 2 gptq_dequant: this library has kernels for sm_80 only; the device is sm_90"


# ---- w4a16_gemm (kdsl_gptq_gemm on prepared weights): K split, scratch, run-time constexprs, Gluon routing --

# (arch, scheme, generic only). sm_90 g128: the Gluon GEMV (gemv_mma_gluon) serves contiguous groups at M <= 8.
W4A16_EXPORTS = ((80, "w4a16.int4.g128", False), (90, "w4a16.int4.g128", True))


def _w4a16_ci_problems():
    """A CI-sized subset of the op's representative problems (the full set compiles ~500 kernels per scheme)."""
    for m in (1, 16, 64, 256):
        for perm, contiguous in ((0, 1), (1, 1)):
            yield dict(M=m, N=4096, K=4096, ldx=4096, ldqw=4096, ldz=4096, lds=4096, ldy=4096, perm=perm,
                       contiguous_groups=contiguous, x_dtype="f16")


def test_an_alternative_only_refused_calls_reach_is_planned_from_those_calls(tmp_path):
    """A definition's alternative tile (the same m_max as the tile before it) that no representative size reaches,
    only the calls its predecessor refuses (here groups that change inside a plane tile, which the Gluon GEMV
    refuses): its specializations take the constexprs those calls take. Planned from every declared value of each
    run-time constexpr instead, planes_mma got ASM_DEQUANT without UNIFORM_GROUP, which does not compile."""
    from kdsl.codegen import plan_kernels, render_all, write
    from kdsl.schema import load_definitions

    defs = tmp_path / "defs"
    defs.mkdir()
    text = (Path(__file__).resolve().parents[1] / "kernel_defs" / "w4a16.toml").read_text()
    anchor = "options = { pdl = true, gather_pdl = true, plain_pdl = true }\n\n# split_k is an upper bound"
    assert text.count(anchor) == 1  # after the M = 2-8 GEMV tile: its alternative, a planes_mma tile of 8 rows
    alternative = ("[[variants.tiles]]\nm_max = 8\nblock_m = 16\nblock_n = 128\nblock_k = 128\nsplit_k = 8\n"
                   "num_warps = 4\nnum_stages = 4\noptions = { split_min_steps = 8 }\n\n")
    (defs / "w4a16.toml").write_text(text.replace(anchor, anchor.replace("# split_k", alternative + "# split_k")))
    write(render_all(plan_kernels(load_definitions(defs))), tmp_path / "kernels")
    kdsl.registry.add_generated(tmp_path / "kernels")
    try:
        tiles = kdsl.registry.select("w4a16_gemm", "w4a16.int4.g128", arch="sm_90").tiles
        [alternative_bucket] = [i for i in range(1, len(tiles)) if tiles[i].m_max == 8 and tiles[i].n_min is None
                                and tiles[i - 1].params["impl"] == "gemv_mma_gluon"
                                and tiles[i].params["impl"] == "planes_mma"]
        result = plan([90], ["w4a16_gemm"], schemes=["w4a16.int4.g128"], generic_only=True,
                      problems={"w4a16_gemm": _w4a16_ci_problems})
    finally:
        kdsl.registry.remove_generated(tmp_path / "kernels")
    # The calls the GEMV refuses reach the alternative: groups that are not uniform over a plane tile (and, with
    # uniform groups, a K the GEMV has no cubin for).
    reached = [s.constexprs for s in result.specs if s.bucket == alternative_bucket]
    assert any(not runtime["UNIFORM_GROUP"] for runtime in reached), reached
    for spec in (s for s in result.specs if s.impl == "planes_mma"):
        runtime = spec.constexprs
        assert runtime["ASM_DEQUANT"] == runtime["UNIFORM_GROUP"], (spec.name, runtime)
        assert not runtime["SCALE_AFTER"] or runtime["UNIFORM_GROUP"], (spec.name, runtime)


@pytest.fixture(scope="module")
def exported_w4a16(tmp_path_factory):
    """w4a16_gemm, f16, for sm_80 (mma + gemv) and sm_90 (planes_mma + gemv + the Gluon gemv_mma_gluon and
    overlap_gluon), 110 s on 2 cores with an empty Triton cache."""
    import dataclasses

    saved = abis.OPS["w4a16_gemm"]
    abis.OPS["w4a16_gemm"] = dataclasses.replace(saved, problems=_w4a16_ci_problems)
    outs, lines = {}, {}
    try:
        kdsl.registry.reset()
        for arch, scheme, generic in W4A16_EXPORTS:
            out = tmp_path_factory.mktemp("aot") / f"w4a16_sm{arch}"
            lines[arch] = []
            export(out, [arch], ["w4a16_gemm"], schemes=[scheme], dtypes=["f16"], generic_only=generic,
                   progress=lines[arch].append)
            outs[arch] = out
    finally:
        abis.OPS["w4a16_gemm"] = saved
    return outs, lines


def test_w4a16_gluon_kernels_are_exported_and_every_call_has_a_cubin(exported_w4a16):
    outs, lines = exported_w4a16
    m90 = json.loads((outs[90] / "aot_manifest.json").read_text())
    assert [(o["function"], o["impl"]) for o in m90["ops"]] == [("kdsl_gptq_gemm", "planes_mma")]
    assert not m90["not_exported"] and not m90["routes"]  # both Gluon kernels are exported: nothing is routed
    assert not any(line.startswith(("skipped", "routed")) for line in lines[90])
    assert {s["impl"] for s in m90["specializations"]} == {"planes_mma", "gemv", "gemv_mma_gluon", "overlap_gluon"}
    # overlap_gluon: its three Gluon host descriptors (x, the plane words, the pairs) as CUtensorMaps, every tile.
    overlap = [s for s in m90["specializations"] if s["impl"] == "overlap_gluon"]
    assert {s["bucket"] for s in overlap} == {10, 12, 14, 16, 18, 20}
    assert all([t["param"] for t in s["tma"]] == ["x_desc", "w_desc", "p_desc"] for s in overlap)
    # The Gluon GEMV: one cubin per K the (CI) problems reach on its tiles (none reaches M = 1 with N >= 8192 or
    # 1 < M <= 8: there, those of the problems moved to the tile's bounds),
    # with and without act-order, and the symbol is the Gluon kernel's.
    gluon = [s for s in m90["specializations"] if s["impl"] == "gemv_mma_gluon"]
    assert {(s["bucket"], s["constexprs"]["K"], s["constexprs"]["HAS_PERM"]) for s in gluon} == {
        (b, 4096, p) for b in (0, 2, 5, 6, 8) for p in (False, True)}
    # The module's kernel serves every group size: the export is specialized on the scheme's GROUP_SIZE constexpr.
    assert {s["symbol"] for s in gluon} == {"w4a16_gemm__int4__gemv_mma_gluon_sm90"}
    assert all(s["constexprs"]["GROUP_SIZE"] == 128 for s in m90["specializations"])
    assert all(s["hidden"] == 2 and s["constexprs"]["num_warps"] == s["options"]["num_warps"] for s in gluon)
    m80 = json.loads((outs[80] / "aot_manifest.json").read_text())
    assert {s["impl"] for s in m80["specializations"]} == {"mma", "gemv"} and not m80["not_exported"]
    # Every exported Triton tile has unsplit, assumption-free cubins with and without act-order, and with and
    # without uniform groups (g128 fills sm_80's K blocks and sm_90's 128-row plane tiles): whatever the call,
    # a cubin serves it.
    for manifest in (m80, m90):
        flags = {}
        triton_specs = [s for s in manifest["specializations"] if not s["impl"].endswith("_gluon")]
        for s in triton_specs:
            if s["constexprs"]["SPLIT_K"] == 1 and all(p["claim"] == "" for p in s["params"]):
                flags.setdefault(s["bucket"], set()).add((s["constexprs"]["HAS_PERM"], s["constexprs"]["UNIFORM_GROUP"]))
        assert set(flags) == {s["bucket"] for s in triton_specs}
        assert all(v == {(p, u) for p in (False, True) for u in (False, True)} for v in flags.values()), flags


def _w4a16_recorders(entry, impls):
    """Each exported implementation's module imported apart, recording its launches (_recording_module)."""
    return {impl: _recording_module(entry, entry.modules[impl].path) for impl in impls}


def _w4a16_cases(arch):
    base = 1 << 24
    for m in (1, 2, 8, 16, 17, 64, 65, 128, 300):
        for n, k in ((4096, 4096), (8192, 4096), (16384, 1024), (8192, 14336), (24, 256)):
            for perm, contiguous in ((0, 1), (1, 1), (1, 0), (0, 0)):
                for pad in (0, 8, 4):  # 4: x and the scales' rows 8-byte aligned only (no TMA: overlap_gluon refuses)
                    for dtype in ("f16", "bf16") if m in (1, 16) and pad == 0 else ("f16",):
                        paired = arch == 90
                        yield dict(x=base + 2 * pad, ldx=k + pad, perm=2 * base if perm else 0, qweight=3 * base,
                                   ldqw=n, zeros=4 * base + (2 if paired else 0), ldz=(2 * n if paired else n) + pad,
                                   scales=4 * base if paired else 5 * base, lds=(2 * n if paired else n) + pad,
                                   groups=6 * base, contiguous_groups=contiguous, y=7 * base, ldy=n + pad,
                                   x_dtype=dtype, M=m, N=n, K=k)


@needs_cc
@pytest.mark.parametrize("arch, scheme, generic", W4A16_EXPORTS)
def test_w4a16_dispatcher_matches_the_registry_and_the_generated_launch(exported_w4a16, tmp_path, monkeypatch,
                                                                         arch, scheme, generic):
    """Tile (the Gluon tiles' refused calls, and the Gluon GEMV's at a K it was not exported for, routed to their
    alternatives, as the registry routes calls they refuse), K split (from the SM count, or the largest exported split below it), specialization, kernel
    arguments and grid, against kdsl.registry and the generated modules' launch()."""
    from kdsl.aot.plan import exported_buckets
    from kdsl.ops import _checks

    out = exported_w4a16[0][arch]
    run = build_probe(out, tmp_path)
    manifest = json.loads((out / "aot_manifest.json").read_text())
    specs = manifest["specializations"]
    cases = list(_w4a16_cases(arch))
    answers = run(arch, ["kdsl_gptq_gemm " + " ".join(
        str(abis.DTYPE_CODES[call[a.name]]) if a.ctype == "dtype" else str(call[a.name])
        for a in abis.OPS["w4a16_gemm"].args) for call in cases])
    assert len(answers) == len(cases)
    entry = kdsl.registry.select("w4a16_gemm", scheme, arch=arch)
    exported = exported_buckets(abis.OPS["w4a16_gemm"], entry)
    recorders = _w4a16_recorders(entry, {entry.tiles[i].params["impl"] for i in exported})
    group = entry.scheme_fields["group_size"]
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}
    routed = fell_back = exact_hits = 0
    gluon_hits = set()  # the Gluon GEMV's tiles that ran a call
    for call, answer in zip(cases, answers):
        m, n, k, dtype = call["M"], call["N"], call["K"], call["x_dtype"]
        if dtype == "bf16":  # exported for f16 only
            assert answer == "error 2 w4a16_gemm: x_dtype 0 was not exported (this library has KDSL_F16; export with --dtype)"
            continue
        groups = -(-k // (group if group > 0 else k))
        paired = arch == 90
        x = Fake((m, k), (call["ldx"], 1), dt[dtype], call["x"])
        scales = Fake((groups, n), (call["lds"], 2 if paired else 1), dt[dtype], call["scales"])
        # The registry's tile for this call on the GPU (kdsl.ops' facts, alignment included), with the tiles left
        # out of the export refused, and the Gluon GEMV's tiles refusing a K they have no cubin for ...
        on_gpu = kdsl.registry.Call(m=m, n=n, device_type="cuda", dtype="float16",
                                    act_order=bool(call["perm"]), contiguous_groups=bool(call["contiguous_groups"]),
                                    align=_checks.alignment(x, scales))
        with monkeypatch.context() as patched:
            patched.setattr(type(entry), "refusal_reason", _w4a16_exported_refusal(entry, exported, specs, k))
            tile = entry.tile_for(m, n, on_gpu)
        bucket = next(i for i, b in enumerate(entry.tiles) if b.params is tile)
        assert bucket in exported
        first = entry.tiles[entry.bucket_index(m, n)].params["impl"]
        if first.endswith("_gluon") and tile["impl"] != first:
            routed += 1
        if tile["impl"].endswith("_gluon"):
            gluon_hits.add(bucket)
        module, calls = recorders[tile["impl"]]
        perm = Fake((k,), (1,), torch.int32, call["perm"]) if call["perm"] else None
        if paired:
            kt, nt = -(-k // 128), -(-n // 128)
            qweight = Fake((nt, kt, 128, 16), (kt * 2048, 2048, 16, 1), torch.int32, call["qweight"])
        else:
            qweight = Fake((k // 8, n), (call["ldqw"], 1), torch.int32, call["qweight"])
        zeros = Fake((groups, n), (call["ldz"], 2 if paired else 1), dt[dtype], call["zeros"])
        y = Fake((m, n), (call["ldy"], 1), dt[dtype], call["y"])
        args = (x, perm, qweight, zeros, scales, Fake((k,), (1,), torch.int32, call["groups"]),
                bool(call["contiguous_groups"]), y, tile)
        assert not answer.startswith("error"), (call, answer)
        name, *numbers = answer.split()
        numbers = [int(v) for v in numbers if not v.startswith("|")]  # |E, |A: TMA records, checked below
        calls.clear()
        module.launch(*args)
        [(grid, params, options)] = calls
        if numbers[1] != grid[1]:
            # The split launch() takes was not exported: the C side took the largest exported one below it.
            wanted = options["SPLIT_K"]
            assert numbers[1] < wanted and not any(
                s["bucket"] == bucket and s["constexprs"]["SPLIT_K"] == wanted and
                {**s["constexprs"], **s["options"]} == options for s in specs), (call, answer)
            fell_back += 1
            with monkeypatch.context() as patched:  # the launch description's split helpers
                for helper in ("split_for", "split_cap"):
                    patched.setitem(expressions.HELPERS, helper, lambda *a, chosen=numbers[1]: chosen)
                calls.clear()
                module.launch(*args)
                [(grid, params, options)] = calls
        spec, exact = _expected_spec(specs, entry, bucket, dtype, _keys(params), options)
        assert name == spec["name"], (call, answer)
        assert tuple(numbers[:3]) == grid, call
        expected = _launch_values(params)
        _check_tma(answer, spec, params)
        if tile["impl"] == "gemv_mma_gluon":  # no K split, no scratch; K is compiled in
            assert numbers[3:] == expected and options["K"] == k, call
            exact_hits += exact
            continue
        # ws_ptr, count_ptr: the C side's own per-context scratch when split
        at = 4 if tile["impl"] == "overlap_gluon" else 7
        scratch = slice(at, at + 2)
        if grid[1] == 1:
            assert numbers[3:][scratch] == [call["y"], call["y"]]
        else:
            assert all(v >= 0x40000000 and v % 256 == 0 for v in numbers[3:][scratch]), answer
        del expected[scratch], numbers[3 + at:3 + at + 2]
        assert numbers[3:] == expected, call
        exact_hits += exact
    # sm_90: the Gluon GEMV runs calls at M <= 8 with contiguous groups and an exported K; the other calls its
    # tiles serve (act-order's uneven groups, K = 1024, 14336, 256) go to the Triton tile after it.
    if arch == 90:
        assert routed > 20 and gluon_hits == {0, 2, 5, 6, 8, 10, 12, 14, 16, 18, 20}, (routed, gluon_hits)
    else:
        assert routed == 0 and not gluon_hits, (routed, gluon_hits)
    if not generic:
        assert exact_hits > 20
    assert fell_back > 0 if arch == 90 else True


def _w4a16_exported_refusal(entry, exported, specs, k):
    """KernelEntry.refusal_reason as the export's dispatcher sees it: tiles left out refuse every call, the Gluon
    GEMV's tiles a K with no cubin in the manifest, the rest as their modules say."""
    original = type(entry).refusal_reason

    def refusal_reason(self, params, call):
        if self is entry:
            index = next(i for i, b in enumerate(entry.tiles) if b.params is params)
            if index not in exported:
                return "left out of the export"
            if params["impl"] == "gemv_mma_gluon" and k not in {
                    s["constexprs"]["K"] for s in specs if s["bucket"] == index}:
                return f"K = {k} was not exported"
        return original(self, params, call)
    return refusal_reason


@needs_cc
def test_w4a16_refusals_and_scratch_reuse(exported_w4a16, tmp_path):
    run = build_probe(exported_w4a16[0][90], tmp_path)
    good = dict(x=16, ldx=4096, perm=0, qweight=16, ldqw=4096, zeros=18, ldz=8192, scales=16, lds=8192, groups=16,
                contiguous_groups=1, y=16, ldy=4096, x_dtype=1, M=16, N=4096, K=4096)

    def line(**changes):
        values = {**good, **changes}
        return "kdsl_gptq_gemm " + " ".join(str(values[a.name]) for a in abis.OPS["w4a16_gemm"].args)
    wide = dict(N=8192, ldqw=8192, ldz=16384, lds=16384, ldy=8192)
    answers = run(90, [line(N=60), line(K=0), line(contiguous_groups=2), line(ldx=100), line(groups=0),
                       line(x_dtype=2), line(M=0), line(), line(K=8192, ldx=8192), line(**wide), line(**wide, M=12)])
    assert answers[0] == "error 1 w4a16_gemm: N = 60 and K = 4096 must be multiples of 8"
    assert answers[1] == "error 1 w4a16_gemm: M = 16 and N = 4096 must be >= 0, K = 0 > 0"
    assert answers[2] == "error 1 w4a16_gemm: contiguous_groups = 2 must be 0 or 1"
    assert answers[3] == "error 1 w4a16_gemm: ldx = 100 must be >= K = 4096"
    assert answers[4].startswith("error 1 w4a16_gemm: x, qweight, zeros, scales, groups and y must not be NULL")
    assert answers[5] == "error 1 w4a16_gemm: x_dtype = 2 is not one of KDSL_F16, KDSL_BF16"
    assert answers[6] == "ok, nothing launched"
    # M = 16, K = 4096: the 16-row Gluon GEMV (a program per 16 columns); K = 8192 is above its k_max, which C
    # refuses as Python does, so the MMA tile after it runs.
    assert answers[7].split()[1:4] == ["256", "1", "1"], answers[7]
    assert answers[8].split()[0] != answers[7].split()[0] and answers[8].split()[1] == "32", answers[8]
    # Split launches share the context's scratch: the second one (the same tile and split) reuses the first
    # one's buffers.
    first, second = (a.split() for a in answers[9:])
    assert int(first[2]) > 1 and first[3 + 7:3 + 9] == second[3 + 7:3 + 9]
    [sm80] = run(80, [line()])
    assert sm80 == "error 2 w4a16_gemm: this library has kernels for sm_90 only; the device is sm_80"


# ---- fp8_bmm (kdsl_fp8_bmm): 3-D TMA descriptors over strided views, refusals to the portable alternative ------

def _fp8_bmm_ci_problems():
    """A CI-sized subset of fp8_bmm's MLA problems (transposed activations): both sm_90 TMA tiles and both
    portable ones."""
    for heads in (16,):
        for m in (1, 16, 64, 1024):
            for n, k in ((512, 128), (128, 512)):
                yield dict(B=heads, M=m, N=n, K=k, stride_ab=k, stride_am=heads * k, stride_bb=n * k, stride_bn=k,
                           stride_cb=m * n, stride_cm=n, stride_asb=k // 128, stride_asm=heads * k // 128,
                           stride_ask=1, stride_bsb=-(-n // 128) * (k // 128), stride_bsn=k // 128, stride_bsk=1,
                           out_dtype="bf16")


@pytest.fixture(scope="module")
def exported_bmm(tmp_path_factory):
    """fp8_bmm for sm_89 (portable) and sm_90 (tma_persistent, its alternatives portable), bf16 and f32."""
    import dataclasses

    out = tmp_path_factory.mktemp("aot") / "bmm"
    saved = abis.OPS["fp8_bmm"]
    abis.OPS["fp8_bmm"] = dataclasses.replace(saved, problems=_fp8_bmm_ci_problems)
    lines = []
    try:
        kdsl.registry.reset()
        export(out, [89, 90], ["fp8_bmm"], dtypes=["bf16", "f32"], progress=lines.append)
    finally:
        abis.OPS["fp8_bmm"] = saved
    return out, lines


def _fp8_bmm_cases():
    base = 1 << 24
    for heads in (1, 16, 128):
        for m in (1, 5, 16, 17, 64, 300, 1024):
            for n, k in ((512, 128), (128, 512), (16, 128)):
                for layout in ("transposed", "contiguous", "misaligned", "broadcast"):
                    ks = k // 128
                    if layout == "transposed":  # MLA: [M, heads, K] activations; a [M, heads, N] output buffer
                        a_strides, as_strides = (k, heads * k), (ks, heads * ks, 1)
                        c_strides = (n, heads * n) if m % 2 else (m * n, n)
                    elif layout == "misaligned":  # a row stride of 8 bytes more: TMA refuses, portable serves
                        a_strides, as_strides, c_strides = (m * (k + 8), k + 8), (m * ks, ks, 1), (m * n, n)
                    elif layout == "broadcast":  # one weight for every head: b's batch stride 0
                        a_strides, as_strides, c_strides = (m * k, k), (m * ks, ks, 1), (m * n, n)
                    else:
                        a_strides, as_strides, c_strides = (m * k, k), (m * ks, ks, 1), (m * n, n)
                    b_batch = 0 if layout == "broadcast" else n * k
                    yield dict(a=base, stride_ab=a_strides[0], stride_am=a_strides[1], a_s=2 * base,
                               stride_asb=as_strides[0], stride_asm=as_strides[1], stride_ask=as_strides[2],
                               b=3 * base, stride_bb=b_batch, stride_bn=k, b_s=4 * base,
                               stride_bsb=-(-n // 128) * ks, stride_bsn=ks, stride_bsk=1,
                               c=5 * base + (8 if layout == "misaligned" and m % 2 else 0), stride_cb=c_strides[0],
                               stride_cm=c_strides[1],
                               out_dtype="bf16" if layout == "transposed" or (m + heads) % 2 else "f32",
                               B=heads, M=m, N=n, K=k)


@needs_cc
@pytest.mark.parametrize("arch", (89, 90))
def test_fp8_bmm_dispatcher_matches_the_registry_and_the_generated_launch(exported_bmm, tmp_path, arch):
    """The registry's tile for the call's facts (the TMA module's refusal reads kdsl.ops' alignment of a, b and
    c; refused calls take the portable alternative tile after it), then specialization, arguments, grid and
    every 3-D CUtensorMap against the generated launch() and Triton's own descriptor handling."""
    from kdsl.ops import _checks as check

    out, lines = exported_bmm
    manifest = json.loads((out / "aot_manifest.json").read_text())
    assert {(o["arch"], o["impl"]) for o in manifest["ops"]} == {("sm_89", "portable"), ("sm_90", "tma_persistent")}
    assert not manifest["not_exported"] and not any(o.get("fallback") for o in manifest["ops"])
    specs = manifest["specializations"]
    run = build_probe(out, tmp_path)
    cases = list(_fp8_bmm_cases())
    args = abis.OPS["fp8_bmm"].args
    answers = run(arch, ["kdsl_fp8_bmm " + " ".join(
        str(abis.DTYPE_CODES[call[a.name]]) if a.ctype == "dtype" else str(call[a.name]) for a in args)
        for call in cases])
    assert len(answers) == len(cases)
    kdsl.registry.reset()
    entry = kdsl.registry.select("fp8_bmm", arch=arch)
    recorders = {impl: _recording_module(entry, module.path) for impl, module in entry.modules.items()}
    problems = list(_fp8_bmm_ci_problems())
    exact_hits, by_impl = 0, {}
    for call, answer in zip(cases, answers):
        heads, m, n, k = call["B"], call["M"], call["N"], call["K"]
        a, a_s, b, b_s, c = _fp8_bmm_tensors(call)
        facts = kdsl.registry.Call(m=m, n=n, device_type="cuda", dtype="float8_e4m3fn", align=check.alignment(a, b, c),
                                   batch=heads)
        tile = entry.tile_for(m, n, facts)
        by_impl[tile["impl"]] = by_impl.get(tile["impl"], 0) + 1
        module, calls = recorders[tile["impl"]]
        calls.clear()
        module.launch(a, a_s, b, b_s, c, tile)
        if tile.get("pdl"):  # the recording module runs as under the interpreter, which launches pdl tiles plainly
            calls[0][2]["PDL"] = True
        [(grid, params, options)] = calls
        bucket = next(i for i, bt in enumerate(entry.tiles) if bt.params is tile)
        spec, exact = _expected_spec(specs, entry, bucket, call["out_dtype"], _keys(params), options)
        assert not answer.startswith("error"), (call, answer)
        name, *numbers = answer.split()
        assert name == spec["name"], (call, answer)
        numbers = [int(v) for v in numbers if not v.startswith("|")]
        assert tuple(numbers[:3]) == grid, (call, answer)
        assert numbers[3:] == _launch_values(params), (call, answer)
        _check_tma(answer, spec, params)
        problem = {key: call[key] for key in problems[0]}
        if problem in problems and call["a"] % 16 == 0:
            assert exact, call
            exact_hits += 1
    if arch == 90:
        assert by_impl["tma_persistent"] > 100 and by_impl["portable"] > 50, by_impl
    else:
        assert set(by_impl) == {"portable"}
    assert exact_hits >= 6, exact_hits


@needs_cc
def test_fp8_bmm_refusals_name_the_problem(exported_bmm, tmp_path):
    run = build_probe(exported_bmm[0], tmp_path)
    good = dict(a=16, stride_ab=128, stride_am=2048, a_s=16, stride_asb=1, stride_asm=16, stride_ask=1, b=16,
                stride_bb=65536, stride_bn=128, b_s=16, stride_bsb=4, stride_bsn=1, stride_bsk=1, c=16,
                stride_cb=512, stride_cm=8192, out_dtype=0, B=16, M=4, N=512, K=128)

    def line(**changes):
        values = {**good, **changes}
        return "kdsl_fp8_bmm " + " ".join(str(values[a.name]) for a in abis.OPS["fp8_bmm"].args)
    answers = run(90, [line(N=24), line(K=100), line(stride_am=-1), line(b_s=0), line(B=0), line(M=2 ** 31)])
    assert answers[0] == "error 1 fp8_bmm: N = 24 must be a multiple of 16"
    assert answers[1] == "error 1 fp8_bmm: K = 100 must be a multiple of 128"
    assert answers[2] == "error 1 fp8_bmm: strides must be >= 0"
    assert answers[3] == "error 1 fp8_bmm: a, a_s, b, b_s and c must not be NULL"
    assert answers[4] == "ok, nothing launched"
    assert answers[5] == "error 1 fp8_bmm: sizes and strides must fit in 32 bits"
    [older] = run(80, [line()])
    assert older == "error 2 fp8_bmm: this library has kernels for sm_89, sm_90 only; the device is sm_80"


# ---- fp8_grouped_gemm / fp8_grouped_gemm_masked: the MoE grouped GEMMs, tile bucket by rows per expert ---------

def _grouped_ci_problems():
    """A CI-sized subset of fp8_grouped_gemm's problems: DeepSeek-V3's TP-8 slice (256 experts), rows per expert
    1, 64 and 128 (each of the three tiles), bf16 and f32."""
    return moe_ops.fp8_grouped_gemm_problems(((256, 512, 7168), (256, 7168, 256)), ms=(128, 16384, 32768),
                                          dtypes=("bf16", "f32"))


def _masked_ci_problems():
    """The same for the masked layout: max_m 1, 64 and 256 with expected_m 0 and top-8's share."""
    return moe_ops.fp8_grouped_gemm_masked_problems(((256, 512, 7168), (256, 7168, 256)), max_ms=(1, 64, 256),
                                                 dtypes=("bf16", "f32"))


GROUPED_OPS = ("fp8_grouped_gemm", "fp8_grouped_gemm_masked")


@pytest.fixture(scope="module")
def exported_grouped(tmp_path_factory):
    """Both grouped GEMMs for sm_89 and sm_90 (the portable kernels), bf16 and f32, on the CI problems."""
    import dataclasses

    out = tmp_path_factory.mktemp("aot") / "grouped"
    saved = {op: abis.OPS[op] for op in GROUPED_OPS}
    abis.OPS["fp8_grouped_gemm"] = dataclasses.replace(saved["fp8_grouped_gemm"], problems=_grouped_ci_problems)
    abis.OPS["fp8_grouped_gemm_masked"] = dataclasses.replace(saved["fp8_grouped_gemm_masked"],
                                                              problems=_masked_ci_problems)
    lines = []
    try:
        kdsl.registry.reset()
        export(out, [89, 90], list(GROUPED_OPS), dtypes=["bf16", "f32"], progress=lines.append)
    finally:
        abis.OPS.update(saved)
    return out, lines


def _grouped_cases():
    """kdsl_fp8_grouped_gemm calls: (E, M, N, K) over every tile bucket (M / E of 1 to 16384), M not a multiple of
    the padding too, row strides padded or not, a misaligned output, an expert stride 0 (one weight for all)."""
    base = 1 << 24
    for experts in (1, 8, 256):
        for m in (1, 100, 128, 4096, 16384, 2400 * experts // 8):
            for n, k in ((512, 7168), (7168, 256), (24, 128)):
                for layout in ("contiguous", "padded", "misaligned", "broadcast"):
                    pad = 8 if layout in ("padded", "misaligned") else 0
                    ks = k // 128
                    yield dict(a=base, lda=k + 16 * (layout == "padded"), a_s=2 * base, lda_s=ks + pad,
                               b=3 * base, stride_be=0 if layout == "broadcast" else n * k, stride_bn=k,
                               b_s=4 * base, stride_bse=0 if layout == "broadcast" else -(-n // 128) * ks,
                               stride_bsn=ks, group_ids=5 * base, c=6 * base + (8 if layout == "misaligned" else 0),
                               ldc=n + pad, out_dtype="bf16" if (m + experts) % 2 else "f32", M=m, N=n, K=k,
                               E=experts)


def _masked_cases():
    """kdsl_fp8_grouped_gemm_masked calls: (E, max_m, N, K, expected_m) over every tile bucket, contiguous or with
    padded row strides, a misaligned output."""
    base = 1 << 24
    for experts in (1, 8, 256):
        for max_m in (1, 16, 17, 64, 200):
            for expected_m in (0, 1, 65):
                for n, k in ((512, 7168), (7168, 256), (24, 128)):
                    for layout in ("contiguous", "padded", "misaligned"):
                        pad = 8 if layout != "contiguous" else 0
                        ks = k // 128
                        yield dict(a=base, stride_ae=max_m * (k + 16 * pad), stride_am=k + 16 * pad, a_s=2 * base,
                                   stride_ase=max_m * (ks + pad), stride_asm=ks + pad, b=3 * base, stride_be=n * k,
                                   stride_bn=k, b_s=4 * base, stride_bse=-(-n // 128) * ks, stride_bsn=ks,
                                   masked_m=5 * base, c=6 * base + (8 if layout == "misaligned" else 0),
                                   stride_ce=max_m * (n + pad), stride_cm=n + pad,
                                   out_dtype="bf16" if (max_m + expected_m) % 2 else "f32",
                                   E=experts, max_m=max_m, N=n, K=k, expected_m=expected_m)


def _grouped_tensors(call: dict) -> tuple:
    """A kdsl_fp8_grouped_gemm probe call's a, a_s, b, b_s, group_ids and c as stand-ins."""
    m, n, k, experts = call["M"], call["N"], call["K"], call["E"]
    ks = k // 128
    return (Fake((m, k), (call["lda"], 1), torch.float8_e4m3fn, call["a"]),
            Fake((m, ks), (call["lda_s"], 1), torch.float32, call["a_s"]),
            Fake((experts, n, k), (call["stride_be"], call["stride_bn"], 1), torch.float8_e4m3fn, call["b"]),
            Fake((experts, -(-n // 128), ks), (call["stride_bse"], call["stride_bsn"], 1), torch.float32, call["b_s"]),
            Fake((m,), (1,), torch.int32, call["group_ids"]),
            Fake((m, n), (call["ldc"], 1), DT[call["out_dtype"]], call["c"]))


def _masked_tensors(call: dict) -> tuple:
    experts, max_m, n, k = call["E"], call["max_m"], call["N"], call["K"]
    ks = k // 128
    return (Fake((experts, max_m, k), (call["stride_ae"], call["stride_am"], 1), torch.float8_e4m3fn, call["a"]),
            Fake((experts, max_m, ks), (call["stride_ase"], call["stride_asm"], 1), torch.float32, call["a_s"]),
            Fake((experts, n, k), (call["stride_be"], call["stride_bn"], 1), torch.float8_e4m3fn, call["b"]),
            Fake((experts, -(-n // 128), ks), (call["stride_bse"], call["stride_bsn"], 1), torch.float32, call["b_s"]),
            Fake((experts,), (1,), torch.int32, call["masked_m"]),
            Fake((experts, max_m, n), (call["stride_ce"], call["stride_cm"], 1), DT[call["out_dtype"]], call["c"]))


def _probe_line(abi, call: dict) -> str:
    return " ".join([abi.function, *(str(abis.DTYPE_CODES[call[a.name]]) if a.ctype == "dtype" else str(call[a.name])
                                     for a in abi.args)])


@needs_cc
@pytest.mark.parametrize("arch", (89, 90))
def test_grouped_gemm_dispatchers_match_the_registry_and_the_generated_launch(exported_grouped, tmp_path, arch):
    """Both grouped GEMMs: the registry's tile for the rows per expert kdsl.ops buckets by (ceil(M / E); expected_m
    or max_m), then specialization, kernel arguments and grid against the unit's launch() (launch, launch_masked),
    and aligned calls of the representative problems get exactly the JIT's specialization."""
    out, lines = exported_grouped
    manifest = json.loads((out / "aot_manifest.json").read_text())
    assert {(o["op"], o["arch"], o["impl"]) for o in manifest["ops"]} == {
        (op, a, "portable") for op in GROUPED_OPS for a in ("sm_89", "sm_90")}
    assert not manifest["not_exported"] and not manifest["routes"] and not any(o.get("fallback") for o in manifest["ops"])
    specs = manifest["specializations"]
    run = build_probe(out, tmp_path)
    cases = [("fp8_grouped_gemm", call) for call in _grouped_cases()] + \
            [("fp8_grouped_gemm_masked", call) for call in _masked_cases()]
    answers = run(arch, [_probe_line(abis.OPS[op], call) for op, call in cases])
    assert len(answers) == len(cases)
    kdsl.registry.reset()
    entries = {op: kdsl.registry.select(op, arch=arch) for op in GROUPED_OPS}
    recorders = {op: _recording_module(entry) for op, entry in entries.items()}
    problems = {"fp8_grouped_gemm": list(_grouped_ci_problems()),
                "fp8_grouped_gemm_masked": list(_masked_ci_problems())}
    exact_hits, buckets = 0, {op: set() for op in GROUPED_OPS}
    for (op, call), answer in zip(cases, answers):
        entry = entries[op]
        if op == "fp8_grouped_gemm":
            tensors = _grouped_tensors(call)
            tile = entry.tile_for(max(1, -(-call["M"] // call["E"])), call["N"])  # kdsl.ops.fp8_grouped_gemm
        else:
            tensors = _masked_tensors(call)
            tile = entry.tile_for(call["expected_m"] or call["max_m"], call["N"])
        module, calls = recorders[op]
        calls.clear()
        module.launch(*tensors, tile)
        [(grid, params, options)] = calls
        bucket = next(i for i, bt in enumerate(entry.tiles) if bt.params is tile)
        buckets[op].add(bucket)
        spec, exact = _expected_spec(specs, entry, bucket, call["out_dtype"], _keys(params), options)
        assert not answer.startswith("error"), (op, call, answer)
        name, *numbers = answer.split()
        assert name == spec["name"], (op, call, answer)
        numbers = [int(v) for v in numbers]
        assert tuple(numbers[:3]) == grid, (op, call, answer)
        assert numbers[3:] == _launch_values(params), (op, call, answer)
        problem = {key: call[key] for key in problems[op][0]}
        if problem in problems[op] and call["c"] % 16 == 0:
            assert exact, (op, call)
            exact_hits += 1
    assert all(found == set(range(len(entries[op].tiles))) for op, found in buckets.items()), buckets
    assert exact_hits >= 6, exact_hits


@needs_cc
def test_grouped_gemm_refusals_name_the_problem(exported_grouped, tmp_path):
    run = build_probe(exported_grouped[0], tmp_path)
    grouped = dict(a=16, lda=256, a_s=16, lda_s=2, b=16, stride_be=65536, stride_bn=256, b_s=16, stride_bse=4,
                   stride_bsn=2, group_ids=16, c=16, ldc=256, out_dtype="bf16", M=256, N=256, K=256, E=8)
    masked = dict(a=16, stride_ae=4096, stride_am=256, a_s=16, stride_ase=32, stride_asm=2, b=16, stride_be=65536,
                  stride_bn=256, b_s=16, stride_bse=4, stride_bsn=2, masked_m=16, c=16, stride_ce=4096,
                  stride_cm=256, out_dtype="bf16", E=8, max_m=16, N=256, K=256, expected_m=0)

    def line(op, **changes):
        return _probe_line(abis.OPS[op], {**(grouped if op == "fp8_grouped_gemm" else masked), **changes})
    g, m = "fp8_grouped_gemm", "fp8_grouped_gemm_masked"
    answers = run(90, [line(g, K=200), line(g, E=0), line(g, lda=100), line(g, lda_s=1), line(g, stride_be=-1),
                       line(g, group_ids=0), line(g, M=0), line(g, M=2 ** 31), line(g, out_dtype="f16"),
                       line(m, K=0), line(m, expected_m=-1), line(m, stride_cm=8), line(m, stride_ase=-4),
                       line(m, E=70000), line(m, masked_m=0), line(m, max_m=0), line(m, E=0, a=0)])
    assert answers == [
        "error 1 fp8_grouped_gemm: K = 200 must be a multiple of 128",
        "error 1 fp8_grouped_gemm: E = 0: expected at least one expert (b [E, N, K])",
        "error 1 fp8_grouped_gemm: lda = 100 and stride_bn = 256 must be >= K = 256",
        "error 1 fp8_grouped_gemm: lda_s = 1 must be >= K / 128 and stride_bsn = 2 >= K / 128",
        "error 1 fp8_grouped_gemm: stride_be = -1 and stride_bse = 4 must be >= 0",
        "error 1 fp8_grouped_gemm: a, a_s, b, b_s, group_ids and c must not be NULL",
        "ok, nothing launched",
        "error 1 fp8_grouped_gemm: sizes and strides must fit in 32 bits",
        "error 2 fp8_grouped_gemm: out_dtype 1 was not exported (this library has KDSL_BF16, KDSL_F32; export with "
        "--dtype)",
        "error 1 fp8_grouped_gemm_masked: E = 8, max_m = 16 and N = 256 must be >= 0, K = 0 > 0",
        "error 1 fp8_grouped_gemm_masked: expected_m = -1 must be >= 0 (0: max_m)",
        "error 1 fp8_grouped_gemm_masked: stride_cm = 8 must be >= N = 256",
        "error 1 fp8_grouped_gemm_masked: strides must be >= 0",
        "error 1 fp8_grouped_gemm_masked: E = 70000 experts: at most 65535 (one grid row per expert)",
        "error 1 fp8_grouped_gemm_masked: a, a_s, b, b_s, masked_m and c must not be NULL",
        "ok, nothing launched",
        "ok, nothing launched",  # E = 0: nothing to read, not even a
    ]
    [older] = run(80, [line(g)])
    assert older == "error 2 fp8_grouped_gemm: this library has kernels for sm_89, sm_90 only; the device is sm_80"


@needs_cc
def test_moe_example_compiles_against_the_exported_headers(exported_grouped):
    """examples/aot/moe_example.c (run on a GPU by run_moe_example.py) calls the functions as the headers declare
    them: checked here without linking (no libcuda on the CPU runners)."""
    out, _ = exported_grouped
    example = Path(__file__).resolve().parents[1] / "examples" / "aot" / "moe_example.c"
    done = subprocess.run([CC, "-std=gnu11", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", f"-I{out / 'include'}",
                           f"-I{CUDA_INCLUDE}", str(example)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_grouped_gemm_buckets_are_the_ops_rows_per_expert():
    """The bucket M the plan and the dispatcher use is what kdsl.ops passes tile_for: ceil(M / E) for the contiguous
    layout, expected_m or max_m for the masked one; a tile no problem reaches is compiled at its bound."""
    from kdsl.aot.plan import _moved, bucket_m, route

    kdsl.registry.reset()
    grouped, masked = abis.OPS["fp8_grouped_gemm"], abis.OPS["fp8_grouped_gemm_masked"]
    [problem] = moe_ops.fp8_grouped_gemm_problems([(256, 512, 7168)], ms=(4096,), dtypes=("bf16",))
    assert bucket_m(grouped, problem) == 16
    [default, hinted] = moe_ops.fp8_grouped_gemm_masked_problems([(256, 512, 7168)], max_ms=(128,), dtypes=("bf16",))
    assert (default["expected_m"], hinted["expected_m"]) == (0, 4)
    assert (bucket_m(masked, default), bucket_m(masked, hinted)) == (128, 4)
    for abi, problem in ((grouped, problem), (masked, default)):
        entry = kdsl.registry.select(abi.op, arch=90)
        for index, tile in enumerate(entry.tiles):
            [moved] = _moved(abi, entry, index, [problem])
            assert route(abi, entry, moved) == index
            assert bucket_m(abi, moved) == (tile.m_max or 1 + max(t.m_max for t in entry.tiles if t.m_max))
    assert moe_ops.contiguous_rows(1, 8, 256) == 8 * 128 and moe_ops.contiguous_rows(4096, 8, 256) == 256 * 128


# ---- Python's side with TMA descriptors: fp8_gemm / fp8_bmm tma_persistent launches from the cubins -------

class _FakeCuda:
    """The CUDA driver entry points _Driver calls (plain functions: ctypes sets argtypes on them), recording each
    cuTensorMapEncodeTiled call as the C probe prints it and reading the kernel parameters cuLaunchKernel gets
    with the sizes `layout` names (128: a CUtensorMap, 4: int32, 8: int64 or a pointer)."""

    def __init__(self):
        self.encodes, self.launches, self.layout = [], [], None

        def encode(out, host_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, fill):
            assert out % 64 == 0, "a CUtensorMap must be 64-byte aligned"
            tag = len(self.encodes) + 1
            self.encodes.append([host_type, rank, address, *dims[:rank], *strides[:rank - 1], *box[:rank],
                                 *element_strides[:rank], interleave, swizzle, l2, fill])
            ctypes.memmove(out, tag.to_bytes(8, "little") * 16, 128)
            return 0

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, pointers, extra):
            assert len(pointers) == len(self.layout), (len(pointers), len(self.layout))
            values = []
            for address, size in zip(pointers, self.layout):
                if size == 128:
                    raw = ctypes.string_at(address, 128)
                    assert raw == raw[:8] * 16
                    values.append(("map", int.from_bytes(raw[:8], "little")))
                else:
                    values.append((ctypes.c_int32 if size == 4 else ctypes.c_int64).from_address(address).value)
            self.launches.append((function, (gx, gy, gz), bx, shared, values))
            return 0
        self.cuTensorMapEncodeTiled, self.cuLaunchKernel = encode, launch


def _served_from_cubins(folder, manifest, entry, launches, monkeypatch):
    """Serve each recorded (kernel, grid, params, options) from the loaded export (an AotKernel), the driver
    faked: every one must run its exported specialization (exactly the JIT's), each descriptor (if any) encoded as
    Triton's launcher encodes it, and the kernel parameters laid out as kdsl__launch lays them out."""
    TensorDescriptor = _descriptor_types()
    specs = manifest["specializations"]
    library = kdsl.aot.load(folder)
    jitted = []  # the launches the export declined (kdsl.runtime.launcher then takes them to Triton's JIT)

    try:
        fake = _FakeCuda()
        library.driver = aot_runtime._Driver(cuda=fake)
        library.function = lambda spec, device=None: spec["name"]
        monkeypatch.setattr(aot_runtime, "_stream", lambda device: 0)
        kernels = {}
        before = aot_runtime.stats()
        for kernel, grid, params, options, bucket, dtype in launches:
            if kernel not in kernels:
                kernels[kernel] = aot_runtime.AotKernel(None, library.tables[kernel], library)
            spec, exact = _expected_spec(specs, entry, bucket, dtype, _keys(params), options)
            assert exact, (kernel, options)
            # The parameters kdsl__launch passes: compiled-in ones dropped, each descriptor its CUtensorMap then
            # its shape (int32) and strides (int64), the hidden scratch pointers (NULL) last.
            descriptors = [p for p in params if isinstance(p, TensorDescriptor)]
            layout, expected, encodes, maps = [], [], [], iter(spec["tma"])
            values = iter(_launch_values(params))
            for p, value in zip(spec["params"], values):
                if p["claim"] == "1":
                    continue
                if p["kind"] == "desc":
                    tma = next(maps)
                    encode, expanded = _triton_descriptor(descriptors[value], tma)
                    encodes.append(encode)
                    layout += [128] + [4] * tma["shape_params"] + [8] * tma["stride_params"]
                    expected += [("map", len(fake.encodes) + len(encodes))] + expanded
                else:
                    layout.append(4 if p["type"] == "i32" else 8)
                    expected.append(value)
            layout += [8] * spec["hidden"]
            expected += [0] * spec["hidden"]
            fake.layout = layout
            library.driver.maps.clear()  # each launch encodes its maps (the cache is checked below)
            if not kernels[kernel].serve(grid, params, options):
                jitted.append((grid, params, options))
            assert not jitted, (kernel, options)
            name, got_grid, threads, shared, got = fake.launches[-1]
            assert name == spec["name"] and got_grid == grid and threads == 32 * spec["num_warps"]
            assert shared == spec["shared"]
            assert fake.encodes[-len(encodes):] == encodes, spec["name"]
            assert got == expected, spec["name"]
        # A repeated launch reuses its CUtensorMaps: nothing encoded again.
        encoded = len(fake.encodes)
        assert kernels[kernel].serve(grid, params, options)
        assert len(fake.encodes) == encoded and fake.launches[-1][4] == got
        after = aot_runtime.stats()
        assert (after["aot"] - before["aot"], after["jit"] - before["jit"]) == (len(launches) + 1, 0)
        if not descriptors:  # plain pointers (the grouped GEMMs): launch options never exported go to the JIT
            assert not kernels[kernel].serve(grid, params, {**options, "num_warps": 2 * options["num_warps"]})
            assert aot_runtime.stats()["jit"] - after["jit"] == 1
            return
        # A descriptor the export does not describe (a block no tile has, or NaN padding) goes to the JIT.
        index = next(i for i, p in enumerate(params) if isinstance(p, TensorDescriptor))
        desc = params[index]
        Descriptor = type(desc)
        for changed in (Descriptor(desc.base, desc.shape, desc.strides, [2 * b for b in desc.block_shape]),
                        Descriptor(desc.base, desc.shape, desc.strides, desc.block_shape, padding="nan")):
            if not kernels[kernel].serve(grid, (*params[:index], changed, *params[index + 1:]), options):
                jitted.append(changed)
        assert len(jitted) == 2 and aot_runtime.stats()["jit"] - after["jit"] == 2
    finally:
        kdsl.aot.unload()


def test_python_serves_fp8_gemm_tma_launches_from_cubins(exported, manifest, monkeypatch):
    """kdsl.aot.load: tma_persistent's Triton tiles (host TensorDescriptors for a, b and c; split and unsplit)
    run their exported cubins from Python, each CUtensorMap encoded as the C launcher and Triton's do."""
    kdsl.registry.reset()
    entry = kdsl.registry.select("fp8_gemm", arch=90)
    assert entry.impl == "tma_persistent"
    module, calls = _recording_module(entry)
    launches, splits = [], 0
    base = 1 << 20
    for problem in _fp8_gemm_ci_problems():
        m, n = problem["M"], problem["N"]
        tiles = [t for t in entry.tiles if t.serves(m, n) and t.params["impl"] == "tma_persistent"]
        if not tiles:
            continue
        call = dict(problem, a=base, a_s=2 * base, b=3 * base, b_s=4 * base, c=5 * base)
        calls.clear()
        module.launch(*_fp8_gemm_tensors(call), tiles[0].params)
        [(grid, params, options)] = calls
        splits += options["SPLIT_K"] > 1
        bucket = next(i for i, bt in enumerate(entry.tiles) if bt is tiles[0])
        launches.append((Path(entry.module_path).stem, grid, params, options, bucket, problem["out_dtype"]))
    assert len(launches) >= 12 and splits >= 2, (len(launches), splits)
    _served_from_cubins(exported[0], manifest, entry, launches, monkeypatch)


def test_python_serves_fp8_bmm_tma_launches_from_cubins(exported_bmm, monkeypatch):
    """The same for fp8_bmm's 3-D descriptors over MLA's transposed views; pdl tiles pass launch_pdl=True, a
    launch attribute the cubin is served without (see AotKernel._prepare)."""
    from kdsl.ops import _checks as check

    out, _ = exported_bmm
    manifest = json.loads((out / "aot_manifest.json").read_text())
    kdsl.registry.reset()
    entry = kdsl.registry.select("fp8_bmm", arch=90)
    module_path = entry.modules["tma_persistent"].path
    module, calls = _recording_module(entry, module_path)
    problems = list(_fp8_bmm_ci_problems())
    launches, pdl = [], 0
    for call in _fp8_bmm_cases():
        if {key: call[key] for key in problems[0]} not in problems or call["out_dtype"] != "bf16":
            continue
        heads, m, n, k = call["B"], call["M"], call["N"], call["K"]
        a, a_s, b, b_s, c = _fp8_bmm_tensors(call)
        facts = kdsl.registry.Call(m=m, n=n, device_type="cuda", dtype="float8_e4m3fn", align=check.alignment(a, b, c),
                                   batch=heads)
        tile = entry.tile_for(m, n, facts)
        if tile["impl"] != "tma_persistent":
            continue
        calls.clear()
        module.launch(a, a_s, b, b_s, c, tile)
        [(grid, params, options)] = calls
        if tile.get("pdl"):  # as launch() passes them on a GPU (the recording module runs as the interpreter)
            options = dict(options, PDL=True, launch_pdl=True)
            pdl += 1
        bucket = next(i for i, bt in enumerate(entry.tiles) if bt.params is tile)
        launches.append((Path(module_path).stem, grid, params, options, bucket, call["out_dtype"]))
    assert len(launches) >= 4, len(launches)
    print(f"{len(launches)} fp8_bmm launches, {pdl} of pdl tiles")
    _served_from_cubins(out, manifest, entry, launches, monkeypatch)


def test_python_serves_grouped_gemm_launches_from_cubins(exported_grouped, monkeypatch):
    """kdsl.aot.load: recorded launches of both grouped GEMMs (every tile; the int32 group ids and row counts as
    pointers) run their exported cubins from Python with the parameters kdsl__launch passes."""
    out, _ = exported_grouped
    manifest = json.loads((out / "aot_manifest.json").read_text())
    base = 1 << 24
    for op, problems, tensors in (("fp8_grouped_gemm", _grouped_ci_problems, _grouped_tensors),
                                  ("fp8_grouped_gemm_masked", _masked_ci_problems, _masked_tensors)):
        kdsl.registry.reset()
        entry = kdsl.registry.select(op, arch=90)
        module, calls = _recording_module(entry)
        launches = []
        for problem in problems():
            if problem["out_dtype"] != "bf16":
                continue
            call = dict(problem, a=base, a_s=2 * base, b=3 * base, b_s=4 * base, group_ids=5 * base,
                        masked_m=5 * base, c=6 * base)
            tile = entry.tile_for(max(1, -(-call["M"] // call["E"])) if "M" in call else
                                  call["expected_m"] or call["max_m"], call["N"])
            calls.clear()
            module.launch(*tensors(call), tile)
            [(grid, params, options)] = calls
            bucket = next(i for i, bt in enumerate(entry.tiles) if bt.params is tile)
            launches.append((Path(entry.module_path).stem, grid, params, options, bucket, "bf16"))
        assert {bucket for *_, bucket, _ in launches} == set(range(len(entry.tiles))), op
        _served_from_cubins(out, manifest, entry, launches, monkeypatch)


def test_gluon_descriptors_are_keyed_by_their_default_layout():
    """A Gluon descriptor is served only with the NVMMA layout the export compiled it with (the default of its
    block and element type, as the modules' _shared_layout gives it); another layout goes to the JIT."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    aot_runtime._DESCRIPTORS.update(aot_runtime._descriptor_classes())
    for dtype in (torch.float16, torch.float8_e4m3fn):
        aot_runtime._POINTER_TYPES.setdefault(dtype, "*" + aot_runtime._TRITON_TYPES[str(dtype)])
    x = Fake((64, 4096), (4096, 1), torch.float16, 1 << 20)
    default = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    desc = GluonTensorDescriptor(x, [64, 4096], [4096, 1], [64, 64], default)
    assert aot_runtime._argument_key(desc) == ("tensordesc<fp16[64, 64]>", "")
    other = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    assert other != default
    assert aot_runtime._argument_key(GluonTensorDescriptor(x, [64, 4096], [4096, 1], [64, 64], other)) is None


def test_gluon_descriptor_launch_is_encoded_as_tritons(monkeypatch):
    """A launch with a Gluon descriptor (overlap_gluon's kind) from a spec of the manifest's form: its CUtensorMap
    encoded as Triton's launcher encodes a Gluon descriptor, and the parameters laid out as kdsl__launch's."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    aot_runtime._DESCRIPTORS.update(aot_runtime._descriptor_classes())
    for dtype in (torch.float16, torch.int32):
        aot_runtime._POINTER_TYPES.setdefault(dtype, "*" + aot_runtime._TRITON_TYPES[str(dtype)])
    elem_type = next(iter(TMA_DTYPE_DEVICE_TO_HOST))
    tma = dict(param="x_desc", shape_params=2, stride_params=2, swizzle=3, elem_size=2, elem_type=elem_type,
               host_type=int(TMA_DTYPE_DEVICE_TO_HOST[elem_type]), box=[64, 64])
    spec = dict(name="overlap_like", kernel="k", hidden=2, num_warps=4, shared=1024, tma=[tma], constexprs={},
                options={"num_warps": 4},
                params=[dict(name="x_desc", kind="desc", type="tensordesc<fp16[64, 64]>", claim="", rank=2),
                        dict(name="y", kind="ptr", type="*fp16", claim="D"),
                        dict(name="one", kind="int", type="i32", claim="1"),
                        dict(name="n", kind="int", type="i32", claim="")])
    keys = tuple((p["type"], p["claim"]) for p in spec["params"])
    library = aot_runtime.AotLibrary.__new__(aot_runtime.AotLibrary)
    fake = _FakeCuda()
    library.driver = aot_runtime._Driver(cuda=fake)
    library.function = lambda spec, device=None: spec["name"]
    monkeypatch.setattr(aot_runtime, "_stream", lambda device: 0)
    kernel = aot_runtime.AotKernel(None, {((("num_warps", 4),), keys): spec}, library)
    x = Fake((300, 4096), (4104, 1), torch.float16, 1 << 20)
    y = Fake((300, 4096), (4096, 1), torch.float16, 2 << 20)
    desc = GluonTensorDescriptor(x, [300, 4096], [4104, 1], [64, 64],
                                 gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16))
    fake.layout = [128, 4, 4, 8, 8, 8, 4, 8, 8]
    before = aot_runtime.stats()["aot"]
    assert kernel.serve((5,), (desc, y, 1, 17), dict(num_warps=4))
    assert aot_runtime.stats()["aot"] == before + 1
    encode, expanded = _triton_descriptor(desc, tma)
    assert fake.encodes == [encode]
    [(name, grid, threads, shared, values)] = fake.launches
    assert (name, grid, threads, shared) == ("overlap_like", (5, 1, 1), 128, 1024)
    assert values == [("map", 1), *expanded, y.data_ptr(), 17, 0, 0]


def test_launch_values_are_the_ops_c_arguments():
    """A launch description is evaluated in Python on what its `values` gives for a call, and compiled in C on the
    op's C arguments: the two name the same things (every name `values` gives is a C argument of the op, with its
    kind: a tensor or None for a pointer, an integer for a size, stride or dtype), checked on the op's example
    calls (kdsl.ops.spec.OpSpec.example, on meta tensors)."""
    from kdsl.kernels import CATALOGUE
    from kdsl.ops.library import declared_specs

    examples = {spec.name: spec.example for spec in declared_specs()}
    checked = 0
    for unit in CATALOGUE:
        for description in unit.launch_descriptions.values():
            abi = abis.OPS[unit.op]
            kinds = {arg.name: arg.ctype for arg in abi.args}
            tile = kdsl.registry.select(unit.op, arch=90).tiles[0].params
            for args in examples[unit.op](tile, torch.float16 if unit.family == "w4a16" else torch.bfloat16,
                                          "meta"):
                values = description.values(*args)
                for name, value in values.items():
                    assert name in kinds, f"{unit.op}/{unit.impl}: values gives {name}, not a C argument of {unit.op}"
                    if kinds[name] == "ptr":
                        assert value is None or isinstance(value, torch.Tensor), (unit.impl, name)
                    else:
                        assert type(value) is int, (unit.impl, name, value)
                checked += 1
    assert checked >= 13


def test_every_c_launch_belongs_to_an_exported_op_and_a_known_layout():
    """A unit's C launch (KernelImpl.launch_descriptions) is read only through its op's C ABI (OpSpec.c_abi), keyed by a
    prepared weights layout some definition declares ("" for any): one elsewhere would be dead description."""
    from kdsl.kernels import CATALOGUE

    layouts = {""} | {(entry.layout or {}).get("weights") for entry in kdsl.registry.entries()} - {None}
    described = [(unit.op, unit.impl, key) for unit in CATALOGUE for key in unit.launch_descriptions]
    assert len(described) >= 13  # the block-FP8, grouped, GPTQ-dequant and W4A16 units
    for op, impl, key in described:
        assert op in abis.OPS, f"{op}/{impl} has a C launch, but {op}'s OpSpec has no c_abi"
        assert key in layouts, f"{op}/{impl}: launch description key {key!r} is no prepared weights layout ({layouts})"
    for op, abi in abis.OPS.items():
        assert any(unit.op == op and unit.launch_descriptions for unit in CATALOGUE), f"{op} is exported with no C launch"
