"""Read generated/manifest.json into plain, immutable entries; import their modules on demand."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

GENERATED_ENV = "KDSL_GENERATED"  # replaces the shipped kernels' folder
KERNEL_PATH_ENV = "KDSL_KERNEL_PATH"  # extra folders of generated kernels, searched before the shipped ones
SUPPORTED_FORMAT = 9
SHIPPED = "shipped"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def shipped_dir() -> Path:
    """The kernels kdsl ships: $KDSL_GENERATED if set; else kdsl/generated/ inside an installed wheel;
    else the repository's generated/ beside the kdsl package (a checkout or an editable install)."""
    override = os.environ.get(GENERATED_ENV)
    if override:
        return Path(override)
    installed = _PACKAGE_DIR / "generated"
    return installed if (installed / "manifest.json").is_file() else _PACKAGE_DIR.parent / "generated"


def shipped_definitions_dir() -> Path:
    """The definitions the shipped kernels were rendered from (kdsl/kernel_defs/ in a wheel)."""
    installed = _PACKAGE_DIR / "kernel_defs"
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / "kernel_defs"


def extra_dirs_from_env() -> list[Path]:
    """$KDSL_KERNEL_PATH: folders written by `kdsl generate --out`, separated like PATH."""
    return [Path(p) for p in os.environ.get(KERNEL_PATH_ENV, "").split(os.pathsep) if p.strip()]


generated_dir = shipped_dir  # the name earlier releases used


@dataclass(frozen=True)
class TileBucket:
    m_max: int | None
    n_min: int | None
    params: dict = field(hash=False, compare=False)

    def serves(self, m: int | None, n: int | None) -> bool:
        """Whether this tile's bucket takes M rows (None: only the open-ended bucket does) and N columns
        (None: only a tile for every N does)."""
        serves_m = self.m_max is None or (m is not None and m <= self.m_max)
        serves_n = self.n_min is None or (n is not None and n >= self.n_min)
        return serves_m and serves_n


@dataclass(frozen=True, eq=False)
class KernelEntry:
    """One generated kernel: where it may run, how it is tiled, and its module (imported lazily)."""

    name: str
    op: str
    impl: str
    scheme: str
    min_arch: int
    max_arch: int | None
    tiles: tuple[TileBucket, ...]
    module_path: Path
    function: str
    source: str
    layout: dict | None = field(default=None, hash=False, compare=False)  # prepared-weight layout, if any
    origin: str = SHIPPED  # "shipped", or the folder a user added it from
    zero_bias: dict | None = field(default=None, hash=False, compare=False)  # per dtype name, biased-zero layouts
    refusal_function: str | None = None  # the module's "should this tile serve this call" function, if any
    scheme_fields: dict = field(default_factory=dict, hash=False, compare=False)  # the scheme as the manifest lists it

    def tile_for(self, m: int, n: int | None = None, refuses=None) -> dict:
        """Launch parameters for M rows (and N columns, where the definition tiles by N too).

        refuses(params), if given, says why a tile should not serve this call (None: it should): the first
        tile serving M and N that it does not refuse is chosen, and the last tile if it refuses them all.
        """
        if refuses is None:
            return self.tiles[self.bucket_index(m, n)].params
        for bucket in self.tiles:
            if bucket.serves(m, n) and not refuses(bucket.params):
                return bucket.params
        return self.tiles[-1].params

    def bucket_index(self, m: int | None, n: int | None = None) -> int:
        """The first tile serving M (None: the last bucket) and N (None: the bucket's tile for every N)."""
        for index, bucket in enumerate(self.tiles):
            if bucket.serves(m, n):
                return index
        return len(self.tiles) - 1

    def load(self) -> ModuleType:
        module = _MODULES.get(self.module_path)
        if module is None:
            package = "kdsl_generated" if self.origin == SHIPPED else (
                "kdsl_user_" + hashlib.sha256(self.origin.encode()).hexdigest()[:12])
            module = _import_file(f"{package}.{self.name}", self.module_path)
            _MODULES[self.module_path] = module
        return module

    @property
    def launch(self):
        return getattr(self.load(), self.function)

    @property
    def refusal(self):
        """(tile params, m, device_type, contiguous_groups) -> reason or None; None when the kernel declares none."""
        return None if self.refusal_function is None else getattr(self.load(), self.refusal_function)

    @property
    def label(self) -> str:
        """The name, and the folder it came from unless it is a shipped kernel."""
        return self.name if self.origin == SHIPPED else f"{self.name} [{self.origin}]"

    def arch_range(self) -> str:
        return f"sm_{self.min_arch}..sm_{self.max_arch}" if self.max_arch else f"sm_{self.min_arch}+"


_MODULES: dict[Path, ModuleType] = {}


def _import_file(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton's JIT looks functions up through their module
    spec.loader.exec_module(module)
    return module


class ManifestError(RuntimeError):
    """generated/ is missing, unreadable or from another kdsl."""


def load_manifest(folder: Path | None = None, origin: str = SHIPPED) -> tuple[KernelEntry, ...]:
    folder = folder or shipped_dir()
    path = folder / "manifest.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist: run `python -m kdsl generate` first") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path} is unreadable ({error}): run `python -m kdsl generate`") from None
    if data.get("format") != SUPPORTED_FORMAT:
        raise ManifestError(f"{path} has format {data.get('format')!r}, this kdsl reads {SUPPORTED_FORMAT}: "
                            "run `python -m kdsl generate`")
    entries = []
    for raw in data["kernels"]:
        tiles = tuple(
            TileBucket(t["m_max"], t["n_min"], {k: v for k, v in t.items() if k not in ("m_max", "n_min")})
            for t in raw["tiles"]
        )
        entries.append(KernelEntry(
            name=raw["name"], op=raw["op"], impl=raw["impl"], scheme=raw["scheme"],
            min_arch=raw["min_arch"], max_arch=raw["max_arch"], tiles=tiles,
            module_path=folder / raw["module"], function=raw["function"], source=raw["source"],
            layout=raw.get("layout"), origin=origin, zero_bias=raw.get("zero_bias"),
            refusal_function=raw.get("refusal"), scheme_fields=raw.get("scheme_definition", {}),
        ))
    return tuple(entries)
