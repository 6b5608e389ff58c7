"""Render planned kernels through Jinja into module texts and a manifest.

Rendering is pure (planned kernels in, {relative path: text} out); writing is
separate so `generate` can refuse to touch the output folder until everything
rendered, and `--check` can compare without writing.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import meta

from kdsl.codegen.plan import PlannedKernel, PlannedModule
from kdsl.schema.layout import PAIR_SPAN, PLANE_ROWS, PLANE_TILE_K, PLANE_TILE_N

TEMPLATE_DIR = Path(__file__).parent / "templates"  # includes every kernel shares (common/)
KERNELS_DIR = Path(__file__).parents[1] / "kernels"  # each implementation's template, beside its unit
MANIFEST = "manifest.json"
# 2: tiles carry n_min and split_fill; 3: deferred_rescale; 4: overlap_dequant; 5: edge_split_k; 6: edge_tiles;
# 7: split_min_steps; 8: mma_gemv; 9: w4a16_gemm keyed by layout, zero_bias and refusal declared,
# tiles carry only their implementation's options; 10: a variant's tiles name their implementation, one
# module each, and a refusal takes the call's facts; 11: a module is device code, its implementation's unit
# launches it (kdsl.kernels.base.KernelImpl.launch), so modules name no launch or refusal function; 12: one module
# per (op, implementation, arch variant), shared by the schemes of a definition, which pass their numbers as the entry's
# "constexprs"; 13: a module is shared by the definition's variants for several archs that render it alike (same op,
# implementation and layout), named after the lowest arch
MANIFEST_FORMAT = 13


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([KERNELS_DIR, TEMPLATE_DIR]),
        undefined=jinja2.StrictUndefined,  # a misspelt variable is an error, not an empty string
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _template_sources(name: str) -> list[str]:
    """The template and everything it includes or imports, in a stable order."""
    env = _environment()
    seen: dict[str, str] = {}
    pending = [name]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        source = env.loader.get_source(env, current)[0]
        seen[current] = source
        pending.extend(sorted(t for t in meta.find_referenced_templates(env.parse(source)) if t))
    return [seen[key] for key in sorted(seen)]


def module_digest(kernels: list[PlannedKernel], module: PlannedModule) -> str:
    """sha256 of what renders the module: the definitions of the kernels sharing it (their schemes and their
    common variant) and its templates."""
    digest = hashlib.sha256()
    for definition_digest in sorted(k.definition_digest for k in kernels):
        digest.update(definition_digest.encode())
    for source in _template_sources(module.impl.template):
        digest.update(source.encode())
    return digest.hexdigest()[:16]


def tile_params(tile, impl) -> dict:
    """Launch parameters a generated module reads from a tile: the implementation that serves it, the
    common geometry in a fixed key order, then the implementation's options (its Options model's fields,
    defaults filled)."""
    return {
        "impl": impl.impl,
        "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
        "GROUP_M": tile.group_m, "SPLIT_K": tile.split_k,
        "num_warps": tile.num_warps, "num_stages": tile.num_stages,
        **impl.resolve(tile).model_dump(mode="json"),
    }


def render_module(kernel: PlannedKernel, module: PlannedModule, digest: str) -> str:
    """The module as the kernel of one of the schemes it serves renders it (every one renders the same text)."""
    template = _environment().get_template(module.impl.template)
    return template.render(
        kernel=kernel,
        impl=module.impl,
        name=module.name,
        scheme=kernel.scheme,
        schemes=", ".join(module.schemes),
        constexprs=", ".join(kernel.constexprs),
        digest=digest,
        arch_range=module.arch_range,
        layout=kernel.layout,
        layout_dict=None if kernel.layout is None else kernel.layout.model_dump(mode="json"),
        plane_tile_n=PLANE_TILE_N,
        plane_tile_k=PLANE_TILE_K,
        plane_rows=PLANE_ROWS,
        pair_span=PAIR_SPAN,
    )


def manifest_entry(kernel: PlannedKernel, digests: dict[str, str]) -> dict:
    return {
        "name": kernel.name,
        "op": kernel.op,
        "impl": kernel.impl.impl,
        "scheme": kernel.scheme.name,
        "scheme_definition": kernel.scheme.model_dump(mode="json"),
        # The scheme's numbers its modules' kernels take as constexpr arguments (the modules are shared by schemes).
        "constexprs": kernel.constexprs,
        "min_arch": kernel.min_arch,
        "max_arch": kernel.max_arch,
        "tiles": [{"m_max": tile.m_max, "n_min": tile.n_min, **tile_params(tile, impl)}
                  for tile, impl in zip(kernel.tiles, kernel.tile_impls)],
        "layout": None if kernel.layout is None else kernel.layout.model_dump(mode="json"),
        "zero_bias": None if kernel.layout is None else kernel.layout.zero_bias(),
        # Per implementation: its module (the implementation's unit launches it and may refuse a call).
        "modules": [{
            "impl": module.impl.impl,
            "module": f"{module.name}.py",
            "digest": digests[module.name],
        } for module in kernel.modules],
        "source": kernel.source,
        # Only where the variant sets dequant_min_m: from "min_m" rows up the op runs the "op" kernel serving its
        # scheme (same layout), then torch.matmul, instead of its tiles (kdsl.runtime.registry.dequant_for).
        **({} if kernel.dequant is None else {"dequant": kernel.dequant}),
    }


class RenderError(Exception):
    """A module renders differently for two of the schemes sharing it."""


def render_all(kernels: list[PlannedKernel]) -> dict[str, str]:
    """{file name inside generated/: text}, including the manifest. A module shared by several schemes' kernels
    is rendered for each and must come out the same: a number that differs between them belongs in
    scheme.constexprs, not in the template's text."""
    sharing: dict[str, tuple[PlannedModule, list[PlannedKernel]]] = {}
    for kernel in kernels:
        for module in kernel.modules:
            sharing.setdefault(module.name, (module, []))[1].append(kernel)
    digests = {name: module_digest(users, module) for name, (module, users) in sharing.items()}
    files = {}
    for name, (module, users) in sharing.items():
        texts = {kernel.scheme.name: render_module(kernel, module, digests[name]) for kernel in users}
        if len(set(texts.values())) > 1:
            raise RenderError(f"{name} renders differently for schemes {', '.join(texts)}: a number that differs "
                              "between them must be a constexpr argument (the scheme's `constexprs`)")
        files[f"{name}.py"] = next(iter(texts.values()))
    manifest = {
        "format": MANIFEST_FORMAT,
        "generator": "kdsl",
        "note": "generated by kdsl — do not edit; run `python -m kdsl generate`",
        "kernels": [manifest_entry(k, digests) for k in kernels],
    }
    files[MANIFEST] = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    return files
