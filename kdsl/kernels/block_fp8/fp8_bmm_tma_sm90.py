"""fp8_bmm/tma_persistent (Hopper): MLA's batched block-FP8 GEMM with 3-D TMA descriptors and wgmma.

A, B and C move through 3-D TMA boxes [1, rows, cols] over their [B, rows, cols] views, so a batch of
`x.transpose(0, 1)` views (MLA's per-head activations, batch not outermost) loads and stores without a
copy, and rows past M or N are zero-filled (loads) or dropped (stores) inside their own batch. A grid of
programs walks the (batch, m-tile, n-tile) tiles; scales are applied per K block in fp32.

At run time its `refusal` passes a tile over where a TMA descriptor cannot take the tensors (a base or a
stepped stride that is not a non-zero multiple of 16 bytes); the definition's alternative tile, fp8_bmm/portable's
kernel with the same blocks, serves those calls. A tile with `batch_max` set serves only calls of that many
batches or fewer (TP = 8's 16 heads want other tiles than 128 heads do); the tile after it serves the rest.
"""
from typing import Literal

from pydantic import Field, PositiveInt

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.c_abi import ImplLaunch, TmaDescriptor
from kdsl.kernels.block_fp8.fp8_bmm_portable import bmm_values
from kdsl.kernels.block_fp8.fp8_gemm_portable import TILE_ORDER_HELP, one_scale_per_k_block, operand_ring_bytes
from kdsl.kernels.described import described
from kdsl.strict_model import StrictModel


class Options(StrictModel):
    persistent: bool = Field(True, description="programs_per_sm programs per SM loop over the tiles, instead of "
                                               "one program per tile")
    programs_per_sm: PositiveInt = Field(2, description="persistent grid: programs launched per SM")
    tile_order: Literal["m_major", "n_major"] = Field("m_major", description=TILE_ORDER_HELP + " (within a batch)")
    batch_inner: bool = Field(False, description="consecutive tiles walk the batch first (the heads of one block "
                                                 "of tokens, adjacent in MLA's [M, B, K] activations), instead of "
                                                 "all of one batch's tiles first (which share its weights in L2)")
    swap_ab: bool = Field(False, description="compute C^T = B A^T so B's rows fill the wgmma's 64-row side and a "
                                             "few rows of A its narrow one")
    flatten: bool = Field(False, description="persistent grid: Triton flattens the tile loop and the K loop into "
                                             "one software pipeline, so a program's next tile loads while it "
                                             "finishes one (K = 128 is a single K block per tile)")
    warp_specialize: bool = Field(False, description="Triton's warp specialization of the tile loop: a load "
                                                     "partition feeding the wgmma warps")
    pdl: bool = Field(False, description="programmatic dependent launch: the kernel may start while the previous "
                                         "kernel on the stream finishes, waits for it (griddepcontrol.wait) before "
                                         "reading activations or writing the output, then lets the next kernel "
                                         "launch; hides the launch gap between kernels")
    prefetch_weights: bool = Field(False, description="with pdl: before waiting for the previous kernel, each "
                                                      "program pulls its first tile's weights into L2")
    batch_max: PositiveInt | None = Field(None, description="the tile serves calls of at most this many batches "
                                                           "(few heads, as under tensor parallelism) and passes "
                                                           "larger ones to the next tile, its alternative")
    epilogue: Literal["tma", "pointer"] = Field("tma", description="how a tile's output is stored: a TMA store "
                                                                  "from shared memory, or masked pointer stores "
                                                                  "from registers")


def shared_bytes(scheme, tile, options: Options) -> int:
    # The TMA ring plus the epilogue tile staged for the store (bf16: 2 bytes; fp32 outputs use 4, which
    # the stages must leave room for, so count 4).
    return operand_ring_bytes(scheme, tile, options) + tile.block_m * tile.block_n * 4


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = one_scale_per_k_block(where, scheme, tile)
    if options.swap_ab and tile.block_n < 64:
        found.append(f"{where}.options.swap_ab: B's rows fill the wgmma's 64-row side; needs block_n >= 64 "
                     f"(got {tile.block_n})")
    if options.prefetch_weights and not options.pdl:
        found.append(f"{where}.options.prefetch_weights: weights are prefetched while the previous kernel "
                     f"finishes, which needs pdl = true")
    if not options.persistent:
        for knob in ("flatten", "programs_per_sm"):
            if knob in options.model_fields_set:
                found.append(f"{where}.options.{knob}: only a persistent grid takes it; set persistent = true")
    return found


def refusal(generated, tile, call):
    """Why the TMA kernel cannot serve `call` (a kdsl.runtime Call), None where it can; the definition's
    alternative tile (fp8_bmm/portable's kernel with the same blocks) then serves it. A tile for few batches
    (batch_max) passes larger calls to the tile after it."""
    if tile["batch_max"] is not None and call.batch > tile["batch_max"]:
        return f"the tile serves up to batch_max = {tile['batch_max']} batches, the call has {call.batch}"
    if call.align < 16:
        return ("TMA needs every base and stepped stride of a, b and out a non-zero multiple of 16 bytes"
                + (" (one is 0: a broadcast view)" if call.align == 0 else ""))
    return None


_BMM_TILES = "B * cdiv(M, {BLOCK_M}) * cdiv(N, {BLOCK_N})"
_BMM_PROGRAMS = f"programs({_BMM_TILES}, {{persistent}}, {{programs_per_sm}}, sms)"

C_LAUNCH = ImplLaunch(
    # 3-D descriptors over [B, rows, cols] with the strides as given (tma_stride: a dimension of size 1
    # gets the padded row instead, as it is never stepped).
    # b_ptr, c_ptr and their strides serve the weight prefetch and the pointer epilogue (tile options).
    params=(("a_desc", "desc"), ("b_desc", "desc"), ("c_desc", "desc"), ("as_ptr", "a_s"), ("bs_ptr", "b_s"),
            ("b_ptr", "b"), ("c_ptr", "c"),
            ("B", "B"), ("M", "M"), ("N", "N"), ("K", "K"), ("stride_asb", "stride_asb"),
            ("stride_asm", "stride_asm"), ("stride_ask", "stride_ask"), ("stride_bsb", "stride_bsb"),
            ("stride_bsn", "stride_bsn"), ("stride_bsk", "stride_bsk"), ("stride_bb", "stride_bb"),
            ("stride_bn", "stride_bn"), ("stride_cb", "stride_cb"), ("stride_cm", "stride_cm"),
            ("num_programs", _BMM_PROGRAMS)),
    pointer_types={"as_ptr": "fp32", "bs_ptr": "fp32", "b_ptr": "fp8e4nv", "c_ptr": "dtype:out_dtype"},
    descriptors={
        "a_desc": TmaDescriptor("a", "fp8e4nv", ("B", "M", "K"),
                                ("tma_stride(B, stride_ab, K, 1)", "tma_stride(M, stride_am, K, 1)", "1"),
                                ("1", "{BLOCK_M}", "{BLOCK_K}")),
        "b_desc": TmaDescriptor("b", "fp8e4nv", ("B", "N", "K"),
                                ("tma_stride(B, stride_bb, K, 1)", "tma_stride(N, stride_bn, K, 1)", "1"),
                                ("1", "{BLOCK_N}", "{BLOCK_K}")),
        "c_desc": TmaDescriptor("c", "dtype:out_dtype", ("B", "M", "N"),
                                ("tma_stride(B, stride_cb, N, dtype_size(out_dtype))",
                                 "tma_stride(M, stride_cm, N, dtype_size(out_dtype))", "1"),
                                ("1", "{BLOCK_M}", "{BLOCK_N}")),
    },
    grid=(_BMM_PROGRAMS, "1", "1"),
    # The tile's constexprs and launch options (PDL: kdsl.kernels.described adds its launch attribute).
    constexprs=lambda tile, scheme: {
        "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"], "BLOCK_K": tile["BLOCK_K"],
        "GROUP_M": tile["GROUP_M"], "N_MAJOR": tile["tile_order"] == "n_major",
        "BATCH_INNER": tile["batch_inner"], "SWAP_AB": tile["swap_ab"], "FLATTEN": tile["flatten"],
        "WARP_SPECIALIZE": tile["warp_specialize"],
        # The C launcher sets no programmatic-dependent-launch attribute: a pdl tile's grid-dependency
        # wait then finds its producer finished (stream order), so the same cubin is correct, without
        # the overlap kdsl.ops gets.
        "PDL": tile["pdl"], "PREFETCH_WEIGHTS": tile["prefetch_weights"],
        "POINTER_STORE": tile["epilogue"] == "pointer"},
    options=lambda tile: {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
    # The module's refusal: more batches than the tile's batch_max (0: unset), or (call.align < 16) a
    # base or stepped stride of a, b or c not a non-zero multiple of 16 bytes; its calls go to the tile
    # after it (another tile's kernel, or the portable alternative).
    refuses=("nonzero({batch_max}) * (B > {batch_max})"
             " + nonzero(addr(a) % 16) + nonzero(addr(b) % 16) + nonzero(addr(c) % 16)"
             " + bad_tma_stride(B, stride_ab, 1) + bad_tma_stride(M, stride_am, 1)"
             " + bad_tma_stride(B, stride_bb, 1) + bad_tma_stride(N, stride_bn, 1)"
             " + bad_tma_stride(B, stride_cb, dtype_size(out_dtype))"
             " + bad_tma_stride(M, stride_cm, dtype_size(out_dtype))"),
    refused_to="tile",
    values=bmm_values,
)


IMPL = KernelImpl(
    "block_fp8", "fp8_bmm", "tma_persistent", "block_fp8/fp8_bmm_tma_sm90.py.j2", 90, 90,
    "batched, 3-D TMA descriptors (transposed activations without a copy), persistent grid over "
    "(batch, m-tile, n-tile), wgmma through Triton; refuses strides TMA cannot take",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=shared_bytes, problems=problems, min_block_m=16,
    launch=described(C_LAUNCH), refusal=refusal,
    # Programs per SM, the flattened pipeline, programmatic dependent launch and its weight prefetch, the
    # epilogue's stores: the knobs its tiles were swept over (benchmarks/results/fp8_bmm_sweep*).
    tune_grid={"decode": {"programs_per_sm": (4, 8), "flatten": (False, True), "pdl": (False, True),
                          "prefetch_weights": (False, True)},
               "mid": {"flatten": (False, True), "pdl": (False, True), "prefetch_weights": (False, True),
                       "epilogue": ("tma", "pointer")},
               "prefill": {"persistent": (False, True), "pdl": (False, True), "epilogue": ("tma", "pointer")}},)
