"""Every generated kernel compiles, ahead of time and on the CPU, for every arch it claims.

For each manifest entry, each arch in {sm_80, sm_86, sm_89, sm_90} inside the entry's
[min_arch, max_arch], and each of its tile buckets, take the launches the tile's implementation
describes (its launch(), kdsl.kernels.base.Launch) for an example call of the op, and run

    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))

No GPU is needed: Triton lowers to PTX and runs its bundled ptxas.

The compiles run in worker subprocesses (this file run as a script), not in the pytest process:
conftest sets TRITON_INTERPRET=1 before triton is imported, which turns every @triton.jit function,
triton.language's own helpers included, into an interpreted one that cannot be compiled. A
module-scoped fixture sends the selected compile jobs to two workers (one per core), which write
each kernel's PTX to a folder; the tests then assert on the results.

The signatures are derived, not written down: launch() runs on the op's example call (its spec's
example, kdsl.ops.spec.OpSpec, on meta tensors: the GPU paths) and each parameter it passes gets
Triton's own type (mangle_type), its keyword arguments split into constexprs and compile options.
The kernels a module launches beside its own (the MoE layers') are the ones its launch() makes.
Written here are only what a launch cannot say: the ops compiled with a split K (SPLIT_PATH_OPS)
and the integers compiled as multiples of 16 (ALIGNED_INTS). A launch that leaves a kernel
parameter out, or an op without an example, fails loudly (test_every_entry_launch_can_be_derived).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from kdsl.codegen.render import tile_params
from kdsl.kernels import find_impl
from kdsl.kernels.base import Launch
from kdsl.ops.library import declared_specs
from kdsl.runtime.manifest import KernelEntry, load_manifest
from kdsl.schema.tiling import Tile

pytestmark = pytest.mark.slow

COMPILE_ARCHS = (80, 86, 89, 90)
FULL_GPTQ_SCHEMES = ("gptq.int4.g128.gptq", "w4a16.int4.g128")

# ---------------------------------------------------------------------------------------------
# Signatures, as each implementation's launch() describes them (kdsl.kernels.base.Launch).
#
# A compile job's launches are described by the implementation itself: its launch() is called on the op's example
# call (EXAMPLE_CALLS, from the op's spec) on meta tensors (shapes, dtypes and strides, no memory). The
# launch functions treat only the CPU as Triton's interpreter, so on meta tensors they take their GPU paths (no
# ROUND_FIRST, FP32_MATH or UPCAST_DOT; the asm unpack and half2 dots where the GPU gets them; SM counts as an
# H100's, kdsl.kernels.host.DESCRIBED_SM_COUNT), and this process never imports Triton's interpreter for them.
# The kernel's Triton signature is then Triton's own type of each parameter (triton.runtime.jit.mangle_type:
# "*bf16", "i32", "tensordesc<fp8e4nv[64, 128]>", a Gluon descriptor's with its shared layout), its constexprs
# the Launch's keyword arguments that are kernel parameters, its compile options those that are Triton's.

GPU = "meta"  # the device of the example calls' tensors: launch() takes its GPU paths on any device but the CPU
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# op -> example(tile params, dtype, device): its launch functions' arguments for calls that reach the whole of a
# tile's code, from the op's spec (kdsl.ops.spec.OpSpec.example, beside the op in its family file).
EXAMPLE_CALLS = {spec.name: spec.example for spec in declared_specs() if spec.example is not None}

# Ops whose every tile compiles its split-K path (the in-kernel reduction): launched with split_k of at least 2.
SPLIT_PATH_OPS = ("fp8_linear", "gptq_gemm", "w4a16_gemm")

# Integer arguments the op's checks always make multiples of 16, which Triton's JIT specializes on (and
# vectorizes loads and stores by); the matrix compiles with that specialization too. Not derived from the example
# values: elsewhere the matrix compiles without it, as it always has. (op, kernel) -> argument names.
ALIGNED_INTS = {
    # Prepared weights to w [N, K]: N and K (so the words' and w's row strides) are multiples of 16 on real shapes.
    ("w4a16_dequant", ""): ("N", "K", "stride_qwk", "stride_wn"),
    # Act-order's gather of x's rows: K and every stride, on DeepSeek-V3's H = 7168.
    ("moe_w4a16", "gather"): ("K", "stride_sm", "stride_pe", "stride_ps", "stride_ds", "stride_dm"),
}


def described_launches(entry: KernelEntry, tile: dict, out: str):
    """The launches the tile's implementation describes for the example calls of entry's op (outputs of dtype
    out), one at a time (the MoE layers' launch functions are generators): those of every call it accepts, in
    order (moe_fp8's examples take its two routing paths), skipping the calls it refuses."""
    module = entry.modules[tile["impl"]]
    generated = module.generated()
    if entry.op in SPLIT_PATH_OPS:
        tile = {**tile, "SPLIT_K": max(tile["SPLIT_K"], 2)}
    refused, accepted = None, False
    for args in EXAMPLE_CALLS[entry.op](tile, DTYPES[out], GPU):
        try:
            described = module.unit.launch(generated, *args, tile)
        except ValueError as error:  # the implementation refuses this call: take the next
            refused = error
            continue
        accepted = True
        if isinstance(described, Launch):
            yield described
        else:
            yield from described
    if not accepted:
        raise AssertionError(f"{module.path.name} refuses every example call of {entry.op}: {refused}")


def beside_kernels(entry: KernelEntry, tile: dict) -> list[str]:
    """The kernels the tile's launch makes beside the module's main one (the MoE layers' routing, quantization,
    activation, down GEMM and combine), by the rest of their names, in launch order. Called while collecting,
    under the interpreter: a module of one kernel is not asked (its launch may key a cache by the kernel, and a
    Gluon kernel cannot be hashed there)."""
    kernels = entry.modules[tile["impl"]].generated().kernels
    if len(kernels) == 1:
        return []
    launched = []  # by identity: a JIT function's hash is its source's
    constexprs = {}  # name -> the distinct constexprs it is launched with (moe_fp8/sorted_gluon's two GEMMs)
    for launch in described_launches(entry, tile, "bf16"):
        name = next(name for name, kernel in kernels.items() if kernel is launch.kernel)
        seen = constexprs.setdefault(name, [])
        if launch.constexprs not in seen:
            seen.append(launch.constexprs)
            if len(seen) > 1:  # the same kernel launched again, specialized otherwise: its own job, name@n
                launched.append(f"{name}@{len(seen)}")
            elif name:
                launched.append(name)
    return [name.lstrip("_") for name in launched]


def compile_options() -> frozenset:
    """Triton's compile options for CUDA (num_warps, num_stages, launch_pdl, ...)."""
    from dataclasses import fields

    from triton.backends.nvidia.compiler import CUDAOptions

    return frozenset(field.name for field in fields(CUDAOptions))


def derive(entry: KernelEntry, tile: dict, out: str, kernel: str = ""):
    """(kernel, signature, constexprs, compile options) of the launch of `kernel` ("": the module's own) that the
    tile's implementation describes, the signature in parameter order."""
    from triton.runtime.jit import mangle_type

    generated = entry.modules[tile["impl"]].generated()
    kernel, _, occurrence = kernel.partition("@")  # name@n: its n-th distinctly specialized launch
    function = generated.kernels[f"_{kernel}" if kernel else ""]
    distinct = []
    for launch in described_launches(entry, tile, out):
        if launch.kernel is function and all(launch.constexprs != seen.constexprs for seen in distinct):
            distinct.append(launch)
    launch = distinct[int(occurrence or 1) - 1] if len(distinct) >= int(occurrence or 1) else None
    assert launch is not None, f"{entry.name}: the tile's launch() makes no launch of kernel {kernel or 'main'!r}"
    _, _, params, keywords = launch
    names = list(function.arg_names)
    signature = {name: mangle_type(value) for name, value in zip(names, params)}
    constexprs = {name: value for name, value in keywords.items() if name in names}
    signature.update({name: "constexpr" for name in constexprs})
    missing = [name for name in names if name not in signature]
    assert not missing, f"{entry.name}: launch() of {kernel or 'the main kernel'} leaves parameters {missing} out"
    option_names = compile_options()
    options = {name: value for name, value in keywords.items() if name in option_names}
    return function, {name: signature[name] for name in names}, constexprs, options


def pointer_attrs(signature: dict, arg_names: list[str], aligned_ints: tuple[str, ...] = ()) -> dict:
    """The launcher passes freshly allocated (16-byte aligned) tensors: mark pointers (and
    aligned_ints) divisible by 16, as Triton's JIT would specialize them."""
    return {(arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in signature.items() if kind.startswith("*") or name in aligned_ints}


# ---------------------------------------------------------------------------------------------
# Compile jobs and the worker that runs them (in a subprocess without the interpreter)

ENTRIES = {entry.name: entry for entry in load_manifest()}


# Tiles the templates take but no shipped definition uses, compiled by name (Job.tile).
EXTRA_TILES: dict[str, dict] = {
    # fp8_bmm's sm_90 options no shipped tile sets (a flattened pipeline with batch-inner order, warp specialization).
    "bmm-flatten": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                                    options={"flatten": True, "batch_inner": True}),
                               find_impl("fp8_bmm", "tma_persistent")),
    "bmm-ws": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                               options={"warp_specialize": True}), find_impl("fp8_bmm", "tma_persistent")),
    # Programmatic dependent launch with the weight prefetch, and the pointer epilogue (swapped and not).
    "bmm-pdl-pointer": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                                        options={"flatten": True, "pdl": True, "prefetch_weights": True,
                                                 "epilogue": "pointer"}), find_impl("fp8_bmm", "tma_persistent")),
    "bmm-pdl-swap-pointer": tile_params(Tile(block_m=16, block_n=64, num_warps=4, num_stages=2,
                                             options={"swap_ab": True, "persistent": False, "pdl": True,
                                                      "prefetch_weights": True, "epilogue": "pointer"}),
                                        find_impl("fp8_bmm", "tma_persistent")),
}


@dataclass(frozen=True)
class Job:
    entry: str
    cc: int
    tile: int | str  # index into the entry's tile buckets, or a name in EXTRA_TILES
    out: str = "bf16"
    kernel: str = ""  # a kernel the module launches beside its main one (beside_kernels), by name

    @property
    def params(self) -> dict:
        if isinstance(self.tile, str):
            return EXTRA_TILES[self.tile]
        return ENTRIES[self.entry].tiles[self.tile].params

    @property
    def key(self) -> str:
        return f"{self.entry}-sm{self.cc}-tile{self.tile}-{self.out}" + (f"-{self.kernel}" if self.kernel else "")


def compile_job(job: Job):
    """(triton.compile of the job's kernel for its arch, the compile options its launch asked for); the worker's
    whole purpose."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    entry = ENTRIES[job.entry]
    kernel, signature, constexprs, options = derive(entry, job.params, job.out, job.kernel)
    attrs = pointer_attrs(signature, list(signature), ALIGNED_INTS.get((entry.op, job.kernel), ()))
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", job.cc, 32), options=options), options


def worker(out_dir: Path, jobs: list[Job]) -> None:
    """Compile each job; write <key>.ptx and one results file. Never raises for a failed compile."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "the compile worker must run without the interpreter"
    results = {}
    for job in jobs:
        start = time.perf_counter()
        try:
            compiled, options = compile_job(job)
        except Exception as error:  # reported by the test that owns the job
            # Triton's CompilationError points at the call; the reason is in the exceptions chained to it.
            chain, cause = [], error
            while cause is not None:
                chain.append(f"{type(cause).__name__}: {cause}")
                cause = cause.__cause__
            results[job.key] = {"ok": False, "error": "\ncaused by ".join(chain)}
            continue
        (out_dir / f"{job.key}.ptx").write_text(compiled.asm["ptx"], encoding="utf-8")
        results[job.key] = {
            "ok": True,
            "seconds": time.perf_counter() - start,
            "cubin_bytes": len(compiled.asm.get("cubin") or b""),
            "num_warps": compiled.metadata.num_warps,
            "launch_num_warps": options.get("num_warps"),
        }
    (out_dir / f"results-{os.getpid()}.json").write_text(json.dumps(results), encoding="utf-8")


def run_workers(jobs: list[Job], out_dir: Path, processes: int = 2) -> dict:
    """Deal jobs round robin to `processes` worker subprocesses running in parallel; merge their results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    shares = [jobs[i::processes] for i in range(processes)]
    workers = []
    for share in shares:
        if not share:
            continue
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(out_dir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        workers.append((proc, json.dumps([asdict(job) for job in share])))
    failures = []
    for proc, payload in workers:
        stdout, stderr = proc.communicate(payload, timeout=900)
        if proc.returncode != 0:
            failures.append(f"compile worker exited {proc.returncode}:\n{stderr[-4000:]}")
    assert not failures, "\n".join(failures)
    results = {}
    for path in out_dir.glob("results-*.json"):
        results.update(json.loads(path.read_text(encoding="utf-8")))
    return results


# ---------------------------------------------------------------------------------------------
# The jobs the tests ask for


def archs_of(entry: KernelEntry) -> list[int]:
    return [cc for cc in COMPILE_ARCHS if cc >= entry.min_arch and (entry.max_arch is None or cc <= entry.max_arch)]


def _matrix():
    """Every entry x every arch it claims x every tile bucket, and each kernel the tile's launch makes beside the
    module's own."""
    for entry in ENTRIES.values():
        if entry.scheme.startswith(("gptq.", "w4a16.")) and entry.scheme not in FULL_GPTQ_SCHEMES:
            # The GPTQ schemes differ only in baked constants: one scheme gets the whole
            # matrix, the others one compile each (newest arch, prefill tile) to keep CI short.
            cc, index = archs_of(entry)[-1], len(entry.tiles) - 1
            yield pytest.param(Job(entry.name, cc, index), id=f"{entry.name}-sm{cc}-tile{index}")
            continue
        beside = [beside_kernels(entry, bucket.params) for bucket in entry.tiles]
        for cc in archs_of(entry):
            for index in range(len(entry.tiles)):
                yield pytest.param(Job(entry.name, cc, index), id=f"{entry.name}-sm{cc}-tile{index}")
                for kernel in beside[index]:
                    yield pytest.param(Job(entry.name, cc, index, kernel=kernel),
                                       id=f"{entry.name}-sm{cc}-tile{index}-{kernel}")


def _fp8_entry(op: str, impl: str) -> KernelEntry:
    matches = [e for e in ENTRIES.values() if e.op == op and e.impl == impl and e.scheme.startswith("block_fp8.")]
    assert matches, f"no generated {op}/{impl} kernel"
    return matches[0]


TMA = _fp8_entry("fp8_gemm", "tma_persistent")
PORTABLE = _fp8_entry("fp8_gemm", "portable")
BMM = _fp8_entry("fp8_bmm", "portable")
BMM_TMA = _fp8_entry("fp8_bmm", "tma_persistent")
DEQUANT = _fp8_entry("weight_dequant", "blockwise")


def last(entry: KernelEntry) -> int:
    """Index of the prefill bucket (explicit, so the job matches the matrix's and compiles once)."""
    return len(entry.tiles) - 1


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """Compile every job of the selected tests of this module, once, in worker subprocesses.

    Returns (results by job key, folder of <key>.ptx files)."""
    jobs = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        job = params.get("job")
        if isinstance(job, Job) and item.module is request.module and not item.get_closest_marker("skip"):
            jobs[job.key] = job
    out_dir = tmp_path_factory.mktemp("compile_matrix")
    start = time.perf_counter()
    results = run_workers(sorted(jobs.values(), key=lambda j: j.key), out_dir)
    wall = time.perf_counter() - start
    seconds = [r["seconds"] for r in results.values() if r.get("ok")]
    print(f"\ncompile matrix: {len(jobs)} compiles in {wall:.1f} s wall "
          f"({sum(seconds):.1f} s of compiling, slowest {max(seconds, default=0):.1f} s)")
    return results, out_dir


def ptx_of(compiled, job: Job) -> str:
    results, out_dir = compiled
    result = results.get(job.key)
    assert result is not None, f"{job.key} was not compiled"
    assert result["ok"], f"{job.key} does not compile:\n{result['error']}"
    return (out_dir / f"{job.key}.ptx").read_text(encoding="utf-8")


@pytest.mark.parametrize("job", list(_matrix()))
def test_compiles(job, compiled):
    ptx = ptx_of(compiled, job)
    result = compiled[0][job.key]
    assert f".target sm_{job.cc}" in ptx
    assert result["cubin_bytes"] > 0, "ptxas produced no cubin"
    assert result["num_warps"] == result["launch_num_warps"], "not compiled with the warps launch() asks for"
    if not job.kernel:
        assert result["num_warps"] == job.params["num_warps"]


def underivable() -> dict:
    """entry name -> why the launch of one of its tiles cannot be derived (worker process: the Gluon kernels' split
    scratch is keyed by kernel, and hashing a Gluon kernel fails under the interpreter)."""
    failures = {}
    for entry in ENTRIES.values():
        for index, bucket in enumerate(entry.tiles):
            try:
                derive(entry, bucket.params, "bf16")
            except Exception as error:  # reported by the test
                failures[f"{entry.name} tile {index}"] = f"{type(error).__name__}: {error}"
    return failures


def test_every_entry_launch_can_be_derived():
    """Every entry's every tile: its launch() describes the module's kernel on the op's example call, every
    kernel parameter described (the signature the matrix compiles); and it claims an arch the matrix compiles."""
    missing = sorted({entry.op for entry in ENTRIES.values()} - set(EXAMPLE_CALLS))
    assert not missing, f"give the OpSpec of {missing} an example (kdsl.ops.spec)"
    for entry in ENTRIES.values():
        assert archs_of(entry), f"{entry.name} claims no arch the matrix compiles for"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--derive"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failures = json.loads(proc.stdout.splitlines()[-1])
    assert not failures, "\n".join(f"{where}: {why}" for where, why in failures.items())


def first_mma(entry: KernelEntry) -> int:
    """Index of the first bucket whose tiles feed an MMA (block_m > 1)."""
    return next(i for i, tile in enumerate(entry.tiles) if tile.params["BLOCK_M"] > 1)


BMM_TMA_TILES = [i for i, tile in enumerate(BMM_TMA.tiles) if tile.params["impl"] == "tma_persistent"]


@pytest.mark.parametrize("job", [Job(TMA.name, 90, first_mma(TMA)), Job(TMA.name, 90, last(TMA)),
                                 *(Job(BMM_TMA.name, 90, i) for i in BMM_TMA_TILES),
                                 Job(BMM_TMA.name, 90, "bmm-flatten"), Job(BMM_TMA.name, 90, "bmm-ws"),
                                 Job(BMM_TMA.name, 90, "bmm-pdl-pointer"), Job(BMM_TMA.name, 90, "bmm-pdl-swap-pointer")],
                         ids=["decode", "prefill", *(f"bmm-tile{i}" for i in BMM_TMA_TILES),
                              "bmm-flatten", "bmm-ws", "bmm-pdl-pointer", "bmm-pdl-swap-pointer"])
def test_hopper_gemm_uses_wgmma(job, compiled):
    ptx = ptx_of(compiled, job)
    assert "wgmma" in ptx
    assert re.search(r"wgmma\.mma_async\S*e4m3\.e4m3", ptx), "wgmma does not take e4m3 operands"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    if isinstance(job.tile, str) and job.tile.startswith("bmm-pdl"):
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
        assert "prefetch.global.L2" in ptx


DEFERRED = [i for i, tile in enumerate(TMA.tiles) if tile.params["impl"] == "deferred_gluon"]


@pytest.mark.parametrize("job", [Job(TMA.name, 90, i) for i in DEFERRED], ids=[f"tile{i}" for i in DEFERRED])
def test_deferred_rescale_keeps_one_wgmma_in_flight(job, compiled):
    """The Gluon kernel waits for all but the newest wgmma group before each rescale (wait 1), and for
    none only after its last K block."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"wgmma\.mma_async\S*e4m3\.e4m3", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert waits.count("1") >= 2, f"no rescale overlaps a wgmma: waits {waits}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"


MOE_HOPPER = next(e for e in ENTRIES.values() if e.op == "moe_fp8" and e.scheme.startswith("block_fp8.")
                  and e.min_arch == 90)
MOE_GLUON = [i for i, tile in enumerate(MOE_HOPPER.tiles) if tile.params["impl"] == "sorted_gluon"]


@pytest.mark.parametrize("job", [Job(MOE_HOPPER.name, 90, i, kernel=kernel) for i in MOE_GLUON for kernel in ("", "@2")],
                         ids=[f"tile{i}-{gemm}" for i in MOE_GLUON for gemm in ("gate-up", "down")])
def test_moe_gluon_gemms_keep_one_wgmma_in_flight(job, compiled):
    """moe_fp8/sorted_gluon's gate-up (TMA store) and down (row scatter) GEMMs: e4m3 wgmma fed by TMA, each
    rescale overlapping the next K block's wgmma (wait 1), as fp8_gemm/deferred_gluon's loop."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"wgmma\.mma_async\S*e4m3\.e4m3", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert waits.count("1") >= 2, f"no rescale overlaps a wgmma: waits {waits}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == (job.kernel == ""), "gate-up stores by TMA, down not"


MOE_SWAPPED = [i for i, tile in enumerate(MOE_HOPPER.tiles) if tile.params.get("swap_ab")]
# moe_fp8's example calls take the routing kernel first, then one block per assignment: the second specialization.
MOE_SWAPPED_GEMMS = {"gate-up": "", "down": "down", "gate-up-one-per-block": "@2", "down-one-per-block": "down@2"}


def test_hopper_moe_decode_tiles_are_swapped():
    """Both sm_90 decode tiles of moe_fp8/sorted (M <= 4) swap the MMA's sides, so the PTX test below has jobs."""
    decode = [i for i, tile in enumerate(MOE_HOPPER.tiles) if tile.m_max == 4]
    assert decode and decode == MOE_SWAPPED


@pytest.mark.parametrize("job", [Job(MOE_HOPPER.name, 90, i, kernel=kernel) for i in MOE_SWAPPED
                                 for kernel in MOE_SWAPPED_GEMMS.values()],
                         ids=[f"tile{i}-{gemm}" for i in MOE_SWAPPED for gemm in MOE_SWAPPED_GEMMS])
def test_moe_swapped_decode_gemms_put_the_weights_on_the_wgmma_rows(job, compiled):
    """moe_fp8/sorted's swapped decode tiles, with the routing kernel and without it (one assignment per block):
    e4m3 wgmma whose 64-row side is the weights' and whose narrow side is the 16 sorted rows (n16), not 16 rows
    padded to 64."""
    ptx = ptx_of(compiled, job)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx))
    assert shapes == {"m64n16k32"}, shapes


GPTQ_HOPPER = next(e for e in ENTRIES.values()
                   if e.op == "w4a16_gemm" and e.scheme == "w4a16.int4.g128" and e.min_arch == 90)
OVERLAP = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "overlap_gluon"]


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in OVERLAP for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in OVERLAP for out in ("fp16", "bf16")])
def test_overlap_dequant_keeps_one_wgmma_in_flight(job, compiled):
    """The Gluon GPTQ kernel feeds the wgmma dequantized weights from registers and waits for all but the
    newest wgmma group before the next block's dequant, bringing its operands by TMA."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    # The register operand: the A fragment is a brace list of 32-bit registers, not a shared-memory descriptor.
    assert re.search(rf"wgmma\.mma_async\S*\.f32\.{out}\.{out}\s+\{{[^}}]*\}},\s*\{{%r", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert waits.count("1") >= 2, f"no dequant overlaps a wgmma: waits {waits}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"


MMA_GEMV = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "gemv_mma_gluon"]
TRITON_GEMV = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "gemv"]


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in MMA_GEMV for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in MMA_GEMV for out in ("fp16", "bf16")])
def test_mma_gemv_feeds_mma_sync_from_16_byte_loads(job, compiled):
    """The Gluon GEMV sums over K on mma.sync (m16n8k16, fp32 accumulators), not wgmma, and reads the
    k_planes words four at a time."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{out}\.{out}\.f32", ptx)
    assert "wgmma" not in ptx
    assert re.search(r"ld\.global\S*\.v4\.b32", ptx), "words are not loaded 16 bytes at a time"


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in TRITON_GEMV for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in TRITON_GEMV for out in ("fp16", "bf16")])
def test_prepared_triton_gemv_compiles(job, compiled):
    """The Triton GEMV, the mma.sync GEMV's alternative: CUDA cores only."""
    ptx = ptx_of(compiled, job)
    assert "wgmma" not in ptx and "mma.sync" not in ptx


@pytest.mark.parametrize("job", [Job(PORTABLE.name, 89, 0), Job(PORTABLE.name, 89, last(PORTABLE)),
                                 Job(BMM.name, 89, 0), Job(BMM.name, 89, last(BMM))],
                         ids=["decode", "prefill", "bmm-decode", "bmm-prefill"])
def test_portable_gemm_uses_fp8_mma_on_ada(job, compiled):
    ptx = ptx_of(compiled, job)
    assert re.search(r"mma\.sync\.aligned\.\S*\.e4m3\.e4m3", ptx), "no e4m3 tensor-core mma in the PTX"
    assert "wgmma" not in ptx


GROUPED = _fp8_entry("fp8_grouped_gemm", "portable")
MASKED = _fp8_entry("fp8_grouped_gemm_masked", "portable")
MOE = _fp8_entry("moe_fp8", "sorted")


@pytest.mark.parametrize("job", [Job(GROUPED.name, 89, 0), Job(GROUPED.name, 89, last(GROUPED)),
                                 Job(MASKED.name, 89, 0), Job(MOE.name, 89, 0), Job(MOE.name, 89, last(MOE)),
                                 Job(MOE.name, 89, 0, kernel="down"), Job(MOE.name, 89, last(MOE), kernel="down")],
                         ids=["grouped-decode", "grouped-prefill", "masked-decode", "moe-gate-up-decode",
                              "moe-gate-up-fused", "moe-down-decode", "moe-down-prefill"])
def test_moe_gemms_use_fp8_mma_on_ada(job, compiled):
    ptx = ptx_of(compiled, job)
    assert re.search(r"mma\.sync\.aligned\.\S*\.e4m3\.e4m3", ptx), "no e4m3 tensor-core mma in the PTX"


MOE_W4A16 = {e.min_arch: e for e in ENTRIES.values() if e.op == "moe_w4a16" and e.scheme == "w4a16.int4.g128"}


@pytest.mark.parametrize("job", [
    Job(MOE_W4A16[80].name, 80, 0, "fp16"), Job(MOE_W4A16[80].name, 80, last(MOE_W4A16[80])),
    Job(MOE_W4A16[80].name, 80, 0, "fp16", kernel="down"),
    Job(MOE_W4A16[80].name, 80, last(MOE_W4A16[80]), kernel="down"),
    Job(MOE_W4A16[90].name, 90, 0), Job(MOE_W4A16[90].name, 90, last(MOE_W4A16[90]), kernel="down"),
], ids=["sm80-gate-up-decode-fp16", "sm80-gate-up-prefill", "sm80-down-decode-fp16", "sm80-down-prefill",
        "sm90-gate-up-decode", "sm90-down-prefill"])
def test_moe_w4a16_gemms_use_tensor_cores(job, compiled):
    """The int4 MoE GEMMs multiply the dequantized weights on fp16/bf16 tensor cores (mma.sync, or wgmma on
    Hopper), accumulating in fp32."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    mma = rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{out}\.{out}\.f32|wgmma\.mma_async\S*\.f32\.{out}\.{out}"
    assert re.search(mma, ptx), f"no {job.out} tensor-core MMA in the PTX"


@pytest.mark.parametrize("job", [Job(MOE_W4A16[80].name, 80, 0, kernel="gather"),
                                 Job(MOE_W4A16[90].name, 90, last(MOE_W4A16[90]), "fp16", kernel="gather")],
                         ids=["sm80-bf16", "sm90-fp16"])
def test_moe_w4a16_act_order_gather_is_coalesced(job, compiled):
    """Act-order's gather reads x's row and writes the permuted rows 16 bytes a thread (the whole row, contiguous)
    and permutes in registers through shared memory (tl.gather), with no per-element global load of x."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "x's row is not loaded 16 bytes at a time"
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "the gathered rows are not stored 16 bytes at a time"
    assert re.search(r"ld\.shared", ptx), "no shared-memory permutation"
    assert not re.search(r"ld\.global(\.\w+)*\.b16", ptx), "x read one element at a time"


@pytest.mark.parametrize("job", [
    Job(PORTABLE.name, 89, last(PORTABLE), "fp16"), Job(PORTABLE.name, 89, last(PORTABLE), "fp32"),
    Job(GROUPED.name, 89, last(GROUPED), "fp32"), Job(MASKED.name, 89, last(MASKED), "fp32"),
    Job(MOE.name, 89, last(MOE), "fp16"), Job(MOE.name, 89, last(MOE), "fp16", kernel="combine"),
    Job(BMM.name, 89, last(BMM), "fp16"), Job(BMM.name, 89, last(BMM), "fp32"),
    Job(TMA.name, 90, last(TMA), "fp16"), Job(TMA.name, 90, last(TMA), "fp32"),
    Job(BMM_TMA.name, 90, BMM_TMA_TILES[-1], "fp16"), Job(BMM_TMA.name, 90, BMM_TMA_TILES[-1], "fp32"),
    Job(DEQUANT.name, 89, last(DEQUANT), "fp16"), Job(DEQUANT.name, 89, last(DEQUANT), "fp32"),
], ids=lambda job: f"{ENTRIES[job.entry].op}-{ENTRIES[job.entry].impl}-{job.out}" + (f"-{job.kernel}" if job.kernel else ""))
def test_other_output_dtypes_compile(job, compiled):
    ptx = ptx_of(compiled, job)
    assert f".target sm_{job.cc}" in ptx


W4A16_DEQUANT = {e.min_arch: e for e in ENTRIES.values() if e.op == "w4a16_dequant" and e.scheme == "w4a16.int4.g128"}


@pytest.mark.parametrize("job", [Job(W4A16_DEQUANT[cc].name, cc, 0, out) for cc in (80, 90) for out in ("fp16", "bf16")],
                         ids=[f"sm{cc}-{out}" for cc in (80, 90) for out in ("fp16", "bf16")])
def test_w4a16_dequant_stores_16_bytes_at_a_time(job, compiled):
    """w4a16_dequant writes four bytes of w for each byte it reads: its stores of w's K-contiguous rows go out
    16 bytes at a time, in both layouts (checkpoint words on sm_80, k_planes on sm_90) and both group paths."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "no 16-byte stores of w"


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(Path(sys.argv[2]), [Job(**raw) for raw in json.loads(sys.stdin.read())])
elif __name__ == "__main__" and sys.argv[1:2] == ["--derive"]:
    print(json.dumps(underivable()))
