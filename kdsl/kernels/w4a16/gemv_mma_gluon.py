"""w4a16_gemm/gemv_mma_gluon: W4A16 GEMV for M <= 16 on mma.sync, written in Gluon.

A program takes one m16n8k16's 16 columns against x as its 8-wide operand (options.x_rows = 16: two of them,
rows 0-7 and 8-15, on the same dequantized weights); its warps split K in chunks of block_k rows, with the next
chunk's loads in flight, and sum in shared memory (no split-K round trip).
Reads k_planes words with paired (scale, zero). Refuses, at run time, the CPU (Gluon has no interpreter),
groups that change inside a plane tile, and M > x_rows: the definition's next tile serves those calls.
"""
from typing import Literal

from pydantic import Field, PositiveInt

from kdsl.kernels.base import KernelImpl
from kdsl.kernels.c_abi import EXACT, ImplLaunch
from kdsl.kernels.described import described
from kdsl.kernels.w4a16.common import C_PLANE_UNIFORM, PdlOptions, needs_layout, w4a16_values
from kdsl.packing import PLANE_TILE_K

# x is the MMA's 8-wide operand, once or twice.
MMA_GEMV_MAX_M = 16


class GemvMmaOptions(PdlOptions):
    """PdlOptions, and how many of x's rows a program takes."""

    x_rows: Literal[8, 16] = Field(8, description=(
        "rows of x per program: 8 (one mma.sync per 16 columns and 16 rows of K) or 16 (two, on the same "
        "dequantized weights, for M = 9-16)"))
    k_max: PositiveInt | None = Field(None, description=(
        "the tile refuses K above this (the next tile serving M and N runs): every program reads all of x for its "
        "16 columns, so at 16 rows x's reads from L2 are 4x the weights' bytes, which large layers are bound by"))


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    found = needs_layout(f"{where}.impl", variant, "k_planes", "paired")
    if tile.block_m != 1:
        found.append(f"{where}.block_m: {tile.block_m}; a GEMV tile takes block_m = 1")
    if tile.m_max is None or tile.m_max > options.x_rows:
        wider = "" if options.x_rows == MMA_GEMV_MAX_M else f", or options.x_rows = {MMA_GEMV_MAX_M}"
        found.append(f"{where}.m_max: a program takes options.x_rows = {options.x_rows} rows of x, so the tile serves "
                     f"M up to {options.x_rows}; set m_max <= {options.x_rows}{wider} "
                     f"(got {tile.m_max if tile.m_max is not None else 'none'})")
    if tile.block_n != 16:
        found.append(f"{where}.block_n: a program takes one MMA's 16 columns; needs block_n = 16 (got {tile.block_n})")
    if tile.block_k % PLANE_TILE_K:
        found.append(f"{where}.block_k: {tile.block_k} is not a multiple of {PLANE_TILE_K}; the GEMV's warps "
                     "take chunks of whole plane tiles")
    return found


def refusal(generated, tile, call):
    """Why this GEMV should not serve `call` (a kdsl.runtime Call), None where it should; the definition's
    next tile serving M and N then runs instead."""
    plane_tile_k = generated.module.PLANE_TILE_K.value
    if not call.contiguous_groups or generated.constexprs["GROUP_SIZE"] % plane_tile_k:
        return f"a group changes inside a {plane_tile_k}-row plane tile, which the GEMV scales as one"
    if call.m > tile["x_rows"]:
        return f"M = {call.m}: this tile's GEMV takes at most {tile['x_rows']} rows (options.x_rows)"
    k_max = tile["k_max"]
    if k_max is not None and call.k is not None and call.k > k_max:
        return f"K = {call.k}: this tile's GEMV serves K up to {k_max} (options.k_max)"
    if call.device_type != "cuda":
        return "the mma.sync GEMV is a Gluon kernel, which runs on the GPU only"
    return None


# The Gluon GEMV on mma.sync (M <= x_rows, k_planes with paired scales and zeros): K and CHUNK_TILES are
# constexprs, so one cubin per K the problems reach; the (scale, zero) pairs are read as int32 [G, N] over the
# scales' memory (row stride lds / 2 words). Its module's refusal turns down groups that
# change inside a 128-row plane tile (off the GPU too, which C never is; M > x_rows no tile of it serves) and
# K above options.k_max, and a K with no cubin is refused as well: those calls take the tile after it (the
# Triton GEMV or MMA).
C_LAUNCH = ImplLaunch(
    params=(("x_ptr", "x"), ("perm_ptr", "either(perm, qweight)"), ("w_ptr", "qweight"), ("p_ptr", "scales"),
            ("y_ptr", "y"), ("M", "M"), ("N", "N"), ("stride_xm", "ldx"), ("stride_pg", "div(lds, 2)"),
            ("stride_ym", "ldy")),
    pointer_types={"x_ptr": "dtype:x_dtype", "perm_ptr": "i32", "w_ptr": "i32", "p_ptr": "i32",
                   "y_ptr": "dtype:x_dtype"},
    grid=("cdiv(N, 16)", "1", "1"),
    # num_warps is a parameter of the Gluon kernel as well as the launch option.
    constexprs=lambda tile, scheme: {"CHUNK_TILES": tile["BLOCK_K"] // 128, "X_ROWS": tile["x_rows"], "PDL": False,
                                     "RELEASE": False, "num_warps": tile["num_warps"]},
    options=lambda tile: {"num_warps": tile["num_warps"]},
    kernel="{module}",
    runtime_constexprs=(("K", "K", EXACT), ("HAS_PERM", "nonzero(perm)", (False, True))),
    refuses=f"(1 - {C_PLANE_UNIFORM}) + (K > {{k_max}}) * ({{k_max}} > 0)",
    values=w4a16_values,
    views={"p_ptr": "i32"},
    releases=True,
)


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "gemv_mma_gluon", "w4a16/gemv_mma_gluon.py.j2", 80, None,
    "W4A16 GEMV for M <= 16 on mma.sync (Gluon): 16 columns per program, its warps splitting K",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "n_min"}), options=GemvMmaOptions, problems=problems,
    # Tune's GEMV candidates keep the current tile's x_rows.
    reads_prepared_weights=True, gemv_block_m=True, gemv_max_m=MMA_GEMV_MAX_M, launch=described(C_LAUNCH),
    refusal=refusal)
