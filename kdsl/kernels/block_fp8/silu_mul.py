"""The gated MLP's activation, silu(gate) * up, on the gate-up GEMM's output [..., 2I] (gate's I columns, then
up's): one memory-bound pass, one program per rows x columns tile.

silu_mul / rowwise (sm_80+) writes h [..., I] in the input's dtype (W4A16 MLPs: the down GEMM reads it as it is);
silu_mul_quant / rowwise (sm_89+: e4m3 stores) quantizes h per token in 1 x act_group groups as act_quant does
(common/act_group_quant.py.j2: s = amax / 448, NaN kept, zero groups finite), so FP8 MLPs feed the down GEMM
without an act_quant of their own. Both compute h in fp32 and round it once. silu_mul reads none of its scheme's
fields: it is generated for the block_fp8 scheme of its definition file only because every kernel has one.

In a W4A16 MLP silu_mul sits between two GEMMs at decode, where a launch costs about what the kernel does: on
sm_90+ it releases the kernel after it at once (a down GEMM launched dependent is placed while silu_mul runs,
waiting for it before reading h), and with its tile's `pdl` it is itself a dependent launch of the gate-up GEMM.
"""
from pydantic import Field

from kdsl.kernels import host
from kdsl.kernels.base import KernelImpl, Launch
from kdsl.kernels.host import cdiv
from kdsl.strict_model import StrictModel


class SiluMulOptions(StrictModel):
    """Whether silu_mul launches dependent on the kernel before it."""

    pdl: bool = Field(False, description="a programmatic dependent launch of the kernel before it (whatever wrote "
                                         "gate_up): placed as that kernel's programs finish, it waits for it before "
                                         "reading gate_up; sm_90 and later GPUs only (elsewhere no effect)")


def launch_silu_mul(generated, gu, h, tile):
    """gu [M, 2 I] (unit stride along columns: gate's I, then up's), h [M, I] in its dtype, unit stride along
    columns. PDL False: kdsl.kernels.base.dependent turns it on for a dependent launch."""
    M, I = h.shape
    grid = (cdiv(M, tile["BLOCK_M"]), cdiv(I, tile["BLOCK_N"]), 1)
    return Launch(generated.kernel, grid, (gu, h, M, I, gu.stride(0), h.stride(0)),
                  dict(BLOCK_M=tile["BLOCK_M"], BLOCK_N=tile["BLOCK_N"], PDL=False,
                       RELEASE=host.dependent_launches(gu.device), num_warps=tile["num_warps"]))


def launch_silu_mul_quant(generated, gu, q, s, tile):
    """gu [M, 2 I] (unit stride along columns: gate's I, then up's), q [M, I] fp8 and s [M, I // GROUP] float32,
    unit stride along columns."""
    M, I = q.shape
    grid = (cdiv(M, tile["BLOCK_M"]), I // generated.module.GROUP.value, 1)
    return Launch(generated.kernel, grid, (gu, q, s, M, I, gu.stride(0), q.stride(0), s.stride(0)),
                  dict(BLOCK_M=tile["BLOCK_M"], ROUND_FIRST=gu.device.type == "cpu", num_warps=tile["num_warps"]))


SILU_MUL = KernelImpl(
    "block_fp8", "silu_mul", "rowwise", "block_fp8/silu_mul.py.j2", 80, None,
    "silu(gate) * up in fp32, rounded once to the input's dtype", tile_knobs=frozenset({"block_m", "block_n"}),
    options=SiluMulOptions, launch=launch_silu_mul)
SILU_MUL_QUANT = KernelImpl(
    "block_fp8", "silu_mul_quant", "rowwise", "block_fp8/silu_mul.py.j2", 89, None,
    "silu(gate) * up in fp32, quantized per token and group to e4m3 (act_quant's rule)",
    tile_knobs=frozenset({"block_m"}), launch=launch_silu_mul_quant)
