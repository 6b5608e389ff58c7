"""moe_fp8/sorted: a block-FP8 MoE layer (DeepSeek-V3, Qwen3-MoE) with tokens sorted by expert on the device (sm_89+).

One module, six launches, no host sync: a one-program routing kernel sorts the (token, slot) assignments by
expert and pads each expert's run to block_m rows (atomics hand out the rows: no host-side counts); x is
quantized per token (act_quant's rule); the gate-up GEMM reads the sorted rows' tokens straight from the
quantized x (no gathered copy) and, with `fuse_act`, applies silu(gate) * up and the 1x128 quantization in its
epilogue; the down GEMM stores each row at its assignment; a combine kernel sums each token's slots with the
router weights in fp32. Grids are sized on the host for the worst routing (T * k rows plus the padding of
min(T * k, E) experts); programs past the rows a call uses return at once, so one CUDA graph serves any routing.

Tiles are chosen per M bucket where M is tokens per routed expert, ceil(T * k / min(T * k, E))."""
from pydantic import Field

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options as GemmOptions

FUSE_ACT_HELP = ("silu(gate) * up and its 1x128 quantization in the gate-up GEMM's epilogue (block_n = the activation "
                 "group: each program computes 128 gate and the matching 128 up columns); false: the GEMM writes the "
                 "fp32 gate and up products and a second kernel activates and quantizes them, so block_n may be "
                 "narrower (more programs streaming weights at decode)")


class Options(GemmOptions):
    fuse_act: bool = Field(True, description=FUSE_ACT_HELP)


def shared_bytes(scheme, tile, options: Options) -> int:
    # The gate-up GEMM's ring: A's tile and one (unfused) or two (gate and up, fused) B tiles per stage, fp8.
    b_tiles = 2 if options.fuse_act else 1
    return tile.num_stages * (tile.block_m + b_tiles * tile.block_n) * tile.block_k


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    if options.fuse_act and tile.block_n != scheme.act_group:
        return [f"{where}.block_n: fuse_act quantizes h per row over one {scheme.act_group}-wide activation group "
                f"per tile, so it needs block_n = {scheme.act_group} (got {tile.block_n}); or set fuse_act = false"]
    return []


IMPL = KernelImpl(
    "block_fp8", "moe_fp8", "sorted", "block_fp8/moe_fp8_sorted.py.j2", 89, None,
    "tokens sorted by expert on the device, gate-up GEMM (+ silu * up + 1x128 quant), down GEMM, weighted combine",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=shared_bytes, problems=problems, min_block_m=16)
