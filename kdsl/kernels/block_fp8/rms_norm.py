"""rms_norm / rowwise: a decoder layer's RMSNorm, y = x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and
rounded once to x's dtype (as torch.nn.RMSNorm's fused kernel computes it), or with x * rsqrt(...) rounded to x's
dtype before the weight (round_normalized: transformers' Llama-family norms).

Memory-bound: each program holds BLOCK_M whole rows in registers, so x is read once. At decode (a few rows) torch's
kernel takes about 4.2-4.5 us a call on an H200 where this one takes about 1.5 (rmsnorm_probe_h200.json). It reads
none of its scheme's fields: generated for the block_fp8 scheme of its definition file only because every kernel has
one (as silu_mul).
"""
from kdsl.kernels.base import KernelImpl, Launch
from kdsl.kernels.host import cdiv, next_power_of_two


def launch_rms_norm(generated, x, weight, y, eps, round_normalized, tile):
    """x [M, H] and y [M, H] with unit stride along columns, weight [H] contiguous; eps a float; round_normalized:
    x * rsqrt(mean(x^2) + eps) rounded to y's dtype before the weight."""
    M, H = x.shape
    grid = (cdiv(M, tile["BLOCK_M"]), 1, 1)
    return Launch(generated.kernel, grid, (x, weight, y, M, H, x.stride(0), y.stride(0), float(eps)),
                  dict(BLOCK_M=tile["BLOCK_M"], BLOCK_H=next_power_of_two(H), ROUND_NORMALIZED=bool(round_normalized),
                       num_warps=tile["num_warps"]))


RMS_NORM = KernelImpl(
    "block_fp8", "rms_norm", "rowwise", "block_fp8/rms_norm.py.j2", 80, None,
    "x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded to x's dtype (once, or also before the weight), "
    "whole rows per program",
    tile_knobs=frozenset({"block_m"}), launch=launch_rms_norm)
