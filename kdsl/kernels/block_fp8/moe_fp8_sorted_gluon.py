"""moe_fp8/sorted_gluon (Hopper, Gluon): moe_fp8/sorted's layer with each expert's rows one contiguous TMA block.

The routing kernels sort the (token, slot) assignments by expert and pad each expert's run to block_m rows, as in
moe_fp8/sorted; here x is quantized per token (act_quant's rule) and copied to each of its sorted rows, so a block
of block_m rows is one TMA box of one expert, and both GEMMs run fp8_gemm/deferred_gluon's loop (block k's wgmma
overlapped with block k - 1's rescale) over the experts' weights stacked as [E * N, K]: the gate-up GEMM writes the
fp32 products through TMA (with bf16 products this unit's GPU tests against the fp32 reference failed), the
activation kernel quantizes silu(gate) * up, the down GEMM stores each row at its assignment, the combine kernel
sums each token's slots. Six launches (eight where the routing takes its three steps), no host sync, one CUDA graph
for any routing (grids sized for the worst). For prefill, where the portable unit's pointer-loaded tl.dot waits for
every wgmma before it rescales.
Gluon has no interpreter: on the CPU `refusal` passes the call to the definition's next tile (moe_fp8/sorted).
"""
import torch

from kdsl.kernels.base import KernelImpl, Launch, NoOptions, warpgroup_per_64
from kdsl.kernels.block_fp8.fp8_gemm_portable import one_scale_per_k_block
from kdsl.kernels.block_fp8.moe_fp8_sorted import QUANT_ROWS
from kdsl.kernels.host import cdiv, gluon_descriptor
from kdsl.kernels.moe_routing import combine, route


def shared_bytes(scheme, tile, options) -> int:
    # The TMA ring (A and B fp8 per stage) plus the gate-up GEMM's fp32 tile staged for its TMA store.
    return tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k + tile.block_m * tile.block_n * 4


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    found = warpgroup_per_64(where, "rows", "block_m", tile.block_m, tile.num_warps)
    return found + one_scale_per_k_block(where, scheme, tile)


def refusal(generated, tile, call):
    """Why this kernel should not serve `call`, None where it should; the definition's next tile then runs."""
    if call.device_type != "cuda":
        return "a Gluon kernel, which runs on the GPU only (Gluon has no interpreter)"
    if call.align < 16:
        return f"TMA reads the weights: needs 16-byte aligned bases and row strides (these: {call.align})"
    if not call.stacked:
        return "one TMA descriptor reads each weight as [E * N, K]: needs the experts' [N, K] slabs stacked"
    return None


def _as_matrix(w):
    """w [E, N, K] (unit stride along K, its experts stacked: the refusal keeps other weights off this unit) as the
    [E * N, K] matrix the TMA descriptors read."""
    E, N, K = w.shape
    return w.as_strided((E * N, K), (w.stride(1), 1))


def launch(generated, x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, y, on_routed, tile):
    """moe_fp8/sorted's launch contract (kdsl/kernels/block_fp8/moe_fp8_sorted.py), on the GPU; the refusal keeps
    operands that TMA cannot read (16-byte aligned bases and row strides) on the next tile."""
    T, H = x.shape
    E, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    block_m, block_n, block_k = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    device = x.device
    fp8 = w13.dtype
    act_group = generated.module.ACT_GROUP.value
    kernels = generated.kernels

    rows, block_expert, meta, max_rows, max_blocks, slot_rows = yield from route(generated, topk_ids, E, block_m,
                                                                                 on_routed)

    xq = torch.empty((max_rows, H), dtype=fp8, device=device)
    xs = torch.empty((max_rows, H // act_group), dtype=torch.float32, device=device)
    yield Launch(kernels["_quant"], (cdiv(T, QUANT_ROWS), H // act_group, 1), (
        x, xq, xs, slot_rows, T, topk, H, x.stride(0),
    ), dict(BLOCK_M=QUANT_ROWS, ROUND_FIRST=False, num_warps=2))

    gemm = dict(GROUP_M=tile["GROUP_M"], NUM_STAGES=tile["num_stages"], num_warps=tile["num_warps"])
    gate_up = torch.empty((max_rows, two_inter), dtype=torch.float32, device=device)
    a_desc = gluon_descriptor(xq, (block_m, block_k))
    yield Launch(generated.kernel, (max_blocks * cdiv(two_inter, block_n), 1, 1), (
        a_desc, gluon_descriptor(_as_matrix(w13), (block_n, block_k)),
        gluon_descriptor(gate_up, (block_m, block_n)), xs, w13_s, gate_up, rows, block_expert, meta,
        two_inter, H, max_blocks, xs.stride(0), w13_s.stride(0), w13_s.stride(1), gate_up.stride(0),
    ), dict(SCATTER=False, **gemm))

    hq = torch.empty((max_rows, inter), dtype=fp8, device=device)
    hs = torch.empty((max_rows, inter // act_group), dtype=torch.float32, device=device)
    yield Launch(kernels["_act"], (max_blocks, inter // act_group, 1), (
        gate_up, hq, hs, rows, slot_rows, meta, inter, 0, gate_up.stride(0), hq.stride(0), hs.stride(0),
    ), dict(BLOCK_M=block_m, SPLIT_K=1, ONE_PER_BLOCK=False, PER_ASSIGNMENT=False, ROUND_FIRST=False, num_warps=4))

    out = torch.empty((T * topk, H), dtype=y.dtype, device=device)
    h_desc = gluon_descriptor(hq, (block_m, block_k))
    # The down GEMM stores from registers (c_desc unused): the gate-up's A descriptor stands in for it.
    yield Launch(generated.kernel, (max_blocks * cdiv(H, block_n), 1, 1), (
        h_desc, gluon_descriptor(_as_matrix(w2), (block_n, block_k)), h_desc, hs, w2_s, out, rows,
        block_expert, meta, H, inter, max_blocks, hs.stride(0), w2_s.stride(0), w2_s.stride(1), out.stride(0),
    ), dict(SCATTER=True, **gemm))
    yield combine(generated, out, topk_weights, topk_ids, y, E)


IMPL = KernelImpl(
    "block_fp8", "moe_fp8", "sorted_gluon", "block_fp8/moe_fp8_sorted_gluon.py.j2", 90, 90,
    "Gluon: tokens sorted by expert and quantized per sorted row, TMA-fed gate-up and down GEMMs with the wgmma "
    "overlapped with the rescale; GPU only",
    tile_knobs=frozenset({"block_m", "block_n", "block_k", "group_m", "num_stages", "n_min"}), options=NoOptions,
    shared_bytes=shared_bytes, problems=problems, min_block_m=64, launch=launch, refusal=refusal)
