"""`kdsl aot`: compile the specializations kdsl.aot.plan chooses for the selected ops and archs, and write them
with kdsl.aot.emit into a staging folder moved into place once everything compiled.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdsl.aot import emit
from kdsl.aot.plan import Plan, plan


class ExportError(RuntimeError):
    """Nothing could be exported, or a kernel failed to compile."""


def compile_specs(specs: list, out: Path, jobs: int, progress=print, tick=None) -> list:
    """Compile every spec in `jobs` worker processes; returns [(spec, error)] for the ones that failed.
    progress(line) gets a line per spec, or with tick, only per failure, and tick(done, total) after each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default; set so Triton 3.9 does not warn
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    pending = list(specs)
    by_name = {spec.name: spec for spec in specs}
    workers = [subprocess.Popen([sys.executable, "-m", "kdsl.aot.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(max(1, min(jobs, len(specs))))]
    failures, done, total = [], 0, len(specs)
    try:
        busy = {}
        import selectors
        selector = selectors.DefaultSelector()
        for worker in workers:
            selector.register(worker.stdout, selectors.EVENT_READ, worker)

        def feed(worker):
            if pending:
                spec = pending.pop(0)
                busy[worker] = (spec, time.perf_counter())
                worker.stdin.write(json.dumps(spec.job(out)) + "\n")
                worker.stdin.flush()

        for worker in workers:
            feed(worker)
        while busy:
            for key, _ in selector.select():
                worker = key.data
                line = worker.stdout.readline()
                if not line:
                    spec, _ = busy.pop(worker)
                    failures.append((spec, "the compile worker exited"))
                    selector.unregister(worker.stdout)
                    continue
                result = json.loads(line)
                spec, started = busy.pop(worker)
                spec = by_name[result.pop("name")]
                done += 1
                if result.pop("ok"):
                    spec.compiled = result
                    if tick is None:
                        progress(f"[{done}/{total}] {spec.name}: {result['size']} bytes, {result['shared']} B "
                                 f"shared, {time.perf_counter() - started:.1f} s")
                else:
                    failures.append((spec, result["error"]))
                    progress(f"[{done}/{total}] {spec.name}: FAILED {result['error']}")
                if tick is not None:
                    tick(done, total)
                feed(worker)
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait()
    for spec in specs:
        if spec.compiled and (spec.compiled["global_scratch_size"] or spec.compiled["profile_scratch_size"]
                              or spec.compiled["num_ctas"] != 1 or spec.compiled["launch_cooperative_grid"]):
            failures.append((spec, "needs global/profile scratch, clusters or a cooperative launch, which the "
                                   "C launcher does not provide"))
    return failures


def export(out: Path, archs, ops=None, schemes=None, dtypes=None, generic_only=False, jobs=None,
           progress=print, problems=None, tick=None) -> Plan:
    """Plan, compile and write everything under `out` (cubins, C sources, build files, aot_manifest.json).
    problems: as plan()'s; tick(done, total): called after each compiled specialization (see compile_specs)."""
    result = plan(archs, ops, schemes, dtypes, generic_only, problems)
    for what, why in result.skipped:
        progress(f"skipped {what}: {why}")
    for line in result.routes:
        progress(line)
    if not result.selected:
        raise ExportError("nothing to export: " + "; ".join(f"{w}: {r}" for w, r in result.skipped))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything is written to a staging folder beside `out` and moved in only once every kernel compiled, so a
    # failed or interrupted export leaves `out` as it was.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.", dir=out.parent))
    jobs = jobs or os.cpu_count() or 1
    progress(f"compiling {len(result.specs)} specializations of {len(result.selected)} kernel(s) in "
             f"{min(jobs, len(result.specs))} process(es)")
    try:
        failures = compile_specs(result.specs, staging, jobs, progress, tick)
        if failures:
            raise ExportError("; ".join(f"{spec.name}: {why}" for spec, why in failures))
        _share_identical_cubins(staging, result.specs)
        emit.write_all(staging, result)
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _move_into(staging: Path, out: Path) -> None:
    """Move the staged export into `out` (same file system: renames). cubins/ is replaced as a whole, so no cubin
    of an earlier export stays; every other file is replaced one by one, so what else `out` holds (a build
    folder) stays."""
    out.mkdir(parents=True, exist_ok=True)
    old_cubins = out / "cubins"
    if old_cubins.exists():
        old_cubins.rename(staging / ".cubins.old")  # removed with the staging folder
    (staging / "cubins").rename(out / "cubins")
    for path in sorted(staging.rglob("*")):
        relative = path.relative_to(staging)
        if relative.parts[0].startswith(".") or not path.is_file():
            continue
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, out / relative)


def _share_identical_cubins(out: Path, specs: list) -> None:
    """Specializations whose cubins are byte-identical (an assumption the compiler did not use) share one file,
    named by its hash; the library embeds each file once."""
    for spec in specs:
        written = out / "cubins" / f"{spec.name}.cubin"
        shared = out / "cubins" / f"{spec.compiled['sha256'][:16]}.cubin"
        if written.exists():
            if shared.exists():
                written.unlink()
            else:
                written.rename(shared)
        spec.compiled["cubin"] = f"cubins/{shared.name}"
