"""What the ops' example calls share (kdsl.ops.spec.OpSpec.example): empty tensors, and the shapes of a call that
reaches the whole of a tile's code. Only shapes, dtypes and strides matter: launch functions read nothing else."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# MoE layers as DeepSeek-V3's: 256 experts (the routing kernel pads them to 512), hidden size 7168.
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER = 256, 7168, 2048


def empty(device, *shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def split_steps(tile: dict) -> int:
    """K steps enough that a launch takes the tile's whole split: kdsl.kernels.host.split_for caps a split at K steps
    over split_min_steps and, with SMs to fill, takes the smallest of the splits that finish soonest, so each split
    up to the tile's must shorten its programs by a step."""
    split = tile.get("SPLIT_K") or 1
    return split * min(split, 32) * (tile.get("split_min_steps") or 1)


def gemm_shape(tile: dict) -> tuple[int, int, int]:
    """M, N, K of a GEMM call: one row of tiles, N one and a half tiles (a half-width last column, which
    fp8_gemm/deferred_gluon's edge_tiles give tiles of their own) and K long enough for the tile's split."""
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    return bm, bn + bn // 2, max(tile.get("BLOCK_K") or 128, 128) * split_steps(tile)


def fp8_operands(device, lead: tuple, m: int, n: int, k: int, out: torch.dtype) -> tuple:
    """a [*lead, m, k], a_s, b [*lead, n, k], b_s, c [*lead, m, n] of the block-FP8 GEMMs (128-wide scale groups)."""
    return (empty(device, *lead, m, k, dtype=FP8), empty(device, *lead, m, k // 128, dtype=torch.float32),
            empty(device, *lead, n, k, dtype=FP8), empty(device, *lead, -(-n // 128), k // 128, dtype=torch.float32),
            empty(device, *lead, m, n, dtype=out))


def int4_weights(device, *lead: int, k: int, n: int, out: torch.dtype) -> tuple:
    """qweight int32 [*lead, K / 8, N], zeros and scales [*lead, G, N] in the activation dtype; scales are the low
    halves of (scale, zero) pairs, as the paired layout views them (other layouts' launches read their strides)."""
    groups = max(1, k // 32)
    pairs = empty(device, *lead, groups, n, 2, dtype=out)
    return empty(device, *lead, k // 8, n, dtype=torch.int32), empty(device, *lead, groups, n, dtype=out), pairs[..., 0]


def moe_routing(device, tokens: int = 4, topk: int = 8) -> tuple:
    """topk_weights fp32 [T, k] and topk_ids int32 [T, k]."""
    return empty(device, tokens, topk, dtype=torch.float32), empty(device, tokens, topk, dtype=torch.int32)
