"""Weight layouts that a preparation step writes once and a generated kernel reads.

A variant that reads prepared weights declares its layout in the definition; the
template renders for it and `kdsl.ops.gptq_prepare` writes it, both from the same
model, so an arch that wants another layout declares another one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kdsl.schema._base import StrictModel


class GPTQLayout(StrictModel):
    """GPTQ INT4 weights as the prepared W4A16 kernel reads them.

    Always: act-order is resolved once (K sorted by group, the permutation applied to x's
    columns inside the kernel), and scales are in the activation dtype.
    """

    zeros: Literal["biased", "packed"] = Field(
        "biased",
        description=(
            "biased: zeros unpacked to [G, N] in the activation dtype with the format's offset and "
            "the dequant's magic bias folded in (one subtract in the inner loop); "
            "packed: qzeros as the checkpoint packs them (4 bits each, unpacked per tile)"
        ),
    )

    weights: Literal["checkpoint", "k_planes"] = Field(
        "checkpoint",
        description=(
            "checkpoint: int32 [K / 8, N], eight consecutive K rows per word, as GPTQ ships them; "
            "k_planes: tiles of PLANE_TILE_N columns x PLANE_TILE_K rows, each PLANE_TILE_N * 16 "
            "contiguous words [column, kk] whose nibble j is row 16 j + kk of the tile, so nibble "
            "plane j of a tile is a [columns, 16] operand that dequantizes element-wise straight "
            "into the MMA's registers (no shared-memory round trip); K and N padded to whole tiles"
        ),
    )

    @model_validator(mode="after")
    def _planes_want_biased_zeros(self) -> "GPTQLayout":
        if self.weights == "k_planes" and self.zeros != "biased":
            raise ValueError('weights = "k_planes" dequantizes each plane element-wise and takes zeros = "biased"')
        return self

    def key(self) -> str:
        """Readable identity, stamped on prepared weights and checked at launch."""
        return f"zeros={self.zeros},weights={self.weights}"


# Tile of the "k_planes" weights: 128 columns by 8 planes of 16 rows.
PLANE_TILE_N = 128
PLANE_TILE_K = 128
