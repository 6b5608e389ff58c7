"""Quantization schemes: what the numbers in a checkpoint mean.

A scheme says nothing about tiling or architectures; it fixes the constants a
kernel bakes in (block sizes, group size, pack factor, fp8 format). Those that
differ between the schemes a template serves (group size, zero offset) are
constexpr arguments of the kernels (`constexprs`), so one generated module
serves them all; the rest are rendered into the module (`module_scheme`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, Field, PositiveInt, field_validator

from kdsl.naming import (
    awq_scheme_name,
    block_fp8_scheme_name,
    gptq_module_scheme_name,
    gptq_scheme_name,
    is_gptq_group_size,
    w4a16_module_scheme_name,
    w4a16_scheme_name,
)
from kdsl.strict_model import StrictModel


def _list_to_tuple(value: Any) -> Any:
    # TOML and JSON have no tuples; accept a list of the right length.
    return tuple(value) if isinstance(value, list) else value


PositivePair = Annotated[tuple[PositiveInt, PositiveInt], BeforeValidator(_list_to_tuple)]


class BlockFP8(StrictModel):
    """DeepSeek-V3 block FP8: 128x128 weight blocks, per-token activation groups along K."""

    kind: Literal["block_fp8"] = "block_fp8"
    fmt: Literal["e4m3"] = Field("e4m3", description="fp8 format of weights and activations (e5m2: later)")
    weight_block: PositivePair = Field((128, 128), description="(n, k) size of a weight block sharing one scale")
    act_group: PositiveInt = Field(128, description="activation elements along K sharing one per-token scale")
    act_scaling: Literal["dynamic"] = Field("dynamic", description="activation scales are computed per call")
    scale_fmt: Literal["float32"] = Field("float32", description="scale storage (ue8m0: later)")
    out_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="GEMM output dtype")

    @field_validator("weight_block")
    @classmethod
    def _k_block_matches_power_of_two(cls, value: tuple[int, int]) -> tuple[int, int]:
        for side, size in zip("nk", value):
            if size & (size - 1):
                raise ValueError(f"weight_block {side} = {size} is not a power of two")
        return value

    @field_validator("act_group")
    @classmethod
    def _group_power_of_two(cls, value: int) -> int:
        if value & (value - 1) or value < 16:
            raise ValueError(f"act_group = {value} must be a power of two >= 16")
        return value

    @property
    def name(self) -> str:
        n, k = self.weight_block
        return block_fp8_scheme_name(self.fmt, n, k, self.act_group, "f32")

    @property
    def kernel_schemes(self) -> tuple[str, ...]:
        """Scheme names of the generated kernels a model in this scheme runs on."""
        return (self.name,)

    @property
    def module_scheme(self) -> str:
        """The scheme its modules are rendered for: all of it (only one block-FP8 scheme is served)."""
        return self.name

    @property
    def constexprs(self) -> dict[str, int]:
        """Scheme numbers its kernels take as constexpr arguments: none (its modules render them)."""
        return {}

    @property
    def quant_group_k(self) -> int:
        """The K extent every GEMM K-step must stay inside (one scale per step)."""
        return min(self.weight_block[1], self.act_group)


SUPPORTED_GPTQ_BITS = (4,)


def _supported_bits(value: int) -> int:
    if value not in SUPPORTED_GPTQ_BITS:
        raise ValueError(f"bits = {value} is not supported; supported: {list(SUPPORTED_GPTQ_BITS)}")
    return value


def _group_size(value: int) -> int:
    if not is_gptq_group_size(value):
        raise ValueError(f"group_size = {value} must be a power of two >= 16, or -1 for one group over K")
    return value


# group_size -1 (one group over all of K) as the kernels' GROUP_SIZE: every row k // 2**30 is in group 0.
ONE_GROUP_ROWS = 2**30


def group_rows(group_size: int) -> int:
    """The kernels' GROUP_SIZE: rows of K per group."""
    return ONE_GROUP_ROWS if group_size == -1 else group_size


def launch_values(fields: dict) -> dict:
    """The scheme's numbers a launch description may name (kdsl.kernels.expressions), from the scheme as the
    manifest lists it: act_group, block_n, block_k, group_size and group_rows (the kernels' GROUP_SIZE)."""
    values = {}
    if "act_group" in fields:
        values["act_group"] = fields["act_group"]
    if "weight_block" in fields:
        values["block_n"], values["block_k"] = fields["weight_block"]
    if "group_size" in fields:
        values["group_size"] = fields["group_size"]
        values["group_rows"] = group_rows(fields["group_size"])
    return values


IntBits = Annotated[int, AfterValidator(_supported_bits)]
GroupSize = Annotated[int, AfterValidator(_group_size)]


class GPTQ(StrictModel):
    """GPTQ weight-only integer quantization with per-group scales and zeros (W4A16)."""

    kind: Literal["gptq"] = "gptq"
    bits: IntBits = Field(4, description="bits per weight; 4 today")
    group_size: GroupSize = Field(128, description="rows of K sharing a scale/zero; a power of two >= 16, or -1 for all of K")
    sym: bool = Field(True, description="symmetric quantization (qzeros still stored and used)")
    desc_act: bool = Field(False, description="act-order: rows permuted, group of each row in g_idx")
    checkpoint_format: Literal["gptq", "gptq_v2"] = Field(
        "gptq", description="'gptq' stores zero - 1 (as GPTQ checkpoints ship), 'gptq_v2' stores the zero"
    )
    act_dtype: Literal["float16", "bfloat16"] = Field("float16", description="activation and output dtype")

    @property
    def name(self) -> str:
        return gptq_scheme_name(self.bits, self.group_size, self.checkpoint_format)

    @property
    def kernel_schemes(self) -> tuple[str, ...]:
        """Its checkpoint kernels, and the w4a16 ones that gptq_prepare's weights run on."""
        return self.name, w4a16_scheme_name(self.bits, self.group_size)

    @property
    def module_scheme(self) -> str:
        """The scheme its modules are rendered for: the bits; group size and format are constexpr arguments."""
        return gptq_module_scheme_name(self.bits)

    @property
    def constexprs(self) -> dict[str, int]:
        """GROUP_SIZE (group_rows) and ZERO_OFFSET: "gptq" checkpoints store zero - 1, "gptq_v2" the zero."""
        return {"GROUP_SIZE": group_rows(self.group_size),
                "ZERO_OFFSET": 1 if self.checkpoint_format == "gptq" else 0}

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


class W4A16(StrictModel):
    """Int4 weights prepared for the fast W4A16 kernels (kdsl.ops.gptq_prepare / awq_prepare write them).

    Every checkpoint format prepares into the same layout (zeros as real values, K sorted by
    group), so these kernels are keyed by bits and group size alone and serve them all.
    """

    kind: Literal["w4a16"] = "w4a16"
    bits: IntBits = Field(4, description="bits per weight; 4 today")
    group_size: GroupSize = Field(128, description="rows of K sharing a scale/zero; a power of two >= 16, or -1 for all of K")

    @property
    def name(self) -> str:
        return w4a16_scheme_name(self.bits, self.group_size)

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def kernel_schemes(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def module_scheme(self) -> str:
        """The scheme its modules are rendered for: the bits; the group size is a constexpr argument."""
        return w4a16_module_scheme_name(self.bits)

    @property
    def constexprs(self) -> dict[str, int]:
        return {"GROUP_SIZE": group_rows(self.group_size)}


def _awq_group_size(value: int) -> int:
    if value == -1 or not is_gptq_group_size(value):
        raise ValueError(f"group_size = {value} must be a power of two >= 16 (AWQ has no one-group-over-K form)")
    return value


class AWQ(StrictModel):
    """AutoAWQ "gemm" checkpoints: qweight int32 [K, N / 8] packed along N in the column order
    [0, 2, 4, 6, 1, 3, 5, 7], qzeros int32 [G, N / 8] packed the same way, scales [G, N];
    w = (q - zero) * scale with no offset and no act-order. Served by the w4a16 kernels it
    prepares into (kdsl.ops.awq_prepare)."""

    kind: Literal["awq"] = "awq"
    bits: IntBits = Field(4, description="bits per weight; 4 today")
    group_size: Annotated[int, AfterValidator(_awq_group_size)] = Field(128, description="rows of K sharing a scale/zero")
    zero_point: bool = Field(True, description="stored zeros (AutoAWQ's default); False: symmetric, every zero "
                                               "2**(bits-1) (GPTQModel's default AWQ)")
    version: Literal["gemm"] = Field("gemm", description="AutoAWQ packing; 'gemv' packs differently and is not served")

    @property
    def name(self) -> str:
        return awq_scheme_name(self.bits, self.group_size) + ("" if self.zero_point else ".sym")

    @property
    def kernel_schemes(self) -> tuple[str, ...]:
        """AWQ has no kernels of its own: awq_prepare's weights run on the w4a16 ones."""
        return (w4a16_scheme_name(self.bits, self.group_size),)

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


Scheme = Annotated[Union[BlockFP8, GPTQ, W4A16], Field(discriminator="kind")]
