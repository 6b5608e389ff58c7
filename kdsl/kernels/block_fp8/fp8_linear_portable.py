"""fp8_linear/portable: act_quant fused into fp8_gemm's tile (sm_89+). One launch, one output: each K step loads
an activation group of x (bf16/fp16/fp32) per row, quantizes it to e4m3 in registers with act_quant's own code
(common/act_group_quant.py.j2), and feeds the codes and scales to the fp8 MMA as fp8_gemm/portable's tile does;
K may be split across programs (common/splitk_store.py.j2, deterministic) so few rows still stream B from
every SM."""
from typing import Literal

from pydantic import Field, PositiveInt

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.block_fp8.fp8_gemm_portable import TILE_ORDER_HELP
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP, SPLIT_MIN_STEPS_HELP
from kdsl.kernels import host
from kdsl.kernels.host import INTERPRETING, cdiv, split_with_scratch
from kdsl.strict_model import StrictModel


class Options(StrictModel):
    tile_order: Literal["m_major", "n_major"] = Field("m_major", description=TILE_ORDER_HELP)
    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


def shared_bytes(scheme, tile, options: Options) -> int:
    # B's fp8 ring and x's tile in its input dtype (up to 4 bytes) per stage.
    return tile.num_stages * (4 * tile.block_m + tile.block_n) * tile.block_k


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    if tile.block_k != scheme.act_group:
        # A K step quantizes whole activation groups and scales the step's product by one scale per row.
        return [f"{where}.block_k: needs block_k = {scheme.act_group}, one activation group per K step, "
                f"which the kernel quantizes (got {tile.block_k})"]
    return []


def launch(generated, x, b, b_s, bias, c, tile):
    """x [M, K] bf16/fp16/fp32 (unit stride along K, K % ACT_GROUP == 0), b [N, K] fp8, b_s [cdiv(N, W_BLOCK_N),
    K // W_BLOCK_K], bias [N] or None, c [M, N] (unit stride along N). M >= 1."""
    M, K = x.shape
    N = b.shape[0]
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    tiles = cdiv(M, bm) * cdiv(N, bn)
    kernel = generated.kernel
    sms = None if INTERPRETING else host.sm_count(x.device)
    split_k, workspace, counters = split_with_scratch(kernel, c, tile, K // generated.module.ACT_GROUP.value, tiles,
                                                      sms, bm * bn)
    return Launch(kernel, (tiles * split_k, 1, 1), (
        x, b, c, b_s, c if bias is None else bias, workspace, counters,
        M, N, K, x.stride(0), b.stride(0), c.stride(0), b_s.stride(0),
    ), dict(
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=tile["GROUP_M"], N_MAJOR=tile["tile_order"] == "n_major",
        SPLIT_K=split_k, HAS_BIAS=bias is not None, ROUND_FIRST=x.device.type == "cpu",
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    ))


IMPL = KernelImpl(
    "block_fp8", "fp8_linear", "portable", "block_fp8/fp8_linear_portable.py.j2", 89, None,
    "act_quant in registers inside fp8_gemm's pointer-load tile, optional deterministic split-K, bias",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=Options, shared_bytes=shared_bytes, problems=problems,
    min_block_m=16, launch=launch)
