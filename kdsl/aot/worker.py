"""Compile specializations to cubins: `python -m kdsl.aot.worker` reads one JSON job per line on stdin and
answers one JSON line per job on stdout. A separate process so that Triton's interpreter (TRITON_INTERPRET=1,
as the tests set it) is off while compiling, and so that several compile side by side."""
from __future__ import annotations

import hashlib
import importlib.util
import json
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


def ptx_param_count(ptx: str, entry: str) -> int:
    match = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(([^)]*)\)", ptx)
    if match is None:
        raise RuntimeError(f"no .entry {entry} in the PTX")
    return match.group(1).count(".param")


def compile_job(job: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = _kernel(job["module_path"], job["kernel"])
    signature, constexprs, attrs = {}, dict(job["constexprs"]), {}
    for index, param in enumerate(job["params"]):
        if param["claim"] == "1":
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
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    meta = compiled.metadata
    cubin = compiled.asm["cubin"]
    out = Path(job["cubin_path"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cubin)
    explicit = sum(1 for p in job["params"] if p["claim"] != "1")
    hidden = ptx_param_count(compiled.asm["ptx"], meta.name) - explicit
    return dict(
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
