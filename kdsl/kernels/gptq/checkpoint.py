"""GPTQ kernels on checkpoint tensors: the split-K GEMM and the dequantizer."""
import torch

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.described import described
from kdsl.kernels.expressions import dtype_code
from kdsl.kernels.host import cdiv


def w4a16_operand_bytes(scheme, tile, options) -> int:
    if tile.block_m == 1:
        return 0  # the GEMV keeps its weights in registers and stages nothing through shared memory
    # fp16 activations (2 bytes) and packed int4 weights (half a byte) per stage.
    return tile.num_stages * (tile.block_m * tile.block_k * 2 + tile.block_k * tile.block_n // 2)


def launch_gemm(generated, x, qweight, qzeros, scales, g_idx, y, tile):
    """x [M, K], qweight int32 [K / PACK, N], qzeros int32 [G, N / PACK], scales [G, N], g_idx int32 [K] or None.

    y [M, N] in x's dtype. Split-K accumulates in an fp32 buffer and casts once at the end.
    Repacked (prepared) weights would enter here: this launcher is the only place that knows
    the checkpoint layout besides _dequant_tile.
    """
    M, K = x.shape
    N = qweight.shape[1]
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    split_k = max(1, min(tile["SPLIT_K"], cdiv(K, bk)))
    out = y if split_k == 1 else torch.zeros((M, N), dtype=torch.float32, device=y.device)
    grid = (cdiv(M, bm) * cdiv(N, bn), split_k, 1)
    gemm = Launch(generated.kernel, grid, (
        x, qweight, qzeros, scales, qweight if g_idx is None else g_idx, out,
        M, N, K, x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
    ), dict(
        HAS_G_IDX=g_idx is not None, UNIFORM_GROUP=g_idx is None and generated.constexprs["GROUP_SIZE"] % bk == 0,
        **generated.constexprs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tile["GROUP_M"], SPLIT_K=split_k,
        UPCAST_DOT=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    ))
    return gemm if out is y else _then_copy(gemm, out, y)


def _then_copy(launch: Launch, out, y):
    """The split-K launch into the fp32 buffer out, then y = out in y's dtype."""
    yield launch
    y.copy_(out)


def dequant_values(qweight, qzeros, scales, g_idx, w) -> dict:
    """gptq_dequant's C arguments: qweight int32 [K / PACK, N], qzeros int32 [G, N / PACK], scales [G, N],
    g_idx [K] or None; w [N, K]."""
    N, K = w.shape
    return {"qweight": qweight, "ldqw": qweight.stride(0), "qzeros": qzeros, "ldqz": qzeros.stride(0),
            "scales": scales, "lds": scales.stride(0), "scales_dtype": dtype_code(scales.dtype), "g_idx": g_idx,
            "w": w, "N": N, "K": K}


GEMM_SPLITK = KernelImpl(
    "gptq", "gptq_gemm", "splitk", "gptq/gptq_gemm.py.j2", 80, None,
    "W4A16: unpack int4 in registers, fp16/bf16 tensor-core dot, optional split-K with atomics",
    tile_knobs=GEMM_KNOBS | {"split_k"}, shared_bytes=w4a16_operand_bytes, min_block_m=16,
    launch=launch_gemm)


DEQUANT_C_LAUNCH = ImplLaunch(
    params=(("qw_ptr", "qweight"), ("qz_ptr", "qzeros"), ("s_ptr", "scales"), ("g_ptr", "either(g_idx, qweight)"),
            ("w_ptr", "w"), ("N", "N"), ("K", "K"), ("stride_qwk", "ldqw"), ("stride_qzg", "ldqz"),
            ("stride_sg", "lds")),
    pointer_types={"qw_ptr": "i32", "qz_ptr": "i32", "s_ptr": "dtype:scales_dtype", "g_ptr": "i32",
                   "w_ptr": "dtype:scales_dtype"},
    grid=("cdiv(K, {BLOCK_K})", "cdiv(N, {BLOCK_N})", "1"),
    constexprs=lambda tile, scheme: {"BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"]},
    options=lambda tile: {"num_warps": tile["num_warps"]},
    runtime_constexprs=(
        ("HAS_G_IDX", "nonzero(g_idx)", (False, True)),
        ("UNIFORM_GROUP", "(1 - nonzero(g_idx)) * ({group_rows} % {BLOCK_K} == 0)", (False, True)),
    ),
    values=dequant_values,
)


DEQUANT_BLOCKWISE = KernelImpl(
    "gptq", "gptq_dequant", "blockwise", "gptq/gptq_dequant.py.j2", 80, None,
    "unpack int4 checkpoint tensors to [N, K]", tile_knobs=frozenset({"block_n", "block_k"}),
    launch=described(DEQUANT_C_LAUNCH))
