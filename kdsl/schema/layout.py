"""Weight layouts that a preparation step writes once and a generated kernel reads.

A variant that reads prepared weights declares its layout in the definition; the
template renders for it and `kdsl.ops.gptq_prepare` writes it, both from the same
model, so an arch that wants another layout declares another one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kdsl.packing import PAIR_SPAN, PLANE_ROWS, PLANE_TILE_K, PLANE_TILE_N, ZERO_BIAS  # noqa: F401
from kdsl.strict_model import StrictModel


class GPTQLayout(StrictModel):
    """GPTQ INT4 weights as the prepared W4A16 kernel reads them.

    Always: act-order is resolved once (K sorted by group, the permutation applied to x's
    columns inside the kernel), and scales are in the activation dtype.
    """

    zeros: Literal["biased", "packed", "paired"] = Field(
        "biased",
        description=(
            "biased: zeros unpacked to [G, N] in the activation dtype with the format's offset and "
            "the dequant's magic bias folded in (one subtract in the inner loop); "
            "packed: qzeros as the checkpoint packs them (4 bits each, unpacked per tile); "
            "paired: biased zeros interleaved with the scales, one 32-bit (scale, zero) pair per group "
            "and column, so a tile's scales and zeros are one load of 4 bytes per column, which "
            "Triton pipelines (it leaves loads of under 4 bytes per thread synchronous); k_planes only"
        ),
    )

    weights: Literal["checkpoint", "k_planes"] = Field(
        "checkpoint",
        description=(
            "checkpoint: int32 [K / 8, N], eight consecutive K rows per word, as GPTQ ships them; "
            "k_planes: tiles of PLANE_TILE_N columns x PLANE_TILE_K rows, each PLANE_TILE_N * 16 "
            "contiguous words [column, kk] whose nibbles p and p + 4 (p < 4) are rows 32 p + 2 kk "
            "and the next of the tile, so the half2 LOP3 makes of them is a pair of adjacent K in "
            "the MMA operand, and the tile dequantizes element-wise straight into the MMA's "
            "registers (no shared-memory round trip); K and N padded to whole tiles"
        ),
    )

    @model_validator(mode="after")
    def _planes_want_biased_zeros(self) -> "GPTQLayout":
        if self.weights == "k_planes" and self.zeros == "packed":
            raise ValueError('weights = "k_planes" dequantizes element-wise and takes zeros = "biased" or "paired"')
        if self.zeros == "paired" and self.weights != "k_planes":
            raise ValueError('zeros = "paired" is read only by the weights = "k_planes" kernel')
        return self

    def zero_bias(self) -> dict[str, int] | None:
        """What preparation adds to each zero, per activation dtype (None: zeros stay packed)."""
        return None if self.zeros == "packed" else dict(ZERO_BIAS)

    def key(self) -> str:
        """Readable identity, stamped on prepared weights and checked at launch."""
        return f"zeros={self.zeros},weights={self.weights}"
