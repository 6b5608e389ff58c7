"""Expand validated definitions into the flat list of kernels to render.

One planned kernel per (scheme, variant), the unit the registry picks by arch; it picks a tile by
M and N at run time. Each implementation the variant's tiles use renders into a module of its own
(one module, one algorithm), so a variant whose tiles name several implementations has several.
A module is rendered once per (op, implementation, prepared layout) and the part of the scheme it bakes in
(scheme.module_scheme), and named after the lowest arch it serves: the schemes of a definition that differ only
in numbers the kernels take as constexpr arguments (scheme.constexprs: group size, zero offset) share it, and so
do the definition's variants for several archs that differ only in their tiles (the manifest carries those).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kdsl.kernels import KernelImpl, dequant_op_for, find_impl
from kdsl.naming import kernel_name
from kdsl.schema import LoadedDefinition, Tile


@dataclass(frozen=True)
class PlannedModule:
    """One generated module: one implementation's kernel, with the variant's tiles it serves, shared by the
    kernels of every scheme it serves (`schemes`, their names)."""

    name: str
    impl: KernelImpl
    schemes: tuple[str, ...]
    arch_range: str  # the archs of the variants sharing it, e.g. "sm_80 and up"


@dataclass(frozen=True)
class PlannedKernel:
    op: str
    scheme: object  # a BlockFP8 or GPTQ model
    min_arch: int
    max_arch: int | None
    tiles: tuple[Tile, ...]
    tile_impls: tuple[KernelImpl, ...]  # the implementation serving each tile
    modules: tuple[PlannedModule, ...]  # one per implementation the tiles use, the variant's impl first
    layout: object | None  # a GPTQLayout for kernels that read prepared weights
    source: str  # definition file, as a path relative to where generate ran
    definition_digest: str  # sha256 of what renders it: its scheme and variant (not the whole file)
    dequant: dict | None = None  # {"op", "min_m"}: the dequantize + cuBLAS path from min_m rows (dequant_min_m)

    @property
    def name(self) -> str:
        """The variant's kernel for this scheme, named after its own implementation (its module, modules[0],
        serves every scheme that shares the variant and module_scheme, so it drops the constexpr numbers)."""
        return kernel_name(self.op, self.scheme.name, self.impl.impl, self.min_arch)

    @property
    def constexprs(self) -> dict[str, int]:
        """The scheme's numbers its modules' kernels take as constexpr arguments (GROUP_SIZE, ...)."""
        return self.scheme.constexprs

    @property
    def impl(self) -> KernelImpl:
        """The variant's implementation."""
        return self.modules[0].impl


def plan_kernels(definitions: list[LoadedDefinition]) -> list[PlannedKernel]:
    planned: list[PlannedKernel] = []
    for loaded in definitions:
        # "kernel_defs/block_fp8.toml" whatever the working directory: headers stay byte-stable.
        source = f"{loaded.path.parent.name}/{loaded.path.name}"
        archs = _module_archs(loaded.definition.variants)
        for scheme in loaded.definition.schemes:
            for variant in loaded.definition.variants:
                digest = _render_inputs_digest(scheme, variant)
                tile_impls = tuple(find_impl(variant.op, variant.impl_of(tile)) for tile in variant.tiles)
                assert None not in tile_impls, "validated definitions name catalogued implementations"
                modules = []
                for impl_name in variant.impls:
                    min_cc, max_cc = archs[_module_key(variant, impl_name)]
                    modules.append(PlannedModule(
                        name=kernel_name(variant.op, scheme.module_scheme, impl_name, min_cc),
                        impl=find_impl(variant.op, impl_name),
                        schemes=tuple(s.name for s in loaded.definition.schemes
                                      if s.module_scheme == scheme.module_scheme),
                        arch_range=f"sm_{min_cc}" + (f" .. sm_{max_cc}" if max_cc else " and up"),
                    ))
                modules = tuple(modules)
                planned.append(PlannedKernel(
                    op=variant.op, scheme=scheme,
                    min_arch=variant.min_cc, max_arch=variant.max_cc,
                    tiles=tuple(variant.tiles), tile_impls=tile_impls, modules=modules,
                    layout=variant.layout, source=source, definition_digest=digest,
                    dequant=None if variant.dequant_min_m is None else {
                        "op": dequant_op_for(variant.op), "min_m": variant.dequant_min_m,
                        **({} if variant.dequant_max_n is None else {"max_n": variant.dequant_max_n})},
                ))
    _refuse_name_clashes(planned)
    return sorted(planned, key=lambda k: k.name)


def _module_key(variant, impl_name: str) -> tuple:
    """What a module's device code depends on besides the scheme: the op, the implementation's template and the
    prepared layout it reads (the tiles are the manifest's, not the module's)."""
    layout = None if variant.layout is None else json.dumps(variant.layout.model_dump(mode="json"), sort_keys=True)
    return variant.op, impl_name, layout


def _module_archs(variants) -> dict[tuple, tuple[int, int | None]]:
    """For each module of a definition (_module_key), the archs of the variants rendering it: (lowest min_cc,
    highest max_cc or None where one variant has no cap)."""
    archs: dict[tuple, tuple[int, int | None]] = {}
    for variant in variants:
        for impl_name in variant.impls:
            key = _module_key(variant, impl_name)
            low, high = archs.get(key, (variant.min_cc, variant.max_cc))
            uncapped = high is None or variant.max_cc is None
            archs[key] = (min(low, variant.min_cc), None if uncapped else max(high, variant.max_cc))
    return archs


def _render_inputs_digest(scheme, variant) -> str:
    """sha256 of the validated scheme and variant: an edit elsewhere in the file (another variant, a
    comment) leaves this kernel's digest, and so its module, unchanged. dequant_min_m is left out: it is run-time
    dispatch the manifest carries, not rendered into any module."""
    canonical = json.dumps({"scheme": scheme.model_dump(mode="json"),
                            "variant": variant.model_dump(mode="json", exclude={"dequant_min_m", "dequant_max_n"})},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class PlanError(Exception):
    """Two definitions would generate the same kernel."""


def _refuse_name_clashes(planned: list[PlannedKernel]) -> None:
    """Kernel names are unique, and the kernels sharing a module are one variant's, of one definition file, for
    schemes rendered alike (their module_scheme): another variant or file generating the module is a clash."""
    kernels: dict[str, str] = {}
    modules: dict[str, tuple] = {}
    for kernel in planned:
        if kernel.name in kernels:
            raise PlanError(
                f"{kernel.source}: kernel {kernel.name} is also generated by {kernels[kernel.name]}; "
                "give one of the variants a different min_arch or impl, or drop the duplicate scheme")
        kernels[kernel.name] = kernel.source
        for module in kernel.modules:
            renders = (kernel.source, module)
            if modules.setdefault(module.name, renders) != renders:
                raise PlanError(
                    f"{kernel.source}: module {module.name} is also generated by {modules[module.name][0]}; "
                    "give one of the variants a different min_arch or impl, or drop the duplicate scheme")
