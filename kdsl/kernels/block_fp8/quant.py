"""The block-FP8 quantize and dequantize kernels: memory-bound, one program per row group or weight block."""
from kdsl.kernels.base import KernelImpl, Launch
from kdsl.kernels.c_abi import ImplLaunch
from kdsl.kernels.described import described
from kdsl.kernels.expressions import dtype_code
from kdsl.kernels.host import cdiv


def act_quant_values(x, q, s) -> dict:
    """act_quant's C arguments: x [M, K] (unit stride along K), q [M, K] fp8 and s [M, K // GROUP] float32, both
    contiguous."""
    M, K = x.shape
    return {"x": x, "x_dtype": dtype_code(x.dtype), "ldx": x.stride(0), "q": q, "s": s, "M": M, "K": K}


def launch_weight_quant(generated, w, q, s, tile):
    """w [N, K] (unit stride along K), q [N, K] fp8 contiguous, s [cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)] float32."""
    N, K = w.shape
    module = generated.module
    grid = (cdiv(N, module.BLOCK_N.value), cdiv(K, module.BLOCK_K.value), 1)
    return Launch(generated.kernel, grid, (w, q, s, N, K, w.stride(0), s.stride(0)),
                  dict(ROUND_FIRST=w.device.type == "cpu", num_warps=tile["num_warps"]))


def launch_weight_dequant(generated, q, s, w, tile):
    """q [N, K] fp8 (unit stride along K), s [cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)] float32, w [N, K] contiguous."""
    N, K = q.shape
    module = generated.module
    grid = (cdiv(N, module.BLOCK_N.value), cdiv(K, module.BLOCK_K.value), 1)
    return Launch(generated.kernel, grid, (q, s, w, N, K, q.stride(0), s.stride(0), s.stride(1)),
                  dict(num_warps=tile["num_warps"]))


ACT_QUANT_C_LAUNCH = ImplLaunch(
    params=(("x_ptr", "x"), ("q_ptr", "q"), ("s_ptr", "s"), ("M", "M"), ("K", "K"), ("stride_xm", "ldx")),
    pointer_types={"x_ptr": "dtype:x_dtype", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
    grid=("cdiv(M, {BLOCK_M})", "div(K, {act_group})", "1"),
    constexprs=lambda tile, scheme: {"BLOCK_M": tile["BLOCK_M"], "ROUND_FIRST": False},
    options=lambda tile: {"num_warps": tile["num_warps"]},
    values=act_quant_values,
    interpreted={"ROUND_FIRST": True},  # the interpreter's rounding order
)


ACT_QUANT_ROWWISE = KernelImpl(
    "block_fp8", "act_quant", "rowwise", "block_fp8/act_quant.py.j2", 89, None,
    "per-token, per-group amax scaling to e4m3", tile_knobs=frozenset({"block_m"}),
    launch=described(ACT_QUANT_C_LAUNCH))
WEIGHT_QUANT_BLOCKWISE = KernelImpl(
    "block_fp8", "weight_quant", "blockwise", "block_fp8/weight_quant.py.j2", 89, None,
    "one program per weight block, amax scaling to e4m3", tile_knobs=frozenset(), launch=launch_weight_quant)
WEIGHT_DEQUANT_BLOCKWISE = KernelImpl(
    "block_fp8", "weight_dequant", "blockwise", "block_fp8/weight_dequant.py.j2", 89, None,
    "one program per weight block, fp8 x scale", tile_knobs=frozenset(), launch=launch_weight_dequant)
