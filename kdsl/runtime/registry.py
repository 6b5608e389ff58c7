"""Pick the generated kernel for an op, a scheme, an architecture and an M.

Selection rule: among the entries for the op and scheme whose [min_arch,
max_arch] holds the arch and that are not disabled, the one with the highest
min_arch wins (the most specialized); a capped range beats an open one at the
same floor. Every refusal carries its reason, so a failed lookup explains itself.

Kernel folders: the kernels kdsl ships, plus folders a user generated with
`kdsl generate --defs my_defs --out my_kernels` and added through
KDSL_KERNEL_PATH or add_generated(). Shadowing rule: a user folder's kernel with
the same name as a shipped one replaces it (the first folder in search order
wins: KDSL_KERNEL_PATH in its order, then add_generated() calls, latest first,
then the shipped kernels); kernels with different names compete by the
selection rule, and at equal arch ranges the earlier folder wins.

Environment:
  KDSL_ARCH=sm_90        select as if the device were this arch (also on CPU)
  KDSL_DISABLE=a,b*      never pick kernels whose name matches (fnmatch patterns)
  KDSL_KERNEL_PATH=d1:d2 extra folders of generated kernels, before the shipped ones
  KDSL_GENERATED=dir     use this folder instead of the shipped kernels
Read once; call reset() after changing them.

Which path runs (run_path): CUDA tensors run the generated kernels; CPU tensors run them through Triton's
interpreter under TRITON_INTERPRET=1 (read on every call), else kdsl/ops/fallback.py's torch code.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kdsl.naming import format_arch, parse_arch
from kdsl.runtime.manifest import (
    GENERATED_ENV,  # noqa: F401 (kdsl.registry re-exports it)
    KERNEL_PATH_ENV,  # noqa: F401 (kdsl.registry re-exports it)
    SHIPPED,
    Call,
    KernelEntry,
    extra_dirs_from_env,
    load_manifest,
    shipped_dir,
)

FORCE_ARCH_ENV = "KDSL_ARCH"
DISABLE_ENV = "KDSL_DISABLE"
# Tensors on the CPU run through Triton's interpreter; pick what an Ada GPU would run,
# the most portable tier that has every op.
INTERPRETER_ARCH = 89
INTERPRET_ENV = "TRITON_INTERPRET"
GENERATED_KERNEL, INTERPRETER, TORCH_FALLBACK = "generated kernel", "Triton interpreter", "torch fallback"


class NoKernelError(LookupError):
    """No generated kernel fits; `refusals` lists every candidate and why it was refused."""

    def __init__(self, op: str, scheme: str | None, arch: int, refusals: list[tuple[str, str]]):
        self.op, self.scheme, self.arch, self.refusals = op, scheme, arch, refusals
        lines = [f"no generated kernel for op {op!r}, scheme {scheme or 'any'}, arch {format_arch(arch)}"]
        if not refusals:
            lines.append("  no kernel for this op was generated: add a variant to kernel_defs/ and run `python -m kdsl generate`")
        lines += [f"  {name}: {reason}" for name, reason in refusals]
        super().__init__("\n".join(lines))


class SchemeNotServedError(NoKernelError, ValueError):
    """The op was asked for a scheme that no generated kernel serves, on any arch. Raised the same way
    whether kernels or the torch fallback would run; a NoKernelError, and a ValueError (a bad argument)."""

    def __init__(self, op: str, scheme: str, message: str):
        self.op, self.scheme, self.arch, self.refusals = op, scheme, None, []
        LookupError.__init__(self, message)


@dataclass(frozen=True)
class _Settings:
    forced_arch: int | None
    disabled: tuple[str, ...]


_state: dict = {}
# kdsl.ops' launch plans (kdsl/ops/_plan.py), keyed on a call's signature. They hold what the manifests and
# the settings chose, so reset() empties this dict in place (the ops keep a reference to it).
plans: dict = {}
_added: list[Path] = []  # add_generated() folders, latest first; kept across reset()


def reset() -> None:
    """Forget the manifests, the environment settings, the dispatch cache and the ops' launch plans (not
    add_generated folders)."""
    _state.clear()
    plans.clear()


def add_generated(folder) -> None:
    """Add a folder written by `kdsl generate --out FOLDER` to the kernels the registry picks from.

    Its manifest is read now, so a wrong folder fails here, naming it. A kernel in it with the name of a
    shipped kernel replaces that kernel (see the module docstring for the rule)."""
    path = Path(folder).resolve()
    load_manifest(path, origin=str(path))  # raises ManifestError naming the file
    if path in _added:
        _added.remove(path)
    _added.insert(0, path)
    reset()


def remove_generated(folder) -> None:
    """Undo add_generated(folder)."""
    path = Path(folder).resolve()
    if path in _added:
        _added.remove(path)
        reset()


def kernel_folders() -> list[tuple[str, Path]]:
    """(origin, folder) in search order: KDSL_KERNEL_PATH, add_generated() folders, the shipped kernels."""
    user = [p.resolve() for p in extra_dirs_from_env()] + [p for p in _added]
    seen, folders = set(), []
    for path in user:
        if path not in seen:
            seen.add(path)
            folders.append((str(path), path))
    folders.append((SHIPPED, shipped_dir()))
    return folders


def _settings() -> _Settings:
    settings = _state.get("settings")
    if settings is None:
        forced = os.environ.get(FORCE_ARCH_ENV, "").strip()
        try:
            forced_arch = parse_arch(forced) if forced else None
        except ValueError:
            raise ValueError(f"{FORCE_ARCH_ENV}={forced!r}: expected an arch such as 'sm_90'") from None
        disabled = tuple(p.strip() for p in os.environ.get(DISABLE_ENV, "").split(",") if p.strip())
        settings = _state["settings"] = _Settings(forced_arch, disabled)
    return settings


def entries() -> tuple[KernelEntry, ...]:
    """Every kernel the registry may pick, shadowed ones left out, in folder search order."""
    loaded = _state.get("entries")
    if loaded is None:
        picked: dict[str, KernelEntry] = {}
        shadowed: dict[str, tuple[KernelEntry, KernelEntry]] = {}
        for origin, folder in kernel_folders():
            for entry in load_manifest(folder, origin=origin):
                if entry.name in picked:
                    shadowed[f"{entry.name}@{origin}"] = (entry, picked[entry.name])
                else:
                    picked[entry.name] = entry
        loaded = _state["entries"] = tuple(picked.values())
        _state["shadowed"] = tuple(shadowed.values())
    return loaded


def shadowed() -> tuple[tuple[KernelEntry, KernelEntry], ...]:
    """(hidden entry, the entry that replaces it) for every kernel a user folder shadows."""
    entries()
    return _state["shadowed"]


def served_schemes(op: str | None = None) -> frozenset[str]:
    """Scheme names some generated kernel serves for op (None: for any op)."""
    served = _state.get("served")
    if served is None:
        served = {}
        for entry in entries():
            served.setdefault(entry.op, set()).add(entry.scheme)
            served.setdefault(None, set()).add(entry.scheme)
        served = _state["served"] = {key: frozenset(value) for key, value in served.items()}
    return served.get(op, frozenset())


def scheme_fields(op: str) -> dict[str, dict]:
    """{scheme name: its fields as the manifest declares them} for every scheme some kernel of op serves,
    so the ops take block sizes, group sizes and formats from the definitions rather than their own code."""
    cache = _state.setdefault("scheme_fields", {})
    fields = cache.get(op)
    if fields is None:
        fields = cache[op] = {e.scheme: e.scheme_fields for e in sorted(entries(), key=lambda e: e.scheme) if e.op == op}
    return fields


def memo(key, compute):
    """compute(), remembered under key until reset() (for choices the ops derive from the manifest)."""
    cache = _state.setdefault("memo", {})
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def any_scheme(op: str) -> str:
    """The scheme of the served kernels of an op that reads none of its scheme's fields (silu_mul, rms_norm: every
    kernel belongs to a scheme): the first by name; SchemeNotServedError where no generated kernel serves the op."""
    found = memo((op, "any scheme"), lambda: next(iter(scheme_fields(op)), None))
    if found is None:
        raise SchemeNotServedError(op, "any", f"{op}: no generated kernel serves it (add a {op} variant to a definition "
                                              "and run `kdsl generate`)")
    return found


def require_scheme(op: str, scheme: str, asked: str) -> None:
    """Refuse a scheme no generated kernel serves, the same way whether kernels or the torch fallback
    would run. `asked` names the arguments that chose the scheme, e.g. "group_size = 64"."""
    served = served_schemes(op)
    if scheme not in served:
        raise SchemeNotServedError(op, scheme,
            f"{op}: {asked} selects scheme {scheme}, which no generated kernel serves; "
            f"served: {', '.join(sorted(served)) or 'none'} (add it to a definition and run `kdsl generate`)"
        )


def require_served_scheme(scheme) -> None:
    """Refuse a quantization_config's scheme (kdsl.schema's BlockFP8 / GPTQ / AWQ: read for its name and
    kernel_schemes) whose kernels were not all generated."""
    missing = [name for name in scheme.kernel_schemes if name not in served_schemes()]
    if missing:
        family = missing[0].split(".")[0]
        served = sorted(s for s in served_schemes() if s.split(".")[0] == family)
        raise SchemeNotServedError(None, scheme.name,
            f"quantization_config selects scheme {scheme.name}, whose kernels ({', '.join(missing)}) were not "
            f"generated; served: {', '.join(served) or 'none'} (add it to a definition and run `kdsl generate`)"
        )


def device_arch(device: torch.device | None = None) -> int:
    """The arch to select for: KDSL_ARCH, else the CUDA device's, else the interpreter tier for CPU."""
    forced = _settings().forced_arch
    if forced is not None:
        return forced
    if device is not None and device.type == "cpu":
        return INTERPRETER_ARCH
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA device to select a kernel for: pass arch='sm_XX' or set KDSL_ARCH"
        )
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def run_path(device) -> str:
    """What kdsl.ops run for tensors on device: "generated kernel" (CUDA), "Triton interpreter" (CPU with
    TRITON_INTERPRET=1: the generated kernels, selected as for sm_89 unless KDSL_ARCH says otherwise) or
    "torch fallback" (CPU otherwise: kdsl/ops/fallback.py, no generated kernel runs)."""
    if torch.device(device).type == "cuda":
        return GENERATED_KERNEL
    return INTERPRETER if os.environ.get(INTERPRET_ENV) == "1" else TORCH_FALLBACK


def _here() -> str:
    """explain's last line: what runs on this machine, whatever arch the trace was asked for."""
    cpu_arch = format_arch(device_arch(torch.device("cpu")))
    if run_path("cpu") == INTERPRETER:
        cpu = (f"CPU tensors run the generated kernels selected for {cpu_arch} through Triton's interpreter "
               f"({INTERPRET_ENV}=1)")
    else:
        cpu = (f"CPU tensors run the torch fallback, no generated kernel ({INTERPRET_ENV}=1 runs the kernels "
               f"selected for {cpu_arch} through Triton's interpreter)")
    if torch.cuda.is_available():
        cuda_arch = format_arch(device_arch(torch.device("cuda")))
        return f"  on this machine: CUDA tensors run the generated kernels selected for {cuda_arch}; {cpu}"
    return f"  on this machine (no CUDA device): {cpu}"


def _scheme_name(scheme) -> str | None:
    if scheme is None or isinstance(scheme, str):
        return scheme
    name = getattr(scheme, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"scheme must be a kdsl scheme (BlockFP8, GPTQ) or its name, got {type(scheme).__name__}")
    return name


def _arch_number(arch) -> int:
    if arch is None:
        return device_arch()
    return arch if isinstance(arch, int) else parse_arch(arch)


def _specificity(entry: KernelEntry) -> tuple:
    # At an equal arch range, a user folder beats the shipped kernels (earlier folders beat later ones).
    rank = _state.get("folder_rank")
    if rank is None:
        rank = _state["folder_rank"] = {origin: -i for i, (origin, _) in enumerate(kernel_folders())}
    return (entry.min_arch, entry.max_arch is not None, -(entry.max_arch or 0), rank.get(entry.origin, -99),
            entry.name)


def _judge(op: str, scheme: str | None, arch: int) -> tuple[KernelEntry | None, list[tuple[str, str]]]:
    disabled = _settings().disabled
    fitting, verdicts = [], []
    for entry in entries():
        if entry.op != op:
            continue
        if scheme is not None and entry.scheme != scheme:
            verdicts.append((entry.label, f"refused: scheme {entry.scheme}, wanted {scheme}"))
        elif any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in disabled):
            verdicts.append((entry.label, f"refused: disabled by {DISABLE_ENV}"))
        elif arch < entry.min_arch:
            verdicts.append((entry.label, f"refused: needs {format_arch(entry.min_arch)} or newer"))
        elif entry.max_arch is not None and arch > entry.max_arch:
            verdicts.append((entry.label, f"refused: runs only up to {format_arch(entry.max_arch)}"))
        else:
            fitting.append(entry)
    chosen = max(fitting, key=_specificity) if fitting else None
    for entry in fitting:
        if entry is chosen:
            continue
        if entry.scheme != chosen.scheme:
            # No scheme was named: kernels of other schemes are not ranked against each other.
            verdicts.append((entry.label, f"fits {entry.arch_range()} for scheme {entry.scheme}; name a scheme to pick it"))
        else:
            verdicts.append((entry.label, f"fits {entry.arch_range()}, but {chosen.name} is more specific"))
    return chosen, verdicts


def select(op: str, scheme=None, arch: str | int | None = None, m: int | None = None) -> KernelEntry:
    """The kernel the registry would launch; raises NoKernelError listing every refused candidate."""
    arch_number = _arch_number(arch)
    chosen, verdicts = _judge(op, _scheme_name(scheme), arch_number)
    if chosen is None:
        raise NoKernelError(op, _scheme_name(scheme), arch_number, verdicts)
    return chosen


def _module_label(kernel_module) -> str:
    """The module's name, with the scheme's constexprs it passes (the module serves several schemes)."""
    passed = "".join(f", {name}={value}" for name, value in kernel_module.constexprs)
    return kernel_module.path.stem + passed


def explain(op: str, scheme=None, arch: str | int | None = None, m: int | None = None, n: int | None = None,
            batch: int = 1, k: int | None = None) -> str:
    """The selection trace as text: every candidate, the verdict on it, and the tile (M, N) picks (for a
    batched op, for `batch` batches; k: the reduced size, for tiles that refuse some K)."""
    arch_number = _arch_number(arch)
    name = _scheme_name(scheme)
    chosen, verdicts = _judge(op, name, arch_number)
    lines = [f"select {op} scheme={name or 'any'} arch={format_arch(arch_number)} m={m if m is not None else 'any'}"
             + ("" if n is None else f" n={n}") + ("" if k is None else f" k={k}")
             + ("" if batch == 1 else f" batch={batch}")]
    if chosen is not None:
        passed_over, bucket = _run_time_refusals(chosen, m, n, batch, k)
        tile = chosen.tiles[bucket]
        dequant, why_not = dequant_for(chosen, arch_number) if chosen.dequant else (None, "")
        if (dequant is not None and m is not None and m >= chosen.dequant["min_m"]
                and (n is None or n <= chosen.dequant.get("max_n", n))):
            lines.append(f"  {chosen.label}: CHOSEN ({chosen.arch_range()}), M = {m} >= dequant_min_m = "
                         f"{chosen.dequant['min_m']}: dequantize + cuBLAS, no GEMM tile runs")
            lines.append(f"    {dequant.label} ({dequant.op}/{dequant.impl}) {dequant.tile_for(None)} writes w [N, K] "
                         f"(prepared K order, x's dtype), then torch.matmul(x, w.T) (cuBLAS)")
        else:
            lines.append(f"  {chosen.label}: CHOSEN ({chosen.arch_range()}), tile bucket {bucket}: {tile.params['impl']} "
                         f"({_module_label(chosen.modules[tile.params['impl']])}) {tile.params}")
            lines += [f"    tile bucket {index} ({chosen.tiles[index].params['impl']}) passed over at run time "
                      f"(GPU, fp16, no act-order): {reason}" for index, reason in passed_over]
            if dequant is not None:
                widest = chosen.dequant.get("max_n")
                lines.append(f"    from M = {chosen.dequant['min_m']} up (dequant_min_m)"
                             + ("" if widest is None else f", N <= {widest} (dequant_max_n)")
                             + f": dequantize + cuBLAS instead ({dequant.name}, then torch.matmul)")
            elif chosen.dequant:
                lines.append(f"    no dequantize + cuBLAS path from M = {chosen.dequant['min_m']} up: {why_not}; "
                             "the GEMM tiles serve every M")
    lines += [f"  {entry_name}: {reason}" for entry_name, reason in verdicts]
    for hidden, winner in shadowed():
        if hidden.op == op:
            lines.append(f"  {hidden.label}: shadowed by {winner.label}")
    if chosen is None:
        lines.append("  => no kernel fits" + ("" if verdicts else f": none generated for {op}"))
    lines.append(_here())
    return "\n".join(lines)


def dequant_for(entry: KernelEntry, arch: int) -> tuple[KernelEntry | None, str]:
    """The kernel that dequantizes entry's weights on its dequantize + cuBLAS path at arch (entry.dequant names
    its op; the definition's dequant_min_m), or None and why not: the op then runs entry's tiles at every M."""
    if not entry.dequant:
        return None, f"{entry.name} has no dequant_min_m"
    op = entry.dequant["op"]
    chosen, verdicts = _judge(op, entry.scheme, arch)
    if chosen is None:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in verdicts if "scheme" not in reason)
        return None, f"no {op} kernel for {entry.scheme} on {format_arch(arch)}" + (f" ({reasons})" if reasons else "")
    if chosen.layout != entry.layout:
        return None, f"{chosen.label} reads layout {chosen.layout}, {entry.name} prepares {entry.layout}"
    return chosen, ""


def _run_time_refusals(entry: KernelEntry, m: int | None, n: int | None,
                       batch: int = 1, k: int | None = None) -> tuple[list[tuple[int, str]], int]:
    """The tiles serving (M, N) that their modules pass over for a typical GPU call (Call's defaults: fp16,
    no act-order, aligned), with their reasons, and the tile that then runs: what kdsl.ops does at run time."""
    if m is None:
        return [], entry.bucket_index(m, n)
    call, passed_over = Call(m=m, n=n, k=k, batch=batch), []
    for index, bucket in enumerate(entry.tiles):
        if bucket.serves(m, n):
            reason = entry.refusal_reason(bucket.params, call)
            if reason is None:
                return passed_over, index
            passed_over.append((index, reason))
    return passed_over, len(entry.tiles) - 1


def dispatch(op: str, scheme_name: str, device: torch.device) -> KernelEntry:
    """Hot path for kdsl.ops: one dict lookup after the first call per (op, scheme, device)."""
    key = (op, scheme_name, device.type, device.index)
    cache = _state.setdefault("dispatch", {})
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = select(op, scheme_name, arch=device_arch(device))
    return entry
