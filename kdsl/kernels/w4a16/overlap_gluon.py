"""w4a16_gemm/overlap_gluon: W4A16 GEMM for Hopper in Gluon, dequant of K block k+1 overlapping block k's wgmma.

TMA brings each block's k_planes words, x and (scale, zero) pairs into an mbarrier ring of num_stages
slots; one warpgroup per 64 columns. Refuses, at run time, the CPU, act-order (x gathered), groups that
change inside a K block and rows TMA cannot read: the definition's next tile (the Triton MMA with the same
block sizes) serves those calls.
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, warpgroup_per_64
from kdsl.kernels.c_abi import SPLIT, ImplLaunch, TmaDescriptor
from kdsl.kernels.described import described
from kdsl.kernels.gptq.checkpoint import w4a16_operand_bytes
from kdsl.kernels.w4a16.common import (C_SPLIT_FOR, C_TILES, SplitPdlOptions, needs_layout, plane_tile_problems,
                                     w4a16_values)


def problems(where: str, scheme, variant, tile, options: SplitPdlOptions) -> list[str]:
    found = needs_layout(f"{where}.impl", variant, "k_planes", "paired") + plane_tile_problems(where, tile)
    found += warpgroup_per_64(f"{where}.impl", "columns", "block_n", tile.block_n, tile.num_warps)
    if not 16 <= tile.block_m <= 256:
        found.append(f"{where}.block_m: {tile.block_m} is not one wgmma's width (16 to 256)")
    return found


def refusal(generated, tile, call):
    """Why this kernel should not serve `call` (a kdsl.runtime Call), None where it should; the definition's
    next tile serving M and N (the Triton MMA with the same block sizes) then runs instead."""
    if call.device_type != "cuda":
        return "a Gluon kernel, which runs on the GPU only"
    if call.act_order:
        return "act-order gathers x's columns, which the kernel's TMA loads of x cannot"
    if not call.contiguous_groups or generated.constexprs["GROUP_SIZE"] % tile["BLOCK_K"]:
        return f"a group changes inside a {tile['BLOCK_K']}-row K block, which the kernel scales as one"
    if call.align < 16:
        return "TMA reads rows that start 16-byte aligned, and x's or the (scale, zero) pairs' do not"
    return None


# The Gluon wgmma GEMM (sm_90, k_planes): x, the plane words (qweight as [rows, 16]) and the (scale, zero)
# pairs (int32 [G, N] over the scales, row stride lds / 2) come by TMA through Gluon host descriptors, whose
# NVMMA shared layout is the default for the block (the compiled kernel's tensordesc_meta gives the swizzle and
# box as for Triton's). Its module's refusal: act-order, a group
# changing inside a K block, and kdsl.ops' alignment of x and scales below 16 bytes; those calls take the
# Triton MMA tile after it.
C_LAUNCH = ImplLaunch(
    params=(("x_desc", "desc"), ("w_desc", "desc"), ("p_desc", "desc"), ("y_ptr", "y"), ("ws_ptr", "y"),
            ("count_ptr", "y"), ("M", "M"), ("N", "N"), ("K", "K"), ("stride_ym", "ldy")),
    pointer_types={"y_ptr": "dtype:x_dtype", "ws_ptr": "scratch:fp32:x_dtype",
                   "count_ptr": "scratch:i32:x_dtype"},
    descriptors={
        "x_desc": TmaDescriptor("x", "dtype:x_dtype", ("M", "K"), ("ldx", "1"), ("{BLOCK_M}", "{BLOCK_K}")),
        "w_desc": TmaDescriptor("qweight", "i32", ("cdiv(N, 128) * cdiv(K, 128) * 128", "16"), ("16", "1"),
                                ("{BLOCK_N}", "16")),
        "p_desc": TmaDescriptor("scales", "i32", ("cdiv(K, {group_rows})", "N"), ("div(lds, 2)", "1"),
                                ("1", "{BLOCK_N}")),
    },
    grid=(C_TILES, "split", "1"),
    constexprs=lambda tile, scheme: {"GROUP_M": tile["GROUP_M"], "NUM_STAGES": tile["num_stages"],
                                     "num_warps": tile["num_warps"], "PDL": False,
                                     "RELEASE": False},
    options=lambda tile: {"num_warps": tile["num_warps"]},
    kernel="{module}",
    runtime_constexprs=(("SPLIT_K", C_SPLIT_FOR, SPLIT),),
    scratch=("ws_ptr", "count_ptr", f"{C_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", C_TILES),
    scratch_alias="y",
    # The last three: Gluon's host descriptors also need qweight 16-byte aligned and every row stride a
    # multiple of 16 bytes, even of a single row (Python's descriptors would fail on them; C takes the alternative).
    refuses=("nonzero(perm) + (1 - contiguous_groups * ({group_rows} % {BLOCK_K} == 0))"
             " + nonzero(addr(x) % 16) + nonzero(addr(scales) % 16)"
             " + bad_tma_stride(M, ldx, dtype_size(x_dtype)) + bad_tma_stride(cdiv(K, {group_rows}), lds, 2)"
             " + nonzero(addr(qweight) % 16) + nonzero(ldx * dtype_size(x_dtype) % 16) + nonzero(lds * 2 % 16)"),
    # The TMA loads of x cannot follow a permutation: never a silently unpermuted product.
    raises=(("nonzero(perm)", "perm: w4a16_gemm/overlap_gluon takes no act-order permutation; gather x's columns "
                              "first (gather_columns) or take a tile that does not refuse act-order calls"),),
    values=w4a16_values,
    releases=True,
)


IMPL = KernelImpl(
    "w4a16", "w4a16_gemm", "overlap_gluon", "w4a16/overlap_gluon.py.j2", 90, 90,
    "W4A16 GEMM for Hopper (Gluon): TMA ring, block k+1 dequantized while block k's wgmma runs",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=SplitPdlOptions, shared_bytes=w4a16_operand_bytes,
    problems=problems, reads_prepared_weights=True, min_block_m=16, launch=described(C_LAUNCH),
    refusal=refusal)
