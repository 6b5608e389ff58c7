"""What `kdsl tune` tunes: the kernel the registry picks on this GPU, and the variant behind it.

The registry picks the generated kernel for the op, the bench's scheme (its case module's Tune:
block FP8 128x128 / GPTQ INT4 group 128) and this GPU's arch (or KDSL_ARCH); its tiles are written back to the
definition variant with the same op, impl and arch range in the --defs folder. The tiles of
a variant serve every scheme of its file, so candidates are validated against all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kdsl.bench.cases import TUNES
from kdsl.schema import LoadedDefinition, Variant


class TargetError(LookupError):
    """No definition variant matches the kernel the registry picks."""


@dataclass(frozen=True)
class Target:
    entry: object  # kdsl.runtime.manifest.KernelEntry: what gets launched
    loaded: LoadedDefinition  # the definition file its tiles are written to
    variant_index: int

    @property
    def variant(self) -> Variant:
        return self.loaded.definition.variants[self.variant_index]

    def describe(self) -> str:
        v = self.variant
        return f"{v.op}/{v.impl} {self.entry.arch_range()} in {self.loaded.path} ({self.entry.name})"


def find_variant(definitions: list[LoadedDefinition], op: str, impl: str, scheme: str, min_arch: int,
                 max_arch: int | None) -> tuple[LoadedDefinition, int]:
    """The definition file and index of the variant that generates op/impl for scheme on [min_arch, max_arch]."""
    for loaded in definitions:
        if scheme not in {s.name for s in loaded.definition.schemes}:
            continue
        for index, variant in enumerate(loaded.definition.variants):
            if (variant.op, variant.impl, variant.min_cc, variant.max_cc) == (op, impl, min_arch, max_arch):
                return loaded, index
    arch = f"sm_{min_arch}" + (f"..sm_{max_arch}" if max_arch else "+")
    raise TargetError(f"no variant op {op!r} impl {impl!r} on {arch} for scheme {scheme} in "
                      f"{', '.join(str(d.path) for d in definitions) or 'the definitions'}; generated/ may be stale: "
                      "run `python -m kdsl generate`")


def select_target(op: str, definitions: list[LoadedDefinition], arch: str | int | None = None) -> Target:
    """The registry's pick for op on this GPU (arch None) and its variant; raises NoKernelError or TargetError."""
    from kdsl.runtime import registry

    scheme = TUNES[op].scheme.name  # the scheme the op is timed with: its bench case's
    entry = registry.select(op, scheme, arch=arch)
    loaded, index = find_variant(definitions, op, entry.impl, scheme, entry.min_arch, entry.max_arch)
    return Target(entry, loaded, index)


def stale_tiles(target: Target) -> bool:
    """True when generated/ launches other tiles than the definition holds (regenerate first)."""
    from kdsl.codegen.render import tile_params
    from kdsl.kernels import find_impl

    variant = target.variant
    have = [(b.m_max, b.n_min, b.params) for b in target.entry.tiles]
    want = [(t.m_max, t.n_min, tile_params(t, find_impl(variant.op, variant.impl_of(t)))) for t in variant.tiles]
    return have != want
