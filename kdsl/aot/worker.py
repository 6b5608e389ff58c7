"""Compile specializations to cubins: `python -m kdsl.aot.worker` reads one JSON job per line on stdin and
answers one JSON line per job on stdout. A separate process so that Triton's interpreter (TRITON_INTERPRET=1,
as the tests set it) is off while compiling, and so that several compile side by side."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
import traceback
from pathlib import Path

_modules: dict = {}


def _kernel(module_path: str, kernel: str):
    module = _modules.get(module_path)
    if module is None:
        name = "kdsl_aot_" + hashlib.sha256(module_path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, module_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton's JIT looks functions up through their module
        spec.loader.exec_module(module)
        _modules[module_path] = module
    return getattr(module, kernel)


def ptx_params(ptx: str, entry: str) -> list:
    """The kernel's parameters as its PTX declares them: "map" (a 128-byte, 64-aligned by-value CUtensorMap),
    "u32" or "u64" (an integer or a pointer)."""
    match = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(([^)]*)\)", ptx)
    if match is None:
        raise RuntimeError(f"no .entry {entry} in the PTX")
    kinds = []
    for declaration in match.group(1).split(","):
        if ".param" not in declaration:
            continue
        if re.search(r"\.b8\s+\S+\[128\]", declaration):
            kinds.append("map")
        elif ".u32" in declaration or ".s32" in declaration or ".b32" in declaration:
            kinds.append("u32")
        elif ".u64" in declaration or ".s64" in declaration or ".b64" in declaration:
            kinds.append("u64")
        else:
            raise RuntimeError(f"{entry}: a kernel parameter the C launcher cannot pass: {declaration.strip()}")
    return kinds


def expansion(params: list, kinds: list, name: str) -> tuple[list, int]:
    """Match the specialization's parameters with the PTX's: per host TMA descriptor, how many int32 (shape) and
    int64 (stride) parameters follow its CUtensorMap in this Triton's launch convention, and how many hidden
    parameters (global/profile scratch pointers) trail the explicit ones. A convention the C launcher does not
    pass (a descriptor lowered to a pointer, another layout) is an error naming the parameter."""
    position, descriptors = 0, []
    for param in params:
        if param["claim"] == "1":
            continue  # compiled in
        if param["kind"] == "desc":
            if position >= len(kinds) or kinds[position] != "map":
                raise RuntimeError(f"{name}: descriptor {param['name']} is not passed as a CUtensorMap by value "
                                   f"(PTX parameter {position} is {kinds[position:position + 1]})")
            position += 1
            shapes = 0
            while position < len(kinds) and kinds[position] == "u32":
                shapes, position = shapes + 1, position + 1
            strides = 0
            while position < len(kinds) and kinds[position] == "u64" and strides < param["rank"]:
                strides, position = strides + 1, position + 1
            if shapes != param["rank"] or strides != param["rank"]:
                raise RuntimeError(f"{name}: descriptor {param['name']} expands to {shapes} int32 and {strides} int64 "
                                   f"parameters, the C launcher passes its shape ({param['rank']} int32) and strides "
                                   f"({param['rank']} int64)")
            descriptors.append(dict(param=param["name"], shape_params=shapes, stride_params=strides))
            continue
        want = "u32" if param["kind"] == "int" and param["type"] == "i32" else "u64"
        if position >= len(kinds) or kinds[position] != want:
            raise RuntimeError(f"{name}: parameter {param['name']} is {kinds[position:position + 1]} in the PTX, "
                               f"expected {want}")
        position += 1
    hidden = kinds[position:]
    if any(kind != "u64" for kind in hidden):
        raise RuntimeError(f"{name}: trailing PTX parameters {hidden} are not the hidden scratch pointers")
    return descriptors, len(hidden)


def default_layout(block, element: str):
    """The default NVMMA shared layout of a block of `element` (Triton's type name, e.g. "fp8e4nv"): what the
    implementations' launches give their Gluon host descriptors (kdsl.kernels.host.gluon_descriptor); None for
    another type."""
    from triton.experimental.gluon import language as gl

    dtypes = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32, "i32": gl.int32}
    return gl.NVMMASharedLayout.get_default_for(list(block), dtypes[element]) if element in dtypes else None


def gluon_descriptor_types(signature: dict) -> dict:
    """A Gluon descriptor's type names its shared-memory layout: the default one of its block (default_layout)."""
    typed = dict(signature)
    for name, kind in signature.items():
        match = re.fullmatch(r"tensordesc<(\w+)\[([\d, ]+)\]>", kind)
        if match:
            layout = default_layout([int(b) for b in match[2].split(",")], match[1])
            typed[name] = f"tensordesc<{match[1]}[{match[2]}],{layout!r}>"
    return typed


def compile_job(job: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = _kernel(job["module_path"], job["kernel"])
    signature, constexprs, attrs = {}, dict(job["constexprs"]), {}
    for index, param in enumerate(job["params"]):
        if param["kind"] == "desc":
            signature[param["name"]] = param["type"]
        elif param["claim"] == "1":
            signature[param["name"]] = "constexpr"
            constexprs[param["name"]] = 1
        else:
            signature[param["name"]] = param["type"]
            if param["claim"] == "D":
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name in job["constexprs"]:
        signature[name] = "constexpr"
    missing = [name for name in fn.arg_names if name not in signature]
    if missing:
        raise RuntimeError(f"{job['kernel']}: no value for parameter(s) {', '.join(missing)}")
    signature = {name: signature[name] for name in fn.arg_names}
    target = GPUTarget("cuda", job["arch"], 32)
    backend = make_backend(target)
    options = backend.parse_options(dict(job["options"]))
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel: its descriptors name their layouts
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fn, gluon_descriptor_types(signature), constexprs, attrs)
    else:
        source = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    meta = compiled.metadata
    cubin = compiled.asm["cubin"]
    out = Path(job["cubin_path"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cubin)
    descriptors, hidden = expansion(job["params"], ptx_params(compiled.asm["ptx"], meta.name), job["kernel"])
    if descriptors:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST  # Triton 3.6 and 3.9 both have it

        metas = list(getattr(meta, "tensordesc_meta", None) or [])
        if len(metas) != len(descriptors):
            raise RuntimeError(f"{job['kernel']}: {len(descriptors)} host descriptors but {len(metas)} "
                               "tensordesc_meta entries (a descriptor Triton did not lower to TMA)")
        for described, tma in zip(descriptors, metas):
            tma = dict(tma._asdict() if hasattr(tma, "_asdict") else tma)
            if tma.get("fp4_padded") or tma.get("is_im2col"):
                raise RuntimeError(f"{job['kernel']}: {described['param']} is an fp4-padded or im2col descriptor")
            # What the launcher gives cuTensorMapEncodeTiled: the host's CUtensorMapDataType, the swizzle mode,
            # the box (block_size, possibly narrower than the kernel's block: Triton copies a wide block in
            # several boxes of the swizzle's width) and the element size.
            described.update(swizzle=int(tma["swizzle"]), elem_size=int(tma["elem_size"]),
                             elem_type=int(tma["elem_type"]),
                             host_type=int(TMA_DTYPE_DEVICE_TO_HOST[int(tma["elem_type"])]),
                             box=[int(b) for b in tma["block_size"]])
    return dict(tma=descriptors,
        name=job["name"], ok=True, symbol=meta.name, shared=meta.shared, num_warps=meta.num_warps,
        num_ctas=getattr(meta, "num_ctas", 1), hidden=hidden,
        global_scratch_size=getattr(meta, "global_scratch_size", 0),
        profile_scratch_size=getattr(meta, "profile_scratch_size", 0),
        launch_cooperative_grid=bool(getattr(meta, "launch_cooperative_grid", False)),
        launch_pdl=bool(getattr(meta, "launch_pdl", False)),
        sha256=hashlib.sha256(cubin).hexdigest(), size=len(cubin), triton=triton.__version__,
    )


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            result = compile_job(job)
        except Exception as error:  # reported per job: the exporter names the kernel and goes on
            result = dict(name=job["name"], ok=False, error=f"{type(error).__name__}: {error}",
                          trace=traceback.format_exc(limit=3))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    _quiet_shutdown()
    return 0


def _quiet_shutdown() -> None:
    """Every job is answered (errors included, on stdout): send what interpreter shutdown writes to stderr to
    /dev/null. Triton's nanobind bindings print a leak report of its MLIR builder objects at exit (dozens of
    lines per worker after a Gluon compile); Triton's own compile pool silences its workers the same way."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
