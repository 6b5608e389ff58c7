"""What the W4A16 implementations share: the split-K options and the prepared layouts they read."""
from pydantic import Field, PositiveInt

from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP, SPLIT_MIN_STEPS_HELP
from kdsl.packing import PLANE_TILE_K, PLANE_TILE_N
from kdsl.schema._base import StrictModel


class SplitOptions(StrictModel):
    """How a tile's split_k (an upper bound) becomes the split it launches with (split_for in
    common/sm_fill.py.j2)."""

    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


def weights_layout(variant) -> str | None:
    return getattr(variant.layout, "weights", None)


def needs_layout(at: str, variant, weights: str, zeros: str | None = None) -> list[str]:
    """The variant's prepared layout must be `weights` (and `zeros`, where given) for this implementation."""
    have = (weights_layout(variant), getattr(variant.layout, "zeros", None))
    if have[0] == weights and (zeros is None or have[1] == zeros):
        return []
    want = f'weights = "{weights}"' + (f', zeros = "{zeros}"' if zeros else "")
    return [f"{at}: reads the layout {{ {want} }}; the variant declares {{ weights = \"{have[0]}\", "
            f"zeros = \"{have[1]}\" }}"]


def plane_tile_problems(where: str, tile) -> list[str]:
    """k_planes MMA tiles step one plane tile of K at a time over whole plane tiles of N."""
    found = []
    if tile.block_k != PLANE_TILE_K:
        found.append(f"{where}.block_k: {tile.block_k}; the k_planes layout's tiles take block_k = {PLANE_TILE_K}")
    if PLANE_TILE_N % tile.block_n:
        found.append(f"{where}.block_n: {tile.block_n} does not divide the k_planes layout's "
                     f"{PLANE_TILE_N} columns per tile")
    return found
