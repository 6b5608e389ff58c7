"""moe_fp8/sorted: a block-FP8 MoE layer (DeepSeek-V3, Qwen3-MoE) with tokens sorted by expert on the device (sm_89+).

One module, six launches (eight where the routing takes its three steps, five where it is skipped), no host sync:
the routing kernels (kdsl/kernels/moe_routing.py) sort the (token, slot) assignments by expert and pad each
expert's run to block_m rows, all on the device (no host-side counts); x is
quantized per token (act_quant's rule); the gate-up GEMM reads the sorted rows' tokens straight from the
quantized x (no gathered copy) and, with `fuse_act`, applies silu(gate) * up and the 1x128 quantization in its
epilogue; the down GEMM stores each row at its assignment; a combine kernel sums each token's slots with the
router weights in fp32. Grids are sized on the host for the worst routing (T * k rows plus the padding of
min(T * k, E) experts); programs past the rows a call uses return at once, so one CUDA graph serves any routing.

Tiles are chosen per M bucket where M is tokens per routed expert, ceil(T * k / min(T * k, E))."""
from typing import Optional

import torch
from pydantic import Field

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options as GemmOptions
from kdsl.kernels.host import cdiv, next_power_of_two
from kdsl.kernels.moe_routing import combine, one_per_block, route

FUSE_ACT_HELP = ("silu(gate) * up and its 1x128 quantization in the gate-up GEMM's epilogue (block_n = the activation "
                 "group: each program computes 128 gate and the matching 128 up columns); false: the GEMM writes the "
                 "fp32 gate and up products and a second kernel activates and quantizes them, so block_n may be "
                 "narrower (more programs streaming weights at decode)")
SWAP_AB_HELP = ("compute C^T = w A^T in both GEMMs, so the weights' block_n rows fill the wgmma's 64-row side and "
                "the few sorted rows its narrow side (decode); needs fuse_act = false")
DOWN_STAGES_HELP = ("pipeline stages of the down GEMM (default: num_stages); its K is the intermediate size, often "
                    "short, where a shallower ring fits more programs per SM")


class Options(GemmOptions):
    fuse_act: bool = Field(True, description=FUSE_ACT_HELP)
    swap_ab: bool = Field(False, description=SWAP_AB_HELP)
    down_num_stages: Optional[int] = Field(None, ge=1, le=8, description=DOWN_STAGES_HELP)


def shared_bytes(scheme, tile, options: Options) -> int:
    # The larger ring of the two GEMMs: A's tile and one (unfused) or two (gate and up, fused) B tiles per stage,
    # fp8; the down GEMM's one B tile per stage.
    b_tiles = 2 if options.fuse_act else 1
    gate_up = tile.num_stages * (tile.block_m + b_tiles * tile.block_n) * tile.block_k
    down = (options.down_num_stages or tile.num_stages) * (tile.block_m + tile.block_n) * tile.block_k
    return max(gate_up, down)


def problems(where: str, scheme, variant, tile, options: Options) -> list[str]:
    found = []
    if options.fuse_act and tile.block_n != scheme.act_group:
        found.append(f"{where}.block_n: fuse_act quantizes h per row over one {scheme.act_group}-wide activation "
                     f"group per tile, so it needs block_n = {scheme.act_group} (got {tile.block_n}); or set "
                     "fuse_act = false")
    if options.fuse_act and options.swap_ab:
        found.append(f"{where}.options.swap_ab: the fused gate-up epilogue keeps A's rows on the MMA's wide side; "
                     "swap_ab needs fuse_act = false")
    # split_k: the gate-up GEMM's K in slices, each program writing a partial fp32 product that the activation
    # kernel sums (more programs where a few experts' columns would leave SMs idle).
    if options.fuse_act and tile.split_k > 1:
        found.append(f"{where}.split_k: the fused gate-up epilogue activates whole sums; split_k = {tile.split_k} "
                     "needs fuse_act = false")
    return found


# Launch shape of the memory-bound quantization (routing and combine: kdsl/kernels/moe_routing.py): a few
# microseconds at decode, a small share of the GEMMs' time at prefill.
QUANT_ROWS = 8  # rows per program quantizing x (act_quant's tile)


def launch(generated, x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, y, on_routed, tile):
    """x [T, H] bf16/fp16 (unit stride along H), w13 [E, 2I, H] and w2 [E, H, I] fp8 with their block scales
    w13_s [E, cdiv(2I, W_BLOCK_N), H // W_BLOCK_K] and w2_s [E, cdiv(H, W_BLOCK_N), I // W_BLOCK_K] (unit stride
    along K for weights and scales), topk_weights fp32 [T, k], topk_ids int32 [T, k], y [T, H] in x's dtype
    (contiguous). T, k >= 1; H and I multiples of ACT_GROUP.

    on_routed(outside): None, or called with a one-element int32 tensor, the number of ids outside [0, E), after
    the routing kernels and before the GEMMs are launched (the op's check of topk_ids; it may raise).
    Nothing here waits on the GPU: every size the grids need is known on the host, the rest is read on the device.
    """
    T, H = x.shape
    E, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    assignments = T * topk
    block_m, block_n = tile["BLOCK_M"], tile["BLOCK_N"]
    fuse = tile["fuse_act"]
    device = x.device
    round_first = device.type == "cpu"
    fp8 = w13.dtype
    act_group = generated.module.ACT_GROUP.value
    kernels = generated.kernels

    one_each = one_per_block(assignments, E)
    rows, block_expert, meta, max_rows, max_blocks, slot_rows = yield from route(generated, topk_ids, E, block_m,
                                                                                 on_routed, one_each)
    ids_strides = (topk_ids.stride(0), topk_ids.stride(1))

    xq = torch.empty((T, H), dtype=fp8, device=device)
    xs = torch.empty((T, H // act_group), dtype=torch.float32, device=device)
    # One token (decode): one row a program on one warp, 1.5 against 3.8 us for the eight-row tile (H200, T = 1).
    quant_rows = min(QUANT_ROWS, next_power_of_two(T))
    yield Launch(kernels["_quant"], (cdiv(T, quant_rows), H // act_group, 1), (x, xq, xs, T, H, x.stride(0)),
                 dict(BLOCK_M=quant_rows, ROUND_FIRST=round_first, num_warps=1 if quant_rows == 1 else 2))

    hq = torch.empty((max_rows, inter), dtype=fp8, device=device)
    hs = torch.empty((max_rows, inter // act_group), dtype=torch.float32, device=device)
    gemm = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tile["BLOCK_K"], GROUP_M=tile["GROUP_M"],
                N_MAJOR=tile["tile_order"] == "n_major", SWAP_AB=tile["swap_ab"], num_warps=tile["num_warps"],
                num_stages=tile["num_stages"])
    split = min(tile["SPLIT_K"], cdiv(H, tile["BLOCK_K"]))
    if fuse:
        h, h_scales, n = hq, hs, inter
    else:
        h = torch.empty((split, max_rows, two_inter), dtype=torch.float32, device=device)
        h_scales, n = h, two_inter
    yield Launch(generated.kernel, (max_blocks * cdiv(n, block_n), split, 1), (
        xq, xs, w13, w13_s, h, h_scales, rows, block_expert, meta, topk_ids, n, H, topk, E, max_blocks,
        max_rows * n, *ids_strides, xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_s.stride(0),
        w13_s.stride(1), h.stride(-2), h_scales.stride(-2),
    ), dict(FUSE_ACT=fuse, ROUND_FIRST=round_first, SPLIT_K=split, ONE_PER_BLOCK=one_each, **gemm))
    if not fuse:
        # One program per assignment and group, one row on one warp (the unfused activation serves decode): the
        # blocks are mostly padding there (H200, T = 1: 4.6 us for 16-row programs, 1.7 us for one-row ones).
        yield Launch(kernels["_act"], (assignments, inter // act_group, 1), (
            h, hq, hs, rows, rows if one_each else slot_rows, meta, inter, max_rows * two_inter, h.stride(-2),
            hq.stride(0), hs.stride(0),
        ), dict(BLOCK_M=block_m, SPLIT_K=split, ONE_PER_BLOCK=one_each, PER_ASSIGNMENT=True, ROUND_FIRST=round_first,
                num_warps=1))

    out = torch.empty((assignments, H), dtype=y.dtype, device=device)
    yield Launch(kernels["_down"], (max_blocks * cdiv(H, block_n), 1, 1), (
        hq, hs, w2, w2_s, out, rows, block_expert, meta, topk_ids, H, inter, topk, E, max_blocks, *ids_strides,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2_s.stride(0), w2_s.stride(1), out.stride(0),
    ), {**gemm, "num_stages": tile["down_num_stages"] or tile["num_stages"], "ONE_PER_BLOCK": one_each})
    yield combine(generated, out, topk_weights, topk_ids, y, E)


IMPL = KernelImpl(
    "block_fp8", "moe_fp8", "sorted", "block_fp8/moe_fp8_sorted.py.j2", 89, None,
    "tokens sorted by expert on the device, gate-up GEMM (+ silu * up + 1x128 quant), down GEMM, weighted combine",
    tile_knobs=GEMM_KNOBS | {"split_k"}, options=Options, shared_bytes=shared_bytes, problems=problems, min_block_m=16,
    launch=launch, tune_grid={"decode": {"fuse_act": (False, True), "swap_ab": (False, True),
                                         "down_num_stages": (None, 3)},
                              "mid": {"fuse_act": (False, True)}, "prefill": {"fuse_act": (False, True)}})
