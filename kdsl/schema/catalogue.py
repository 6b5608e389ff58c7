"""The kernel implementations kdsl can render, and what each needs from the hardware.

A definition's variant names an (op, impl) pair from this catalogue; validation
checks the variant's arch range and tiles against the entry. This is the
schema's view of the templates: the codegen maps each entry to its template.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Tile fields every implementation honours; others must be listed in `knobs`.
BASE_KNOBS = frozenset({"m_max", "num_warps"})


@dataclass(frozen=True)
class KernelImpl:
    family: str  # scheme kind it serves
    op: str
    impl: str
    template: str
    min_arch: int  # hardware floor, e.g. 89 for fp8 tensor cores
    max_arch: int | None  # hardware cap, e.g. 90 for wgmma
    knobs: frozenset[str]
    shared_bytes: Callable[[object, object], int]  # (scheme, tile) -> estimated bytes per program
    summary: str
    reads_prepared_weights: bool = False  # its variants must declare a `layout`
    min_block_m: int = 1  # 16 where block_m rows feed an MMA (tl.dot's smallest M)
    gemv_block_m: bool = False  # block_m = 1 selects a CUDA-core GEMV instead of the MMA


def _no_shared(scheme, tile) -> int:
    return 0


def _fp8_gemm_shared(scheme, tile) -> int:
    # fp8 operands are one byte; a ring of num_stages (A, B) tile pairs.
    return tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k


def _fp8_gemm_tma_shared(scheme, tile) -> int:
    # The TMA ring plus the bf16 epilogue tile staged for the store; edge tiles stage up to half a tile more
    # (an edge wider than half a tile uses the whole tile's buffers).
    epilogue = tile.block_m * tile.block_n * 2
    return _fp8_gemm_shared(scheme, tile) + epilogue + (epilogue // 2 if tile.edge_tiles else 0)


def _w4a16_gemm_shared(scheme, tile) -> int:
    if tile.block_m == 1:
        return 0  # the GEMV keeps its weights in registers and stages nothing through shared memory
    # fp16 activations (2 bytes) and packed int4 weights (half a byte) per stage.
    return tile.num_stages * (tile.block_m * tile.block_k * 2 + tile.block_k * tile.block_n // 2)


# n_min: GEMM call sites pass N to the tile selection (kdsl.runtime KernelEntry.tile_for).
GEMM_KNOBS = frozenset({"block_m", "block_n", "block_k", "group_m", "num_stages", "n_min"})

CATALOGUE: tuple[KernelImpl, ...] = (
    KernelImpl("block_fp8", "act_quant", "rowwise", "block_fp8/act_quant.py.j2", 89, None,
               frozenset({"block_m"}), _no_shared, "per-token, per-group amax scaling to e4m3"),
    KernelImpl("block_fp8", "weight_quant", "blockwise", "block_fp8/weight_quant.py.j2", 89, None,
               frozenset(), _no_shared, "one program per weight block, amax scaling to e4m3"),
    KernelImpl("block_fp8", "weight_dequant", "blockwise", "block_fp8/weight_dequant.py.j2", 89, None,
               frozenset(), _no_shared, "one program per weight block, fp8 x scale"),
    KernelImpl("block_fp8", "fp8_gemm", "portable", "block_fp8/fp8_gemm_portable.py.j2", 89, None,
               GEMM_KNOBS | {"tile_order"}, _fp8_gemm_shared,
               "pointer loads, grouped tile order, fp32 accumulation with per-step scales", min_block_m=16),
    KernelImpl("block_fp8", "fp8_gemm", "tma_persistent", "block_fp8/fp8_gemm_tma.py.j2", 90, 90,
               GEMM_KNOBS | {"tile_order", "persistent", "warp_specialize", "split_k", "split_fill", "split_min_steps",
                             "swap_ab", "deferred_rescale", "edge_tiles"}, _fp8_gemm_tma_shared,
               "TMA tensor descriptors, persistent grid over SMs, wgmma through Triton; block_m = 1 is a "
               "CUDA-core GEMV; deferred_rescale tiles overlap wgmma and rescale in Gluon",
               min_block_m=16, gemv_block_m=True),
    KernelImpl("gptq", "gptq_gemm", "splitk", "gptq/gptq_gemm.py.j2", 80, None,
               GEMM_KNOBS | {"split_k"}, _w4a16_gemm_shared,
               "W4A16: unpack int4 in registers, fp16/bf16 tensor-core dot, optional split-K with atomics",
               min_block_m=16),
    KernelImpl("gptq", "gptq_gemm_prepared", "splitk", "gptq/gptq_gemm_prepared.py.j2", 80, None,
               GEMM_KNOBS | {"split_k", "split_fill", "split_min_steps", "overlap_dequant", "mma_gemv"},
               _w4a16_gemm_shared,
               "W4A16 on prepared weights: one load per 8 weights, magic-number dequant, split-K reduced "
               "in-kernel; block_m = 1 is a CUDA-core GEMV, or an mma.sync one in Gluon (mma_gemv, k_planes); "
               "overlap_dequant tiles (Hopper, k_planes) overlap dequant and wgmma in Gluon",
               reads_prepared_weights=True, min_block_m=16, gemv_block_m=True),
    KernelImpl("gptq", "gptq_dequant", "blockwise", "gptq/gptq_dequant.py.j2", 80, None,
               frozenset({"block_n", "block_k"}), _no_shared, "unpack int4 checkpoint tensors to [N, K]"),
)


def find_impl(op: str, impl: str) -> KernelImpl | None:
    for entry in CATALOGUE:
        if entry.op == op and entry.impl == impl:
            return entry
    return None


def ops_of_family(family: str) -> list[str]:
    return sorted({entry.op for entry in CATALOGUE if entry.family == family})
