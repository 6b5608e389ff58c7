"""rms_norm / rowwise: a decoder layer's RMSNorm, y = x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and
rounded once to x's dtype (as torch.nn.RMSNorm's fused kernel computes it), or with x * rsqrt(...) rounded to x's
dtype before the weight (round_normalized: transformers' Llama-family norms).

rms_norm_quant / rowwise (sm_89+: e4m3 stores) computes the same fp32 rows and quantizes them per token in
1 x act_group groups as act_quant does (common/act_group_quant.py.j2), instead of rounding them to x's dtype: an FP8
layer's norm then feeds its fp8_gemm with no act_quant launch between the two (at decode, one of about 1.4 us on an
H200 for each of a Llama layer's two norms).

Memory-bound: each program holds BLOCK_M whole rows in registers, so x is read once. At decode (a few rows) torch's
kernel takes about 4.2-4.5 us a call on an H200 where this one takes about 1.5 (rmsnorm_probe_h200.json). On sm_90+
rms_norm releases the kernel after it at once, as silu_mul does: a W4A16 GEMV launched dependent (plain_pdl) loads
its first weights while the norm runs (Llama-3-8B W4A16 layers at M = 1: 219 -> 212 us,
model_llama8b_w4a16_norm_release_ab_h200.json); and it is itself a dependent launch of the kernel before it, placed
while that kernel (a W4A16 GEMM, which releases its dependents) runs its last programs (docs/kernels.md). rms_norm
reads none of its scheme's fields: generated for the block_fp8 scheme of its definition file only because every
kernel has one (as silu_mul).

add_rms_norm and add_rms_norm_quant (the same kernels with RESIDUAL) first add the residual stream, h = x + residual
rounded to x's dtype as torch adds them, write h, and normalize it: a decoder layer's residual add and the next
norm in one launch, as serving stacks fuse them (vLLM's fused_add_rms_norm).
"""
from pydantic import Field, PositiveInt

from kdsl.kernels import host
from kdsl.kernels.base import KernelImpl, Launch, dependent
from kdsl.kernels.host import cdiv, next_power_of_two
from kdsl.strict_model import StrictModel


class NormQuantOptions(StrictModel):
    """How many programs share a row."""

    columns: PositiveInt | None = Field(
        None, description="columns each program quantizes, a power of two and a multiple of the act group (each "
                          "program still reads its rows whole for their mean square); omit for whole rows, one "
                          "program each")


def norm_quant_problems(where: str, scheme, variant, tile, options: NormQuantOptions) -> list[str]:
    columns, group = options.columns, scheme.act_group
    if columns is not None and (columns & (columns - 1) or columns % group):
        return [f"{where}.options.columns: {columns} is not a power of two that is a multiple of the act group "
                f"{group}"]
    return []


def _norm(generated, x, residual, weight, y, h, eps, round_normalized, tile):
    M, H = x.shape
    r, h = (x, y) if residual is None else (residual, h)  # unread and unwritten without RESIDUAL
    grid = (cdiv(M, tile["BLOCK_M"]), 1, 1)
    # sm_90+: placed as the kernel before it (a W4A16 GEMV, which releases its dependents) runs its last programs,
    # and releasing the GEMV after it at once: the norm's launch, and that GEMV's, overlap the GEMV before.
    pdl = host.dependent_launches(x.device)
    launch = Launch(generated.kernel, grid, (x, r, weight, y, h, M, H, x.stride(0), r.stride(0), y.stride(0),
                                             h.stride(0), float(eps)),
                    dict(BLOCK_M=tile["BLOCK_M"], BLOCK_H=next_power_of_two(H), ROUND_NORMALIZED=bool(round_normalized),
                         RELEASE=pdl, PDL=False, RESIDUAL=residual is not None, ROUND_FIRST=x.device.type == "cpu",
                         num_warps=tile["num_warps"]))
    return dependent(launch) if pdl else launch


def _norm_quant(generated, x, residual, weight, q, s, h, eps, round_normalized, tile):
    M, H = x.shape
    r, h = (x, x) if residual is None else (residual, h)  # unread and unwritten without RESIDUAL
    block_h = max(next_power_of_two(H), generated.module.GROUP.value)
    block_c = min(tile["columns"] or block_h, block_h)
    grid = (cdiv(M, tile["BLOCK_M"]), cdiv(H, block_c), 1)
    return Launch(generated.kernel, grid, (x, r, weight, q, s, h, M, H, x.stride(0), r.stride(0), q.stride(0),
                                           s.stride(0), h.stride(0), float(eps)),
                  dict(BLOCK_M=tile["BLOCK_M"], BLOCK_H=block_h, BLOCK_C=block_c,
                       ROUND_NORMALIZED=bool(round_normalized), ROUND_FIRST=x.device.type == "cpu",
                       RESIDUAL=residual is not None, num_warps=tile["num_warps"]))


def launch_rms_norm(generated, x, weight, y, eps, round_normalized, tile):
    """x [M, H] and y [M, H] with unit stride along columns, weight [H] contiguous; eps a float; round_normalized:
    x * rsqrt(mean(x^2) + eps) rounded to y's dtype before the weight."""
    return _norm(generated, x, None, weight, y, None, eps, round_normalized, tile)


def launch_add_rms_norm(generated, x, residual, weight, y, h, eps, round_normalized, tile):
    """rms_norm's launch on h = x + residual, written to h; residual and h [M, H] as x, unit stride along columns."""
    return _norm(generated, x, residual, weight, y, h, eps, round_normalized, tile)


def launch_rms_norm_quant(generated, x, weight, q, s, eps, round_normalized, tile):
    """x [M, H] with unit stride along columns, weight [H] contiguous; q [M, H] e4m3 and s [M, H // GROUP] float32,
    unit stride along columns."""
    return _norm_quant(generated, x, None, weight, q, s, None, eps, round_normalized, tile)


def launch_add_rms_norm_quant(generated, x, residual, weight, q, s, h, eps, round_normalized, tile):
    """rms_norm_quant's launch on h = x + residual, written to h; residual and h [M, H] as x."""
    return _norm_quant(generated, x, residual, weight, q, s, h, eps, round_normalized, tile)


RMS_NORM = KernelImpl(
    "block_fp8", "rms_norm", "rowwise", "block_fp8/rms_norm.py.j2", 80, None,
    "x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded to x's dtype (once, or also before the weight), "
    "whole rows per program",
    tile_knobs=frozenset({"block_m"}), launch=launch_rms_norm)
ADD_RMS_NORM = KernelImpl(
    "block_fp8", "add_rms_norm", "rowwise", "block_fp8/rms_norm.py.j2", 80, None,
    "h = x + residual (rounded to x's dtype), then rms_norm's rows of h; h written out too, whole rows per program",
    tile_knobs=frozenset({"block_m"}), launch=launch_add_rms_norm)
ADD_RMS_NORM_QUANT = KernelImpl(
    "block_fp8", "add_rms_norm_quant", "rowwise", "block_fp8/rms_norm.py.j2", 89, None,
    "h = x + residual (rounded to x's dtype), then rms_norm_quant's codes of h; h written out too",
    tile_knobs=frozenset({"block_m"}), options=NormQuantOptions, problems=norm_quant_problems,
    launch=launch_add_rms_norm_quant)
RMS_NORM_QUANT = KernelImpl(
    "block_fp8", "rms_norm_quant", "rowwise", "block_fp8/rms_norm.py.j2", 89, None,
    "the norm in fp32 as rms_norm computes it, quantized per token and group to e4m3 (act_quant's rule), whole rows "
    "per program, or a row's groups spread over programs", tile_knobs=frozenset({"block_m"}),
    options=NormQuantOptions, problems=norm_quant_problems, launch=launch_rms_norm_quant)
