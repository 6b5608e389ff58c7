"""One benchmark case: an op at one problem shape (torch-free, so the report can be built and tested anywhere).

What each op's cases run, and which dims they have, is the op's case module's business (kdsl/bench/cases/<op>.py).
"""
from __future__ import annotations

from dataclasses import dataclass

GROUP = 128  # block-FP8 group / block edge and the GPTQ group size used by the bench
GROUP_MULTIPLE = (GROUP, f"the group size {GROUP}")  # a case module's MULTIPLES entry for a dim split in groups
# Every dim a case may have, in the order labels and the JSON "shape" show them (each op's DIMS keep this order).
DIM_ORDER = ("experts", "topk", "batch", "m", "n", "k", "hidden", "inter")


@dataclass(frozen=True)
class Case:
    """One op at one problem shape; dims an op does not have are None."""

    op: str
    m: int | None = None
    n: int | None = None
    k: int | None = None
    batch: int | None = None
    experts: int | None = None  # the MoE ops: experts per layer, experts per token, hidden and intermediate sizes
    topk: int | None = None
    hidden: int | None = None
    inter: int | None = None

    def dims(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIM_ORDER if getattr(self, d) is not None}

    def label(self) -> str:
        return " ".join(f"{d.upper()}={v}" for d, v in self.dims().items())
