"""moe_w4a16/sorted: a W4A16 MoE layer (GPTQ / AWQ int4 experts, Qwen3-MoE) with tokens sorted by expert on the
device (sm_80+).

One module, four launches (six with act-order), no host sync: moe_fp8/sorted's routing kernel (common/moe_routing.py.j2) sorts the
(token, slot) assignments by expert and pads each expert's run to block_m rows; the gate-up GEMM reads each sorted
row's token straight from x (no gathered copy), dequantizes the expert's int4 gate and up tiles in registers
(prepared weights: common W4A16 layout, w4a16/prepared.py.j2), multiplies on fp16/bf16 tensor cores with fp32
accumulation and writes h = silu(gate) * up in x's dtype; the down GEMM does the same on h and stores each row at
its assignment; the combine kernel sums each token's slots with the router weights in fp32. Act-order checkpoints
keep one permutation of K per expert (and per gate / up half): a gather kernel writes each sorted row's x (h) in
its expert's K order once, whole rows at a time, and the GEMMs read those rows contiguously.

Tiles are chosen per M bucket where M is tokens per routed expert, ceil(T * k / min(T * k, E)).
"""
from kdsl.kernels.base import GEMM_KNOBS, KernelImpl
from kdsl.kernels.block_fp8.fp8_gemm_portable import Options
from kdsl.kernels.w4a16.common import needs_layout


def shared_bytes(scheme, tile, options) -> int:
    # Per stage: the activation tile (2 bytes an element) and the gate and up word tiles (half a byte a weight);
    # plus the two dequantized [block_k, block_n] operands the dot may stage once.
    operands = tile.block_m * tile.block_k * 2 + 2 * (tile.block_k * tile.block_n // 2)
    return tile.num_stages * operands + 2 * tile.block_k * tile.block_n * 2


def problems(where: str, scheme, variant, tile, options) -> list[str]:
    return needs_layout(f"{where}.layout", variant, "checkpoint")


IMPL = KernelImpl(
    "w4a16", "moe_w4a16", "sorted", "w4a16/moe_sorted.py.j2", 80, None,
    "tokens sorted by expert on the device, int4 gate-up GEMM (+ silu * up), int4 down GEMM, weighted combine",
    tile_knobs=GEMM_KNOBS, options=Options, shared_bytes=shared_bytes, problems=problems,
    reads_prepared_weights=True, min_block_m=16)
