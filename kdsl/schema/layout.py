"""Weight layouts that a preparation step writes once and a generated kernel reads.

A variant that reads prepared weights declares its layout in the definition; the
template renders for it and `kdsl.ops.gptq_prepare` writes it, both from the same
model, so an arch that wants another layout declares another one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

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

    def key(self) -> str:
        """Readable identity, stamped on prepared weights and checked at launch."""
        return f"zeros={self.zeros}"
