"""A definition file: schemes plus the variants to generate for each of them."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationError, model_validator

from kdsl.kernels import BASE_KNOBS, KernelImpl, dequant_op_for, find_impl, ops_of_family
from kdsl.naming import format_arch
from kdsl.strict_model import StrictModel
from kdsl.schema.arch import archs_in_range
from kdsl.schema.scheme import BlockFP8, Scheme
from kdsl.schema.tiling import Tile, Variant


class KernelDefinition(StrictModel):
    """Every variant is generated for every scheme of the file."""

    description: str = ""
    schemes: list[Scheme] = Field(min_length=1)
    variants: list[Variant] = Field(min_length=1)

    @model_validator(mode="after")
    def _variants_fit_schemes_and_hardware(self) -> "KernelDefinition":
        problems: list[str] = []
        seen_names: dict[str, int] = {}
        for s_index, scheme in enumerate(self.schemes):
            if scheme.name in seen_names:
                problems.append(f"schemes[{s_index}]: same kernels as schemes[{seen_names[scheme.name]}] ({scheme.name})")
            seen_names.setdefault(scheme.name, s_index)
        # One op/impl may be tuned per arch range; the kernel name carries min_arch, so that must differ.
        seen_variants: dict[tuple[str, str, int], int] = {}
        for v_index, variant in enumerate(self.variants):
            where = f"variants[{v_index}]"
            key = (variant.op, variant.impl, variant.min_cc)
            if key in seen_variants:
                problems.append(f"{where}: duplicates variants[{seen_variants[key]}] (op {variant.op!r}, "
                                f"impl {variant.impl!r}, min_arch {variant.min_arch!r}); give each arch range "
                                "its own min_arch")
            seen_variants.setdefault(key, v_index)
            for scheme in self.schemes:
                problems.extend(_check_variant(where, variant, scheme))
            problems.extend(_dequant_path_problems(where, variant, self.variants))
        if problems:
            raise ValueError("\n".join(dict.fromkeys(problems)))
        return self


def _check_variant(where: str, variant: Variant, scheme) -> list[str]:
    problems = []
    for name in variant.impls:
        impl = find_impl(variant.op, name)
        at = f"{where}.impl" if name == variant.impl else f"{where}.tiles"
        if impl is None or impl.family != scheme.kind:
            known = ", ".join(ops_of_family(scheme.kind))
            if impl is None and variant.op in ops_of_family(scheme.kind):
                return [f"{at}: no implementation {name!r} of op {variant.op!r}"]
            return [f"{where}.op: {variant.op!r} is not an op of the {scheme.kind} family (ops: {known})"]
        problems += _impl_fits_variant(where, variant, impl, scheme)
    for t_index, tile in enumerate(variant.tiles):
        impl = find_impl(variant.op, variant.impl_of(tile))
        problems.extend(_tile_problems(f"{where}.tiles[{t_index}]", variant, impl, scheme, tile))
        before = variant.tiles[t_index - 1] if t_index else None
        if before is not None and (before.m_max, before.n_min) == (tile.m_max, tile.n_min):
            refused_by = find_impl(variant.op, variant.impl_of(before))
            if refused_by.refusal is None:
                problems.append(
                    f"{where}.tiles[{t_index}]: has the m_max and n_min of tiles[{t_index - 1}], so it serves only "
                    f"where that tile's kernel refuses a call, but {variant.op}/{refused_by.impl} refuses none; "
                    "give it its own n_min or drop it")
    last = find_impl(variant.op, variant.impl_of(variant.tiles[-1]))
    if last.refusal is not None:
        problems.append(
            f"{where}.tiles[{len(variant.tiles) - 1}]: the last tile must serve every call, but "
            f"{variant.op}/{last.impl} refuses some at run time (on the CPU, for one); follow it with an "
            "alternative tile (same m_max and n_min) of an implementation that refuses none")
    return problems


def _dequant_path_problems(where: str, variant: Variant, variants: list[Variant]) -> list[str]:
    """dequant_min_m: the op must have a dequantize + cuBLAS path, and this definition a variant of its dequant
    op over the same arch range reading the same layout (both are generated for every scheme of the file, so
    wherever the registry picks this variant it finds its dequantizer)."""
    if variant.dequant_min_m is None:
        if variant.dequant_max_n is not None:
            return [f"{where}.dequant_max_n: bounds the dequantize + cuBLAS path, which needs dequant_min_m"]
        return []
    dequant_op = dequant_op_for(variant.op)
    if dequant_op is None:
        return [f"{where}.dequant_min_m: {variant.op} has no dequantize + cuBLAS path"]
    arch_range = f"min_arch = {variant.min_arch!r}" + (f", max_arch = {variant.max_arch!r}" if variant.max_arch else "")
    for index, other in enumerate(variants):
        if other.op == dequant_op and (other.min_cc, other.max_cc) == (variant.min_cc, variant.max_cc):
            if other.layout != variant.layout:
                return [f"{where}.dequant_min_m: variants[{index}] ({dequant_op}) reads layout "
                        f"{_layout_text(other.layout)}, but this variant prepares {_layout_text(variant.layout)}"]
            return []
    return [f"{where}.dequant_min_m: needs a {dequant_op} variant with {arch_range} and the same layout in this "
            f"definition (from M = {variant.dequant_min_m} up, {variant.op} runs it, then torch.matmul)"]


def _layout_text(layout) -> str:
    return "none" if layout is None else "{ " + ", ".join(f'{k} = "{v}"' for k, v in layout.model_dump().items()) + " }"


def _impl_fits_variant(where: str, variant: Variant, impl: KernelImpl, scheme) -> list[str]:
    """The variant's arch range and layout against one implementation its tiles use."""
    problems = []
    if variant.min_cc < impl.min_arch:
        need = "FP8 tensor cores" if scheme.kind == "block_fp8" else "its instructions"
        problems.append(
            f"{where}.min_arch: {variant.min_arch} is below {format_arch(impl.min_arch)}, "
            f"which {variant.op}/{impl.impl} needs for {need}"
        )
    if impl.max_arch is not None and (variant.max_cc is None or variant.max_cc > impl.max_arch):
        problems.append(
            f"{where}.max_arch: {variant.op}/{impl.impl} uses instructions that exist only up to "
            f"{format_arch(impl.max_arch)}; set max_arch to at most {format_arch(impl.max_arch)}"
        )
    if impl.reads_prepared_weights and variant.layout is None:
        problems.append(f"{where}.layout: {variant.op}/{impl.impl} reads prepared weights; declare their layout")
    if not impl.reads_prepared_weights and variant.layout is not None:
        problems.append(f"{where}.layout: {variant.op}/{impl.impl} reads checkpoint tensors and takes no layout")
    return problems


def tile_problems(variant: Variant, tile: Tile, scheme, where: str = "tile") -> list[str]:
    """What stops `tile` from serving `variant` for `scheme`, as validation words it: knobs the
    implementation does not honour, block sizes it cannot take, shared memory over any arch of
    the variant's range. Empty when the tile fits. `where` prefixes each problem."""
    impl = find_impl(variant.op, variant.impl_of(tile))
    if impl is None or impl.family != scheme.kind:
        return [f"{where}: {variant.op}/{variant.impl_of(tile)} is not an implementation for {scheme.kind} schemes"]
    return _tile_problems(where, variant, impl, scheme, tile)


def _tile_problems(tile_where: str, variant: Variant, impl: KernelImpl, scheme, tile: Tile) -> list[str]:
    problems = []
    for knob in sorted(tile.model_fields_set - BASE_KNOBS - impl.tile_knobs - {"options", "impl"}):
        problems.append(f"{tile_where}.{knob}: {variant.op}/{impl.impl} does not implement this knob")
    try:
        options = impl.resolve(tile)
    except ValidationError as error:
        return problems + [_option_problem(tile_where, variant, impl, e) for e in error.errors()]
    if "block_k" in impl.tile_knobs and isinstance(scheme, BlockFP8):
        group = scheme.quant_group_k
        if group % tile.block_k:
            problems.append(
                f"{tile_where}.block_k: {tile.block_k} does not divide the quantization group along K ({group})"
            )
    if tile.block_m < impl.min_block_m:
        problems.append(f"{tile_where}.block_m: {tile.block_m} is below the {impl.min_block_m} rows of one MMA; "
                        f"{variant.op}/{impl.impl} takes {impl.min_block_m} or more")
    if hasattr(scheme, "pack_factor") and "block_k" in impl.tile_knobs and tile.block_k < scheme.pack_factor:
        problems.append(f"{tile_where}.block_k: {tile.block_k} is smaller than one packed int32 ({scheme.pack_factor} rows)")
    problems.extend(impl.problems(tile_where, scheme, variant, tile, options))
    need = impl.shared_bytes(scheme, tile, options)
    for facts in archs_in_range(variant.min_cc, variant.max_cc):
        if need > facts.max_shared_bytes:
            problems.append(
                f"{tile_where}: needs about {need // 1024} KB of shared memory, over the "
                f"{facts.max_shared_bytes // 1024} KB of {format_arch(facts.cc)} (in this variant's arch range); "
                "lower num_stages or the block sizes, or narrow the range"
            )
            break
    return problems


def _option_problem(tile_where: str, variant: Variant, impl: KernelImpl, error: dict) -> str:
    """One error of the implementation's Options model, naming the option and what the implementation takes."""
    name = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        known = ", ".join(impl.options.model_fields) or "none"
        return (f"{tile_where}.options.{name}: {variant.op}/{impl.impl} has no option {name!r} "
                f"(its options: {known})")
    return f"{tile_where}.options.{name}: {error['msg']} (got {error.get('input')!r})"


class DefinitionError(Exception):
    """A definition file is unreadable or invalid. str() names the file, the field path and the reason."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = str(path)
        self.problems = problems
        super().__init__("\n".join(f"{self.path}: {p}" for p in problems))


@dataclass(frozen=True)
class LoadedDefinition:
    path: Path  # as given (relative paths stay relative so headers are machine-independent)
    source_text: str
    definition: KernelDefinition


def load_definition(path: Path) -> LoadedDefinition:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DefinitionError(path, [f"cannot read: {error.strerror or error}"]) from None
    return parse_definition(path, text)


def parse_definition(path: Path, text: str) -> LoadedDefinition:
    """Validate `text` as the definition file `path` (which need not hold it yet): errors name `path`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise DefinitionError(path, [f"TOML syntax: {error}"]) from None
    try:
        definition = KernelDefinition.model_validate(data)
    except ValidationError as error:
        # A cross-field check reports several problems in one message, one per line.
        problems = [line for e in error.errors() for line in _describe(e).splitlines()]
        raise DefinitionError(path, problems) from None
    return LoadedDefinition(path, text, definition)


def _describe(error: dict) -> str:
    path = ""
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("block_fp8", "gptq", "w4a16") and path.endswith("]"):
            continue  # the discriminator's own level adds nothing for a reader
        else:
            path += f".{part}" if path else str(part)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field (a typo, or a field this version of kdsl does not have)"
    return f"{path}: {message}" if path else message


def load_definitions(folder: Path) -> list[LoadedDefinition]:
    """Every *.toml under folder, sorted by name; all errors from all files in one DefinitionError list."""
    if not folder.is_dir():
        raise DefinitionError(folder, ["is not a folder of kernel definitions"])
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise DefinitionError(folder, ["holds no *.toml definition"])
    loaded, errors = [], []
    for path in files:
        try:
            loaded.append(load_definition(path))
        except DefinitionError as error:
            errors.append(error)
    if errors:
        raise DefinitionGroupError(errors)
    return loaded


class DefinitionGroupError(Exception):
    def __init__(self, errors: list[DefinitionError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))
