"""fp8_gemm/portable: pointer loads, grouped tile order, fp32 accumulation with per-step scales (sm_89+)."""
from typing import Literal

from pydantic import Field

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.described import described
from kdsl.kernels.expressions import dtype_code
from kdsl.strict_model import StrictModel

TILE_ORDER_HELP = "m_major walks down M inside a group (reuses B); n_major walks along N (reuses A)"


class Options(StrictModel):
    tile_order: Literal["m_major", "n_major"] = Field("m_major", description=TILE_ORDER_HELP)


def operand_ring_bytes(scheme, tile, options) -> int:
    # fp8 operands are one byte; a ring of num_stages (A, B) tile pairs.
    return tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k


def one_scale_per_k_block(where: str, scheme, tile) -> list[str]:
    """The rules of kernels that scale each K block of a tile by one activation scale per row and one weight
    scale: block_k is the scale group, and block_n lies inside one weight block."""
    found = []
    if tile.block_k != scheme.quant_group_k:
        found.append(f"{where}.block_k: needs {scheme.quant_group_k}, one scale group per K block "
                     f"(got {tile.block_k})")
    if scheme.weight_block[0] % tile.block_n:
        found.append(f"{where}.block_n: needs to divide the weight block's {scheme.weight_block[0]} rows, so one "
                     f"weight scale serves the tile per K block (got {tile.block_n})")
    return found


def portable_tile_constexprs(tile: dict, scheme: dict | None = None) -> dict:
    """The portable block-FP8 GEMMs' constexprs (fp8_gemm, fp8_bmm, fp8_grouped_gemm[_masked]): the tile's."""
    return {"BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
            "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major"}


def portable_options(tile: dict) -> dict:
    """Their launch options."""
    return {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]}


def gemm_values(a, a_s, b, b_s, c) -> dict:
    """fp8_gemm's C arguments: a [M, K] fp8, a_s [M, K // ACT_GROUP], b [N, K] fp8,
    b_s [cdiv(N, W_BLOCK_N), K // W_BLOCK_K], c [M, N]. Unit stride along K (and N for c) is the caller's to
    guarantee; M >= 1."""
    M, K = a.shape
    return {"a": a, "lda": a.stride(0), "a_s": a_s, "lda_s": a_s.stride(0), "b": b, "ldb": b.stride(0),
            "b_s": b_s, "ldb_s": b_s.stride(0), "c": c, "ldc": c.stride(0), "out_dtype": dtype_code(c.dtype),
            "M": M, "N": b.shape[0], "K": K}


C_LAUNCH = ImplLaunch(
    params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("M", "M"), ("N", "N"), ("K", "K"), ("stride_am", "lda"), ("stride_bn", "ldb"),
            ("stride_cm", "ldc"), ("stride_asm", "lda_s"), ("stride_bsn", "ldb_s")),
    pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                   "as_ptr": "fp32", "bs_ptr": "fp32"},
    grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "1"),
    constexprs=portable_tile_constexprs,
    options=portable_options,
    values=gemm_values,
)


IMPL = KernelImpl(
    "block_fp8", "fp8_gemm", "portable", "block_fp8/fp8_gemm_portable.py.j2", 89, None,
    "pointer loads, grouped tile order, fp32 accumulation with per-step scales",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16,
    launch=described(C_LAUNCH))
