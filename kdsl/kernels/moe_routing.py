"""The MoE layers' routing and combine launches (moe_fp8/sorted, moe_w4a16/sorted; their kernels:
common/moe_routing_kernels.py.j2, named after the module): generators of launches, for a unit's launch to
`yield from`, since the host work after the routing launches (on_routed) needs them enqueued."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kdsl.kernels.base import Launch
from kdsl.kernels.host import cdiv, next_power_of_two

# Launch shapes of the routing and combine kernels: a few microseconds each at decode.
# Assignments per program of the routing steps (a call of one chunk runs them in one program): the placing
# compares a chunk's assignments pairwise, CHUNK x CHUNK in registers.
ALIGN_CHUNK = 128
ALIGN_SCAN_STEPS = dict(CHUNKS_PER_STEP=64, STEP=16)  # the scan's tiles: chunks' counts, blocks and rows per step
ALIGN_SCAN_WARPS = 8  # the scan alone (13 us at T = 4096 on an H200); the one-program kernel keeps four
COMBINE_COLS = 512  # hidden columns per program of the combine


def routing_rows(assignments: int, num_experts: int, block_m: int) -> int:
    """Sorted rows to allocate: at most min(assignments, E) experts are routed to, each run padded by up to
    block_m - 1 rows; a multiple of block_m. The grids cover these; programs past the rows used return."""
    bound = assignments + min(assignments, num_experts) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def one_per_block(assignments: int, num_experts: int) -> bool:
    """Whether a layer's few assignments skip the routing kernel, each one block of its own (vLLM's naive block
    assignment, for T * k * 4 <= E): at most a quarter of the experts are routed to, so blocks seldom share an
    expert, and one launch less is worth more than the weights an expert routed twice reads again."""
    return assignments * 4 <= num_experts


class Routing(NamedTuple):
    """What the routing kernels write, sized on the host for the worst routing: rows [max_rows] (the assignment
    t * k + j each sorted row holds, -1: padding), block_expert [max_blocks], meta ([rows used, ids outside
    [0, E), each expert's first row]) and slot_rows [T * k] (the sorted row of each assignment, -1 for an id
    outside [0, E))."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    meta: torch.Tensor
    max_rows: int
    max_blocks: int
    slot_rows: torch.Tensor | None


def route(generated, topk_ids, num_experts: int, block_m: int, on_routed, one_block_each: bool = False):
    """Launch the routing kernels (one program for a call of one chunk of assignments, else count, scan and place);
    returns their Routing, on topk_ids' device. on_routed: None, or called with the count of ids outside [0, E) (a
    one-element int32 tensor) before anything else is launched.

    one_block_each (one_per_block's case): no routing kernel; block b holds assignment b alone and the kernels read
    its expert from topk_ids (rows, block_expert and meta are then topk_ids, unread, and slot_rows None; the count
    for on_routed is computed by torch, where a check wants it)."""
    assignments = topk_ids.shape[0] * topk_ids.shape[1]
    if one_block_each:
        if on_routed is not None:
            on_routed(((topk_ids < 0) | (topk_ids >= num_experts)).sum(dtype=torch.int32).reshape(1))
        return Routing(topk_ids, topk_ids, topk_ids, assignments * block_m, assignments, None)
    max_rows = routing_rows(assignments, num_experts, block_m)
    max_blocks = max_rows // block_m
    chunks = cdiv(assignments, ALIGN_CHUNK)
    experts_pad = max(16, next_power_of_two(num_experts))
    index = torch.empty(max_rows + max_blocks + 2 + experts_pad + assignments + chunks * experts_pad,
                        dtype=torch.int32, device=topk_ids.device)
    rows, block_expert, meta, slot_rows, counts = index.split((max_rows, max_blocks, 2 + experts_pad, assignments,
                                                              chunks * experts_pad))
    counted = (assignments, topk_ids.shape[1], num_experts, topk_ids.stride(0), topk_ids.stride(1))
    per_chunk = dict(EXPERTS_PAD=experts_pad, CHUNK=ALIGN_CHUNK, num_warps=4)
    scan = dict(BLOCK_M=block_m, EXPERTS_PAD=experts_pad, **ALIGN_SCAN_STEPS, num_warps=ALIGN_SCAN_WARPS)
    if chunks == 1:
        # One program: as many lanes as the assignments need.
        lanes = max(16, next_power_of_two(assignments))
        yield Launch(generated.kernels["_align"], (1, 1, 1), (
            topk_ids, rows, block_expert, meta, slot_rows, counts, max_blocks, *counted),
            dict(scan, CHUNK=lanes, num_warps=4))
    else:
        yield Launch(generated.kernels["_align_count"], (chunks, 1, 1), (topk_ids, counts, *counted), per_chunk)
        yield Launch(generated.kernels["_align_scan"], (1, 1, 1), (
            counts, rows, block_expert, meta, chunks, assignments, num_experts, max_blocks), scan)
        yield Launch(generated.kernels["_align_place"], (chunks, 1, 1), (
            topk_ids, counts, meta, rows, slot_rows, *counted), per_chunk)
    if on_routed is not None:
        on_routed(meta[1:2])
    return Routing(rows, block_expert, meta, max_rows, max_blocks, slot_rows)


def combine(generated, out, topk_weights, topk_ids, y, num_experts: int) -> Launch:
    """y [T, H] = each token's routed rows of out [T * k, H], weighted and summed in fp32 (the combine kernel)."""
    tokens, hidden = y.shape
    return Launch(generated.kernels["_combine"], (tokens, cdiv(hidden, COMBINE_COLS), 1), (
        out, topk_weights, topk_ids, y, hidden, topk_ids.shape[1], num_experts, out.stride(0),
        topk_weights.stride(0), topk_weights.stride(1), topk_ids.stride(0), topk_ids.stride(1), y.stride(0),
    ), dict(BLOCK_N=COMBINE_COLS, num_warps=4))
