"""Pick the generated kernel for an op, a scheme, an architecture and an M.

Selection rule: among the entries for the op and scheme whose [min_arch,
max_arch] holds the arch and that are not disabled, the one with the highest
min_arch wins (the most specialized); a capped range beats an open one at the
same floor. Every refusal carries its reason, so a failed lookup explains itself.

Environment:
  KDSL_ARCH=sm_90        select as if the device were this arch (also on CPU)
  KDSL_DISABLE=a,b*      never pick kernels whose name matches (fnmatch patterns)
Read once; call reset() after changing them.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import torch

from kdsl.naming import format_arch, parse_arch
from kdsl.runtime.manifest import KernelEntry, load_manifest

FORCE_ARCH_ENV = "KDSL_ARCH"
DISABLE_ENV = "KDSL_DISABLE"
# Tensors on the CPU run through Triton's interpreter; pick what an Ada GPU would run,
# the most portable tier that has every op.
INTERPRETER_ARCH = 89


class NoKernelError(LookupError):
    """No generated kernel fits; `refusals` lists every candidate and why it was refused."""

    def __init__(self, op: str, scheme: str | None, arch: int, refusals: list[tuple[str, str]]):
        self.op, self.scheme, self.arch, self.refusals = op, scheme, arch, refusals
        lines = [f"no generated kernel for op {op!r}, scheme {scheme or 'any'}, arch {format_arch(arch)}"]
        if not refusals:
            lines.append("  no kernel for this op was generated: add a variant to kernel_defs/ and run `python -m kdsl generate`")
        lines += [f"  {name}: {reason}" for name, reason in refusals]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class _Settings:
    forced_arch: int | None
    disabled: tuple[str, ...]


_state: dict = {}


def reset() -> None:
    """Forget the manifest, the environment settings and the dispatch cache."""
    _state.clear()


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
    loaded = _state.get("entries")
    if loaded is None:
        loaded = _state["entries"] = load_manifest()
    return loaded


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
    return (entry.min_arch, entry.max_arch is not None, -(entry.max_arch or 0), entry.name)


def _judge(op: str, scheme: str | None, arch: int) -> tuple[KernelEntry | None, list[tuple[str, str]]]:
    disabled = _settings().disabled
    fitting, verdicts = [], []
    for entry in entries():
        if entry.op != op:
            continue
        if scheme is not None and entry.scheme != scheme:
            verdicts.append((entry.name, f"refused: scheme {entry.scheme}, wanted {scheme}"))
        elif any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in disabled):
            verdicts.append((entry.name, f"refused: disabled by {DISABLE_ENV}"))
        elif arch < entry.min_arch:
            verdicts.append((entry.name, f"refused: needs {format_arch(entry.min_arch)} or newer"))
        elif entry.max_arch is not None and arch > entry.max_arch:
            verdicts.append((entry.name, f"refused: runs only up to {format_arch(entry.max_arch)}"))
        else:
            fitting.append(entry)
    chosen = max(fitting, key=_specificity) if fitting else None
    for entry in fitting:
        if entry is chosen:
            continue
        if entry.scheme != chosen.scheme:
            # No scheme was named: kernels of other schemes are not ranked against each other.
            verdicts.append((entry.name, f"fits {entry.arch_range()} for scheme {entry.scheme}; name a scheme to pick it"))
        else:
            verdicts.append((entry.name, f"fits {entry.arch_range()}, but {chosen.name} is more specific"))
    return chosen, verdicts


def select(op: str, scheme=None, arch: str | int | None = None, m: int | None = None) -> KernelEntry:
    """The kernel the registry would launch; raises NoKernelError listing every refused candidate."""
    arch_number = _arch_number(arch)
    chosen, verdicts = _judge(op, _scheme_name(scheme), arch_number)
    if chosen is None:
        raise NoKernelError(op, _scheme_name(scheme), arch_number, verdicts)
    return chosen


def explain(op: str, scheme=None, arch: str | int | None = None, m: int | None = None, n: int | None = None) -> str:
    """The selection trace as text: every candidate, the verdict on it, and the tile (M, N) picks."""
    arch_number = _arch_number(arch)
    name = _scheme_name(scheme)
    chosen, verdicts = _judge(op, name, arch_number)
    lines = [f"select {op} scheme={name or 'any'} arch={format_arch(arch_number)} m={m if m is not None else 'any'}"
             + ("" if n is None else f" n={n}")]
    if chosen is not None:
        bucket = chosen.bucket_index(m, n)
        lines.append(f"  {chosen.name}: CHOSEN ({chosen.arch_range()}), tile bucket {bucket}: {chosen.tiles[bucket].params}")
    lines += [f"  {entry_name}: {reason}" for entry_name, reason in verdicts]
    if chosen is None:
        lines.append("  => no kernel fits" + ("" if verdicts else f": none generated for {op}"))
    return "\n".join(lines)


def dispatch(op: str, scheme_name: str, device: torch.device) -> KernelEntry:
    """Hot path for kdsl.ops: one dict lookup after the first call per (op, scheme, device)."""
    key = (op, scheme_name, device.type, device.index)
    cache = _state.setdefault("dispatch", {})
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = select(op, scheme_name, arch=device_arch(device))
    return entry
