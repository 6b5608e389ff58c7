"""moe_w4a16/sorted: a W4A16 MoE layer (GPTQ / AWQ int4 experts, Qwen3-MoE) with tokens sorted by expert on the
device (sm_80+).

One module, four launches (three for T * k * 4 <= E, two more with act-order, two more where the routing takes its
three steps), no host sync: moe_fp8/sorted's routing kernels (kdsl/kernels/moe_routing.py) sort the (token, slot)
assignments by expert and pad each expert's run to block_m rows (or, for a few assignments over many experts, are
skipped: each assignment a block of its own); the gate-up GEMM reads each sorted row's token straight from x (no
gathered copy), dequantizes the expert's int4 gate and up tiles in registers (prepared weights: common W4A16 layout,
w4a16/prepared.py.j2), multiplies on fp16/bf16 tensor cores with fp32 accumulation and writes h = silu(gate) * up in
x's dtype; the down GEMM does the same on h and stores each row at its assignment; the combine kernel sums each
token's slots with the router weights in fp32. Act-order checkpoints keep one permutation of K per expert (and per
gate / up half): a gather kernel writes each sorted row's x (h) in its expert's K order once, whole rows at a time,
and the GEMMs read those rows contiguously.

Tiles are chosen per M bucket where M is tokens per routed expert, ceil(T * k / min(T * k, E)).
"""
import torch

from kdsl.kernels.base import GEMM_KNOBS, KernelImpl, Launch
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options
from kdsl.kernels.host import cdiv, next_power_of_two
from kdsl.kernels.moe_routing import combine, one_per_block, route
from kdsl.kernels.w4a16.common import MAGIC, needs_layout


def shared_bytes(scheme, tile, options) -> int:
    # Per stage: the activation tile (2 bytes an element) and the gate and up word tiles (half a byte a weight);
    # plus the two dequantized [block_k, block_n] operands the dot may stage once.
    operands = tile.block_m * tile.block_k * 2 + 2 * (tile.block_k * tile.block_n // 2)
    return tile.num_stages * operands + 2 * tile.block_k * tile.block_n * 2


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    return needs_layout(f"{where}.layout", variant, "checkpoint")


def _gather_warps(k_pad: int) -> int:
    return max(1, min(8, k_pad // 256))  # about 8 elements a thread for rows up to 2048, 16-32 above


def _gather(generated, src, perm, rows, block_expert, meta, topk: int, block_m: int, by_token: bool):
    """(dst [S, max_rows, K], its launch) (S = perm's segments): each sorted row's activation in its expert's K
    order, one gather kernel launch over all max_rows rows (those past the rows used return)."""
    segments, k = perm.shape[1], perm.shape[2]
    dst = torch.empty((segments, rows.shape[0], k), dtype=src.dtype, device=src.device)
    k_pad = next_power_of_two(k)
    return dst, Launch(generated.kernels["_gather"], (rows.shape[0], 1, 1), (
        src, perm, dst, rows, block_expert, meta, k, topk, src.stride(0), perm.stride(0), perm.stride(1),
        dst.stride(0), dst.stride(1),
    ), dict(SEGMENTS=segments, BY_TOKEN=by_token, BLOCK_M=block_m, K_PAD=k_pad, num_warps=_gather_warps(k_pad)))


def launch(generated, x, w13_qweight, w13_zeros, w13_scales, w13_perm, w2_qweight, w2_zeros, w2_scales, w2_perm,
           topk_weights, topk_ids, y, on_routed, tile):
    """x [T, H] fp16/bf16 (unit stride along H); w13 (K = H, N = 2I: gate columns, then up columns) and w2 (K = I,
    N = H) as qweight int32 [E, K / PACK, N], zeros, scales [E, G, N] (LAYOUT), perm int32 [E, S, K] or None (S = 2
    for w13's gate and up halves, or 1; 1 for w2), unit stride along N; topk_weights fp32 [T, k], topk_ids int32
    [T, k]; y [T, H] in x's dtype (contiguous). T, k >= 1.

    on_routed(outside): None, or called with a one-element int32 tensor, the number of ids outside [0, E), after the
    routing kernels and before the GEMMs are launched (the op's check of topk_ids; it may raise)."""
    T, H = x.shape
    E, inter = w13_qweight.shape[0], w13_qweight.shape[2] // 2
    topk = topk_ids.shape[1]
    block_m, block_n, block_k = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    device = x.device
    cpu = device.type == "cpu"
    # Act-order's gather kernel reads the routing kernels' rows: only calls without it skip them.
    one_each = one_per_block(T * topk, E) and w13_perm is None and w2_perm is None
    rows, block_expert, meta, max_rows, max_blocks, _ = yield from route(generated, topk_ids, E, block_m, on_routed,
                                                                         one_each)
    routing = (rows, block_expert, meta, topk_ids)

    magic_bits, magic_bias = MAGIC[x.dtype]
    group_size = generated.constexprs["GROUP_SIZE"]
    uniform = group_size % block_k == 0  # every K tile inside one group
    gemm = dict(UNIFORM_GROUP=uniform, GROUP_SIZE=group_size,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=tile["GROUP_M"],
                N_MAJOR=tile["tile_order"] == "n_major", MAGIC_BITS=magic_bits, MAGIC_BIAS=magic_bias,
                FP32_MATH=cpu, ASM_DEQUANT=not cpu and uniform and block_m >= 64,  # as w4a16_gemm/mma
                num_warps=tile["num_warps"], num_stages=tile["num_stages"])

    h = torch.empty((max_rows, inter), dtype=x.dtype, device=device)
    if w13_perm is not None:  # act-order: x's sorted rows gathered once ([S, max_rows, H]), read contiguously
        x, gather = _gather(generated, x, w13_perm, rows, block_expert, meta, topk, block_m, by_token=True)
        yield gather
    up_apart = w13_perm is not None and w13_perm.shape[1] > 1
    yield Launch(generated.kernel, (max_blocks * cdiv(inter, block_n), 1, 1), (
        x, w13_qweight, w13_zeros, w13_scales, h, *routing, inter, H, topk, E, max_blocks,
        topk_ids.stride(0), topk_ids.stride(1), x.stride(-2), x.stride(0) if up_apart else 0,
        w13_qweight.stride(0), w13_qweight.stride(1), w13_zeros.stride(0), w13_zeros.stride(1),
        w13_scales.stride(0), w13_scales.stride(1), h.stride(0),
    ), dict(GATHERED=w13_perm is not None, UP_APART=up_apart, ONE_PER_BLOCK=one_each, **gemm))

    out = torch.empty((T * topk, H), dtype=y.dtype, device=device)
    if w2_perm is not None:  # act-order: h gathered once into the down expert's K order
        h, gather = _gather(generated, h, w2_perm, rows, block_expert, meta, topk, block_m, by_token=False)
        h = h[0]
        yield gather
    yield Launch(generated.kernels["_down"], (max_blocks * cdiv(H, block_n), 1, 1), (
        h, w2_qweight, w2_zeros, w2_scales, out, *routing, H, inter, topk, E, max_blocks,
        topk_ids.stride(0), topk_ids.stride(1), h.stride(0), w2_qweight.stride(0), w2_qweight.stride(1),
        w2_zeros.stride(0), w2_zeros.stride(1), w2_scales.stride(0), w2_scales.stride(1), out.stride(0),
    ), dict(ONE_PER_BLOCK=one_each, **gemm))
    yield combine(generated, out, topk_weights, topk_ids, y, E)


IMPL = KernelImpl(
    "w4a16", "moe_w4a16", "sorted", "w4a16/moe_sorted.py.j2", 80, None,
    "tokens sorted by expert on the device, int4 gate-up GEMM (+ silu * up), int4 down GEMM, weighted combine",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=shared_bytes, problems=problems,
    reads_prepared_weights=True, min_block_m=16, launch=launch)
