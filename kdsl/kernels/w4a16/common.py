"""What the W4A16 implementations share: the split-K options, the prepared layouts they read, their C arguments and
launch descriptions (the dequant's magic numbers among their constexprs), and act-order's gather."""
import torch
from pydantic import Field, PositiveInt

from kdsl.kernels.base import Launch
from kdsl.kernels.c_abi import SPLIT, ImplLaunch
from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import SPLIT_FILL_HELP, SPLIT_MIN_STEPS_HELP
from kdsl.kernels import host
from kdsl.kernels.expressions import dtype_code
from kdsl.kernels.host import cdiv
from kdsl.packing import PLANE_TILE_K, PLANE_TILE_N
from kdsl.strict_model import StrictModel


class SplitOptions(StrictModel):
    """How a tile's split_k (an upper bound) becomes the split it launches with (kdsl.kernels.host.split_for)."""

    split_fill: PositiveInt | None = Field(None, description=SPLIT_FILL_HELP)
    split_min_steps: PositiveInt | None = Field(None, description=SPLIT_MIN_STEPS_HELP)


PDL_HELP = ("act-order calls: the kernel is a programmatic dependent launch of act-order's gather of x, so its "
            "programs start and request their first weights while the gather runs; on sm_90 and later GPUs only "
            "(elsewhere the option has no effect)")


GATHER_PDL_HELP = ("act-order calls: the gather of x is a programmatic dependent launch of the kernel before it "
                   "(whatever wrote x): it loads the permutation, then waits for that kernel; on sm_90 and later "
                   "GPUs only")


PLAIN_PDL_HELP = ("calls without act-order: the kernel is a programmatic dependent launch of the kernel before it "
                  "(whatever wrote x: in a W4A16 MLP, silu_mul, which releases it at once), so its programs are "
                  "placed while that kernel runs; they wait for it before reading x; sm_90 and later GPUs only")


class PdlOptions(StrictModel):
    """Whether act-order calls launch the kernel dependent on the gather before it, and the gather dependent on the
    kernel before that; whether plain calls launch it dependent on the kernel before them."""

    pdl: bool = Field(False, description=PDL_HELP)
    gather_pdl: bool = Field(False, description=GATHER_PDL_HELP)
    plain_pdl: bool = Field(False, description=PLAIN_PDL_HELP)


class SplitPdlOptions(PdlOptions, SplitOptions):
    """SplitOptions and PdlOptions."""


def weights_layout(variant) -> str | None:
    return getattr(variant.layout, "weights", None)


def needs_layout(at: str, variant, weights: str, zeros: str | None = None) -> list[str]:
    """The variant's prepared layout must be `weights` (and `zeros`, where given) for this implementation."""
    have = (weights_layout(variant), getattr(variant.layout, "zeros", None))
    if have[0] == weights and (zeros is None or have[1] == zeros):
        return []
    want = f'weights = "{weights}"' + (f', zeros = "{zeros}"' if zeros else "")
    return [f"{at}: reads the layout {{ {want} }}; the variant declares {{ weights = \"{have[0]}\", "
            f"zeros = \"{have[1]}\" }}"]


def plane_tile_problems(where: str, tile) -> list[str]:
    """k_planes MMA tiles step one plane tile of K at a time over whole plane tiles of N."""
    found = []
    if tile.block_k != PLANE_TILE_K:
        found.append(f"{where}.block_k: {tile.block_k}; the k_planes layout's tiles take block_k = {PLANE_TILE_K}")
    if PLANE_TILE_N % tile.block_n:
        found.append(f"{where}.block_n: {tile.block_n} does not divide the k_planes layout's "
                     f"{PLANE_TILE_N} columns per tile")
    return found


# Bit patterns whose low mantissa bits take q directly, and the value they stand for.
MAGIC = {torch.float16: (0x6400, 1024), torch.bfloat16: (0x4300, 128)}


def gather_columns(generated, x, perm, out, dependent: bool = False):
    """out [M, K] = x [M, K] (unit column strides) with its columns in prepared K order (act-order), for
    launch(out, None, ...); out is the caller's, so a launch plan can allocate it as it allocates the outputs.
    dependent: a programmatic dependent launch of the kernel before it (the tile's gather_pdl; sm_90+).
    Gathering x once, in its own launch, lets every tile serve act-order at plain g_idx's speed; the kernels'
    perm lookup per element (HAS_PERM, which the AOT C ABI keeps) made the GEMMs' x loads wait on it (H200,
    M = 1-256: 1.4-28x the plain layer's time, against 1.2-1.5x with a gather)."""
    M, K = x.shape
    k_pow2 = host.next_power_of_two(K)
    # Each program reads its whole row and permutes it through shared memory, so a row's columns are split over
    # several programs only where rows alone leave the SMs idle (H200, K = 14336: M = 256 took 14 us in blocks
    # of 1024 columns).
    block_k = k_pow2
    while block_k > 1024 and M * (k_pow2 // block_k) < 256:
        block_k //= 2
    # On sm_90+ it releases the GEMM after it at once (a no-op where that GEMM is an ordinary launch). Waiting on
    # the kernel before it is safe whatever that kernel is (it waits for it before reading x), but on an H200 it
    # paid only before the GEMV tiles below N = 8192, which take it (gather_pdl): with it on every tile, desc_act /
    # plain on 4096x4096 went to 0.81-0.97 at M = 1-8, but from 1.21/1.19 to 1.28/1.37 at M = 16/64, and up
    # 0.03-0.05 from N = 8192 (gptq_act_order_gather_pdl_h200.json against gptq_act_order_variant_rows_h200.json).
    pdl = host.dependent_launches(x.device)
    wait = pdl and dependent
    return Launch(generated.module._gather_columns, (M, cdiv(K, block_k), 1),
                  (x, perm, out, K, x.stride(0), out.stride(0)),
                  dict(K_POW2=k_pow2, BLOCK_K=block_k, PDL=pdl, PDL_WAIT=wait, num_warps=8 if k_pow2 >= 8192 else 4,
                       **({"launch_pdl": True} if wait else {})))


def w4a16_values(x, perm, qweight, zeros, scales, groups, contiguous_groups, y) -> dict:
    """w4a16_gemm's C arguments: x [M, K]; perm int32 [K] or None; qweight, zeros and scales as the module's LAYOUT
    says, in prepared K order; groups int32 [K], the group of each prepared row; contiguous_groups: row k is in
    group k // GROUP_SIZE. y [M, N] in x's dtype."""
    M, K = x.shape
    return {"x": x, "ldx": x.stride(0), "perm": perm, "qweight": qweight, "ldqw": qweight.stride(0),
            "zeros": zeros, "ldz": zeros.stride(0), "scales": scales, "lds": scales.stride(0), "groups": groups,
            "contiguous_groups": int(contiguous_groups), "y": y, "ldy": y.stride(0), "x_dtype": dtype_code(x.dtype),
            "M": M, "N": y.shape[1], "K": K}


# ---- how these kernels are launched (kdsl.kernels.c_abi.ImplLaunch, evaluated by kdsl.kernels.described)

C_MAGIC = {"f16": MAGIC[torch.float16], "bf16": MAGIC[torch.bfloat16]}  # MAGIC by the C ABI's dtype names
C_POINTERS = {"x_ptr": "dtype:x_dtype", "perm_ptr": "i32", "qw_ptr": "i32", "z_ptr": "dtype:x_dtype",
              "s_ptr": "dtype:x_dtype", "g_ptr": "i32", "y_ptr": "dtype:x_dtype",
              "ws_ptr": "scratch:fp32:x_dtype", "count_ptr": "scratch:i32:x_dtype"}
C_HEAD = (("x_ptr", "x"), ("perm_ptr", "either(perm, qweight)"), ("qw_ptr", "qweight"), ("z_ptr", "zeros"),
          ("s_ptr", "scales"), ("g_ptr", "groups"), ("y_ptr", "y"), ("ws_ptr", "y"), ("count_ptr", "y"),
          ("M", "M"), ("N", "N"), ("K", "K"), ("stride_xm", "ldx"))
C_TAIL = (("stride_zg", "ldz"), ("stride_sg", "lds"), ("stride_ym", "ldy"))
# split_for in kdsl/kernels/host.py: the tile's SPLIT_K capped by split_min_steps, then the split whose
# programs finish soonest on the device's SMs (gemv passes no SM count: the cap).
C_TILES = "cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
C_SPLIT_FOR = f"split_for(cdiv(K, {{BLOCK_K}}), {C_TILES}, {{SPLIT_K}}, {{split_min_steps}}, {{split_fill}}, sms)"
C_GEMV_PROGRAMS = "M * cdiv(N, {BLOCK_N})"
C_GEMV_SPLIT = "split_cap(cdiv(K, {BLOCK_K}), {SPLIT_K}, {split_min_steps})"
C_UNIFORM = "contiguous_groups * ({group_rows} % {BLOCK_K} == 0)"
C_PLANE_UNIFORM = "contiguous_groups * ({group_rows} % 128 == 0)"  # PLANE_TILE_K (kdsl.packing)
C_PLANE_WORD_GROUPS = "contiguous_groups * ({group_rows} % 32 == 0)"  # PAIR_SPAN


def _c_magic(dtypes):
    bits, bias = C_MAGIC[dtypes["x_dtype"]]
    return {"MAGIC_BITS": bits, "MAGIC_BIAS": bias}


def mma_c_launch(params, runtime, extra, interpreted, releases: bool = False):
    return ImplLaunch(
        params=params, pointer_types=C_POINTERS,
        grid=(C_TILES, "split", "1"),
        constexprs=lambda tile, scheme: {"BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"],
                                         "BLOCK_K": tile["BLOCK_K"], "GROUP_M": tile["GROUP_M"],
                                         "FP32_MATH": False, **extra},
        options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
        kernel="{module}", runtime_constexprs=(("HAS_PERM", "nonzero(perm)", (False, True)), *runtime,
                                               ("SPLIT_K", C_SPLIT_FOR, SPLIT)),
        dtype_constexprs=_c_magic, values=w4a16_values, interpreted={"FP32_MATH": True, **interpreted},
        scratch=("ws_ptr", "count_ptr", f"{C_TILES} * split * {{BLOCK_M}} * {{BLOCK_N}}", C_TILES), scratch_alias="y",
        releases=releases)


def gemv_c_launch(params, runtime, extra):
    return ImplLaunch(
        params=params, pointer_types=C_POINTERS,
        grid=(C_GEMV_PROGRAMS, "split", "1"),
        constexprs=lambda tile, scheme: {"BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
                                         "FP32_MATH": False, **extra},
        options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
        kernel="{module}", runtime_constexprs=(("HAS_PERM", "nonzero(perm)", (False, True)), *runtime,
                                               ("SPLIT_K", C_GEMV_SPLIT, SPLIT)),
        dtype_constexprs=lambda dtypes: {"MAGIC_BIAS": C_MAGIC[dtypes["x_dtype"]][1]}, values=w4a16_values,
        # HALF2_DOT: packed half2 math, which the interpreter does not model
        interpreted={"FP32_MATH": True, "HALF2_DOT": False},
        scratch=("ws_ptr", "count_ptr", f"{C_GEMV_PROGRAMS} * split * {{BLOCK_N}}", C_GEMV_PROGRAMS),
        scratch_alias="y")

