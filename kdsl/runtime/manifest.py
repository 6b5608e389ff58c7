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

import kdsl.schema  # noqa: F401  (before kdsl.kernels: the schema's definitions import the units, theirs first)
from kdsl.kernels import find_impl
from kdsl.kernels.base import Generated, KernelImpl, Launch, dependent as dependent_launch
from kdsl.naming import kernel_name
from kdsl.runtime import launcher
from kdsl.schema.scheme import launch_values

GENERATED_ENV = "KDSL_GENERATED"  # replaces the shipped kernels' folder
KERNEL_PATH_ENV = "KDSL_KERNEL_PATH"  # extra folders of generated kernels, searched before the shipped ones
SUPPORTED_FORMAT = 13
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


def package_dir() -> Path:
    """The kdsl package's own folder: site-packages/kdsl in an installed wheel, kdsl/ in a checkout."""
    return _PACKAGE_DIR


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


@dataclass(frozen=True)
class Call:
    """What a generated module's refusal function may read of a call, to say why a tile should not serve it:
    rows, columns, the device, the activations' dtype (its torch name), for prepared weights whether x is
    gathered (act-order) and whether row k is in group k // group_size, and `align`: the largest power of two
    up to 16 dividing every base address and every stepped stride (in bytes) of the operands the op names,
    0 where one of those strides is 0 (a broadcast view), as TMA descriptors need them; `batch`: the batch
    count of a batched op (1 otherwise); `stacked`: a MoE op's experts' weights [E, N, K] lie one [E * N, K] matrix
    (each expert N rows after the last), as one TMA descriptor reads them. `explain` asks about a typical GPU call
    (the defaults)."""

    m: int
    n: int | None = None
    k: int | None = None  # the reduced size, where the op has one and a refusal reads it
    device_type: str = "cuda"
    dtype: str = "float16"
    act_order: bool = False
    contiguous_groups: bool = True
    align: int = 16
    batch: int = 1
    stacked: bool = True


@dataclass(frozen=True, eq=False)
class KernelModule:
    """One generated module of a kernel: one implementation's algorithm. Its device code is the module; its
    host code (launch and refusal) is the implementation's unit (kdsl.kernels.base.KernelImpl). The module is
    shared by the kernels of several schemes: each kernel's KernelModule carries its scheme's constexprs, which
    the unit passes to the module's kernels."""

    impl: str
    path: Path
    unit: KernelImpl | None  # None: the manifest names an implementation this kdsl does not have
    import_name: str
    constexprs: tuple = ()  # the kernel's scheme's (name, value) constexpr arguments, e.g. (("GROUP_SIZE", 128),)
    kernel_name: str = ""  # the kernel's name for this implementation and scheme (the entry's name for its own)
    scheme: tuple = ()  # the scheme's numbers its launch description names, (("act_group", 128), ...)

    @property
    def key(self) -> tuple:
        """What a launch binds to: the module, the scheme's constexprs (one module serves several schemes) and the
        kernel (one module serves the variants for several archs), so a launch says which kernel it is."""
        return self.path, self.constexprs, self.kernel_name

    def load(self) -> ModuleType:
        module = _MODULES.get(self.path)
        if module is None:
            module = _MODULES[self.path] = _import_file(self.import_name, self.path)
            for hook in _MODULE_HOOKS:
                hook(self, module)
        return module

    def generated(self) -> Generated:
        """The loaded module as its unit's launch and refusal read it, with the scheme's constexprs (built once
        per scheme)."""
        generated = _GENERATED.get(self.key)
        if generated is None:
            generated = _GENERATED[self.key] = Generated(self.load(), self.path.stem, dict(self.constexprs),
                                                         dict(self.scheme))
        return generated

    @property
    def launch(self):
        """launch(*args, tile, dependent=False): the call's launches, as the unit describes them, run by
        kdsl.runtime.launcher; dependent: its one launch as a programmatic dependent launch of the kernel before
        it on the stream, where the kernel can be one (kdsl.kernels.base.dependent)."""
        bound = _LAUNCHES.get(self.key)
        if bound is None:
            if self.unit is None:
                raise ManifestError(f"{self.path}: implementation {self.impl!r} is not one this kdsl has: "
                                    "run `python -m kdsl generate`")
            generated, describe, run = self.generated(), self.unit.launch, launcher.run

            def bound(*args, dependent=False):
                # launcher.run_all, inlined: this is every eager launch's path
                described = describe(generated, *args)
                if type(described) is Launch:
                    run(dependent_launch(described) if dependent else described)
                else:
                    for launch in described:
                        run(launch)
            _LAUNCHES[self.key] = bound
        return bound

    def run(self, describe, *args) -> None:
        """Run the launches describe(generated, *args) returns: host code shared by several implementations
        (act-order's gather of x, kdsl.kernels.w4a16.common) launching a kernel of this module."""
        launcher.run_all(describe(self.generated(), *args))

    def refusal_reason(self, params: dict, call: Call) -> str | None:
        """Why the tile (its params) should not serve the call, or None: the unit's refusal, where it has one."""
        refusal = None if self.unit is None else self.unit.refusal
        return None if refusal is None else refusal(self.generated(), params, call)

    @property
    def refuses(self) -> bool:
        return self.unit is not None and self.unit.refusal is not None


@dataclass(frozen=True, eq=False)
class KernelEntry:
    """One generated kernel (a definition's variant for one scheme): where it may run, how it is tiled, and
    its modules, one per implementation its tiles name (imported lazily)."""

    name: str
    op: str
    impl: str
    scheme: str
    min_arch: int
    max_arch: int | None
    tiles: tuple[TileBucket, ...]
    modules: dict = field(hash=False, compare=False)  # {impl: KernelModule}, the entry's own impl first
    source: str = ""
    layout: dict | None = field(default=None, hash=False, compare=False)  # prepared-weight layout, if any
    origin: str = SHIPPED  # "shipped", or the folder a user added it from
    zero_bias: dict | None = field(default=None, hash=False, compare=False)  # per dtype name, biased-zero layouts
    scheme_fields: dict = field(default_factory=dict, hash=False, compare=False)  # the scheme as the manifest lists it
    # The scheme's numbers its modules' kernels take as constexpr arguments ({"GROUP_SIZE": 128, ...})
    constexprs: dict = field(default_factory=dict, hash=False, compare=False)
    # {"op": dequantizer op, "min_m": rows}: from min_m rows up, dequantize + torch.matmul (registry.dequant_for)
    dequant: dict | None = field(default=None, hash=False, compare=False)

    def tile_for(self, m: int, n: int | None = None, call: Call | None = None) -> dict:
        """Launch parameters for M rows (and N columns, where the definition tiles by N too).

        With `call`, the first tile serving M and N whose module does not refuse the call is chosen (the
        tile after it, with the same m_max and n_min, is usually its alternative), and the last tile if
        every one refuses. Without, the first tile serving M and N.
        """
        if call is None:
            return self.tiles[self.bucket_index(m, n)].params
        for bucket in self.tiles:
            if bucket.serves(m, n) and self.refusal_reason(bucket.params, call) is None:
                return bucket.params
        return self.tiles[-1].params

    @property
    def refuses_calls(self) -> bool:
        """Whether any of its modules may pass a tile over at run time (the ops then describe the call)."""
        return any(module.refuses for module in self.modules.values())

    def refusal_reason(self, params: dict, call: Call) -> str | None:
        """Why the tile's module passes it over for this call (None: it serves it)."""
        return self.modules[params["impl"]].refusal_reason(params, call)

    def bucket_index(self, m: int | None, n: int | None = None) -> int:
        """The first tile serving M (None: the last bucket) and N (None: the bucket's tile for every N)."""
        for index, bucket in enumerate(self.tiles):
            if bucket.serves(m, n):
                return index
        return len(self.tiles) - 1

    def load(self) -> ModuleType:
        """The module of the entry's own implementation."""
        return self.modules[self.impl].load()

    @property
    def module_path(self) -> Path:
        """The file of the entry's own implementation's module."""
        return self.modules[self.impl].path

    @property
    def launch(self):
        """launch(*args, tile): the launch function of the module serving `tile`."""
        if len(self.modules) == 1:
            return self.modules[self.impl].launch
        modules = self.modules
        return lambda *args: modules[args[-1]["impl"]].launch(*args)

    @property
    def label(self) -> str:
        """The name, and the folder it came from unless it is a shipped kernel."""
        return self.name if self.origin == SHIPPED else f"{self.name} [{self.origin}]"

    def arch_range(self) -> str:
        return f"sm_{self.min_arch}..sm_{self.max_arch}" if self.max_arch else f"sm_{self.min_arch}+"


_MODULES: dict[Path, ModuleType] = {}
_LAUNCHES: dict = {}  # KernelModule.key -> its unit's launch function, bound to the loaded module once per scheme
_GENERATED: dict = {}  # KernelModule.key -> the loaded module as its unit reads it (kdsl.kernels.base.Generated)
# Called with (KernelModule, module) after a generated module is imported. A package that must act then
# (kdsl.aot: KDSL_AOT=DIR is loaded with the first module) adds itself when it is imported; the runtime imports none.
_MODULE_HOOKS: list = []


def add_module_hook(hook) -> None:
    """Call hook(kernel_module, module) after each generated module is imported from now on (a hook added
    twice runs once)."""
    if hook not in _MODULE_HOOKS:
        _MODULE_HOOKS.append(hook)


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
        package = "kdsl_generated" if origin == SHIPPED else (
            "kdsl_user_" + hashlib.sha256(origin.encode()).hexdigest()[:12])
        constexprs = raw.get("constexprs", {})
        scheme = tuple(launch_values(raw.get("scheme_definition", {})).items())
        modules = {
            m["impl"]: KernelModule(impl=m["impl"], path=folder / m["module"], unit=find_impl(raw["op"], m["impl"]),
                                    import_name=f"{package}.{m['module'].removesuffix('.py')}",
                                    constexprs=tuple(constexprs.items()),
                                    kernel_name=kernel_name(raw["op"], raw["scheme"], m["impl"], raw["min_arch"]),
                                    scheme=scheme)
            for m in raw["modules"]
        }
        entries.append(KernelEntry(
            name=raw["name"], op=raw["op"], impl=raw["impl"], scheme=raw["scheme"],
            min_arch=raw["min_arch"], max_arch=raw["max_arch"], tiles=tiles, modules=modules,
            source=raw["source"], layout=raw.get("layout"), origin=origin, zero_bias=raw.get("zero_bias"),
            scheme_fields=raw.get("scheme_definition", {}), dequant=raw.get("dequant"), constexprs=constexprs,
        ))
    return tuple(entries)
