"""Canonical names shared by the definition models and the runtime.

This module imports nothing from kdsl: the schema uses it to name what it
validates, the registry and ops use it to name what they look up, and both
must agree byte for byte without the runtime importing Pydantic models.
"""
from __future__ import annotations

import re

KNOWN_ARCHS = (80, 86, 89, 90, 100, 120)
_ARCH_RE = re.compile(r"^sm_(\d{2,3})$")


def parse_arch(text: str) -> int:
    """'sm_90' -> 90. Raises ValueError for anything else."""
    match = _ARCH_RE.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"arch must look like 'sm_90', got {text!r}")
    return int(match.group(1))


def format_arch(cc: int) -> str:
    return f"sm_{cc}"


def block_fp8_scheme_name(fmt: str, block_n: int, block_k: int, act_group: int, scale_fmt: str) -> str:
    """The part of a block-FP8 scheme that specializes kernels, e.g. 'block_fp8.e4m3.w128x128.a128.f32'."""
    return f"block_fp8.{fmt}.w{block_n}x{block_k}.a{act_group}.{scale_fmt}"


def gptq_scheme_name(bits: int, group_size: int, checkpoint_format: str) -> str:
    """The part of a GPTQ scheme that specializes kernels, e.g. 'gptq.int4.g128.gptq'.

    sym, desc_act and the activation dtype are not in it: the kernels always
    read qzeros, take g_idx as an argument, and follow the activation's dtype.
    """
    group = "gall" if group_size == -1 else f"g{group_size}"
    return f"gptq.int{bits}.{group}.{checkpoint_format}"


def gptq_module_scheme_name(bits: int) -> str:
    """The part of a GPTQ scheme its generated modules are rendered for, e.g. 'gptq.int4': group size and
    checkpoint format are constexpr arguments of the kernels, so one module serves every GPTQ scheme of its bits."""
    return f"gptq.int{bits}"


def w4a16_module_scheme_name(bits: int) -> str:
    """The part of a W4A16 scheme its generated modules are rendered for, e.g. 'w4a16.int4' (the group size is a
    constexpr argument)."""
    return f"w4a16.int{bits}"


def w4a16_scheme_name(bits: int, group_size: int) -> str:
    """Prepared W4A16 weights, whatever checkpoint they came from (GPTQ v1/v2, AWQ), e.g. 'w4a16.int4.g128'.

    Preparation folds each format's zero convention and packing into one layout, so the
    kernels that read it are keyed by bits and group size only.
    """
    group = "gall" if group_size == -1 else f"g{group_size}"
    return f"w4a16.int{bits}.{group}"


def awq_scheme_name(bits: int, group_size: int) -> str:
    """An AutoAWQ "gemm" checkpoint, e.g. 'awq.int4.g128'; its kernels are the w4a16 ones it prepares into."""
    return f"awq.int{bits}.g{group_size}"


def kernel_name(op: str, scheme_name: str, variant: str, min_arch: int) -> str:
    """CUTLASS-style procedural name: op, scheme, variant and the lowest arch it runs on."""
    scheme_part = scheme_name.split(".", 1)[1].replace(".", "_")
    return f"{op}__{scheme_part}__{variant}_sm{min_arch}"


def is_gptq_group_size(value) -> bool:
    """A power of two >= 16, or -1 for one group over all of K."""
    return isinstance(value, int) and not isinstance(value, bool) and (
        value == -1 or (value >= 16 and not value & (value - 1))
    )
