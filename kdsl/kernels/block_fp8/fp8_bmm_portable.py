"""fp8_bmm/portable: the batched block-FP8 GEMM (DeepSeek-V3's MLA) with strided pointer loads (sm_89+).

Grid axis 2 walks the batch; every operand comes with its strides, so a batch of `x.transpose(0, 1)`
views (MLA's per-head activations) runs without a copy. Tiles and options as fp8_gemm/portable."""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.block_fp8.fp8_gemm_portable import (Options, operand_ring_bytes, portable_options,
                                                     portable_tile_constexprs)
from kdsl.kernels.described import described
from kdsl.kernels.expressions import dtype_code


def bmm_values(a, a_s, b, b_s, c) -> dict:
    """fp8_bmm's C arguments: a [B, M, K] fp8, a_s [B, M, K // ACT_GROUP], b [B, N, K] fp8,
    b_s [B, cdiv(N, W_BLOCK_N), K // W_BLOCK_K], c [B, M, N]: any strides, passed as they are (no copies). Unit
    stride along K for a and b, and along N for c, is the caller's to guarantee; B, M >= 1."""
    B, M, K = a.shape
    return {"a": a, "stride_ab": a.stride(0), "stride_am": a.stride(1),
            "a_s": a_s, "stride_asb": a_s.stride(0), "stride_asm": a_s.stride(1), "stride_ask": a_s.stride(2),
            "b": b, "stride_bb": b.stride(0), "stride_bn": b.stride(1),
            "b_s": b_s, "stride_bsb": b_s.stride(0), "stride_bsn": b_s.stride(1), "stride_bsk": b_s.stride(2),
            "c": c, "stride_cb": c.stride(0), "stride_cm": c.stride(1), "out_dtype": dtype_code(c.dtype),
            "B": B, "M": M, "N": b.shape[1], "K": K}


C_LAUNCH = ImplLaunch(
    params=(("a_ptr", "a"), ("b_ptr", "b"), ("c_ptr", "c"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("M", "M"), ("N", "N"), ("K", "K"), ("stride_ab", "stride_ab"), ("stride_am", "stride_am"),
            ("stride_bb", "stride_bb"), ("stride_bn", "stride_bn"), ("stride_cb", "stride_cb"),
            ("stride_cm", "stride_cm"), ("stride_asb", "stride_asb"), ("stride_asm", "stride_asm"),
            ("stride_ask", "stride_ask"), ("stride_bsb", "stride_bsb"), ("stride_bsn", "stride_bsn"),
            ("stride_bsk", "stride_bsk")),
    pointer_types={"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype",
                   "as_ptr": "fp32", "bs_ptr": "fp32"},
    grid=("cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})", "1", "B"),
    constexprs=portable_tile_constexprs,
    options=portable_options,
    values=bmm_values,
)


IMPL = KernelImpl(
    "block_fp8", "fp8_bmm", "portable", "block_fp8/fp8_bmm_portable.py.j2", 89, None,
    "batched, strided pointer loads, fp32 accumulation with per-step scales",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=operand_ring_bytes, min_block_m=16,
    launch=described(C_LAUNCH))
