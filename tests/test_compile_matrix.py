"""Every generated kernel compiles, ahead of time and on the CPU, for every arch it claims.

For each manifest entry, each arch in {sm_80, sm_86, sm_89, sm_90} inside the entry's
[min_arch, max_arch], and each of its tile buckets, build the Triton signature the entry's
launch() would produce and run

    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))

No GPU is needed: Triton lowers to PTX and runs its bundled ptxas.

The compiles run in worker subprocesses (this file run as a script), not in the pytest process:
conftest sets TRITON_INTERPRET=1 before triton is imported, which turns every @triton.jit function,
triton.language's own helpers included, into an interpreted one that cannot be compiled. A
module-scoped fixture sends the selected compile jobs to two workers (one per core), which write
each kernel's PTX to a folder; the tests then assert on the results.

The signatures are data (SIGNATURES below): one row per (op, impl), naming every runtime argument
with its Triton type and every constexpr with where launch() takes it from. A row that no longer
matches the kernel's parameters fails loudly, so a template change cannot silently skip this test.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from kdsl.codegen.render import tile_params
from kdsl.kernels import find_impl
from kdsl.runtime.manifest import KernelEntry, load_manifest
from kdsl.schema.tiling import Tile

pytestmark = pytest.mark.slow

COMPILE_ARCHS = (80, 86, 89, 90)
FULL_GPTQ_SCHEMES = ("gptq.int4.g128.gptq", "w4a16.int4.g128")

# ---------------------------------------------------------------------------------------------
# Signatures, as launch() in each generated module calls the kernel.
#
# args:       runtime argument -> Triton type; "{KEY}" is filled from the tile's launch parameters
#             and "{out}" with the output element type, e.g. "tensordesc<fp8e4nv[{BLOCK_M}, {BLOCK_K}]>".
# constexprs: constexpr parameter -> the tile key launch() passes to it, or a function of the tile; the
#             entry's scheme constexprs (GROUP_SIZE, ZERO_OFFSET) are keys of the tile here too.
# options:    tile keys launch() passes as compile options (num_warps, num_stages).

TileFn = Callable[[dict], object]


@dataclass(frozen=True)
class KernelSignature:
    args: dict[str, str]
    constexprs: dict[str, str | TileFn] = field(default_factory=dict)
    options: tuple[str, ...] = ("num_warps",)
    out_types: tuple[str, ...] = ("bf16",)  # "{out}" values that launch() may be given
    # Integer arguments the op's checks always make multiples of 16, which Triton's JIT specializes
    # on (and vectorizes loads by); the matrix compiles with that specialization too.
    aligned_ints: tuple[str, ...] = ()
    gluon: bool = False  # a Gluon kernel: compiled from a GluonASTSource, descriptors carry their layout
    fixed: dict = field(default_factory=dict)  # compile options launch() sets itself, not from the tile

    def build(self, tile: dict, out: str) -> tuple[dict, dict, dict]:
        """(signature, constexprs, compile options) for one tile and output type. An argument's type may be a
        function of the tile (an output whose dtype an option picks)."""
        constexprs = {name: (tile[src] if isinstance(src, str) else src({**tile, "out": out}))
                      for name, src in self.constexprs.items()}
        # An edge tile's descriptors are the whole tile's when the kernel has no edge (EDGE_N = 0).
        blocks = {"EDGE_BLOCK_N": constexprs.get("EDGE_N") or tile.get("BLOCK_N")}
        signature = {name: (kind if isinstance(kind, str) else kind(tile)).format(out=out, **tile, **blocks)
                     for name, kind in self.args.items()}
        signature.update({name: "constexpr" for name in constexprs})
        options = {**{key: tile[key] for key in self.options}, **self.fixed}
        return signature, constexprs, options


FP8 = "*fp8e4nv"
F32 = "*fp32"
I32 = "i32"
# The TMA descriptors of the sm_90 FP8 GEMM, shared by its Triton and Gluon kernels.
FP8_GEMM_DESCRIPTORS = {"a_desc": "tensordesc<fp8e4nv[{BLOCK_M}, {BLOCK_K}]>",
                        "b_desc": "tensordesc<fp8e4nv[{BLOCK_N}, {BLOCK_K}]>",
                        "c_desc": "tensordesc<{out}[{BLOCK_M}, {BLOCK_N}]>"}
GEMM_BLOCKS = {"BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K", "GROUP_M": "GROUP_M",
               "N_MAJOR": lambda tile: tile["tile_order"] == "n_major"}

# The prepared W4A16 kernels' pointer and integer arguments ("{out}" is the activation dtype).
W4A16_ARGS = {"x_ptr": "*{out}", "perm_ptr": "*i32", "qw_ptr": "*i32", "z_ptr": "*{out}", "s_ptr": "*{out}",
              "g_ptr": "*i32", "y_ptr": "*{out}", "ws_ptr": F32, "count_ptr": "*i32",
              "M": I32, "N": I32, "K": I32,
              "stride_xm": I32, "stride_qwk": I32, "stride_zg": I32, "stride_sg": I32, "stride_ym": I32}

# The W4A16 MoE GEMMs' weight, routing and integer arguments, and their constexprs ("{out}" is the activation dtype).
MOE_W4A16_WEIGHTS = {"qw_ptr": "*i32", "z_ptr": "*{out}", "s_ptr": "*{out}", "rows_ptr": "*i32",
                     "block_expert_ptr": "*i32", "meta_ptr": "*i32", "N": I32, "K": I32, "max_blocks": I32,
                     "stride_qwe": I32, "stride_qwk": I32, "stride_ze": I32, "stride_zg": I32,
                     "stride_se": I32, "stride_sg": I32}
MOE_W4A16_CONSTEXPRS = {
    **GEMM_BLOCKS, "UNIFORM_GROUP": lambda tile: tile["BLOCK_M"] > 16, "GROUP_SIZE": "GROUP_SIZE",
    "MAGIC_BITS": lambda tile: 0x6400 if tile["out"] == "fp16" else 0x4300,
    "MAGIC_BIAS": lambda tile: 1024 if tile["out"] == "fp16" else 128,
    "FP32_MATH": lambda tile: False, "ASM_DEQUANT": lambda tile: tile["BLOCK_M"] >= 64}

SIGNATURES: dict[tuple[str, str], KernelSignature] = {
    ("act_quant", "rowwise"): KernelSignature(
        args={"x_ptr": "*bf16", "q_ptr": FP8, "s_ptr": F32, "M": I32, "K": I32, "stride_xm": I32},
        constexprs={"BLOCK_M": "BLOCK_M", "ROUND_FIRST": lambda tile: False},
    ),
    # The gated MLP's activation (kernel_defs/silu_mul.toml): "{out}" is gate_up's dtype (and h's).
    ("silu_mul", "rowwise"): KernelSignature(
        args={"gu_ptr": "*{out}", "h_ptr": "*{out}", "M": I32, "I": I32, "stride_gum": I32, "stride_hm": I32},
        constexprs={"BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N"},
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("silu_mul_quant", "rowwise"): KernelSignature(
        args={"gu_ptr": "*{out}", "q_ptr": FP8, "s_ptr": F32, "M": I32, "I": I32, "stride_gum": I32,
              "stride_qm": I32, "stride_sm": I32},
        constexprs={"BLOCK_M": "BLOCK_M", "ROUND_FIRST": lambda tile: False},
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("weight_quant", "blockwise"): KernelSignature(
        args={"w_ptr": "*bf16", "q_ptr": FP8, "s_ptr": F32, "N": I32, "K": I32, "stride_wn": I32, "stride_sn": I32},
        constexprs={"ROUND_FIRST": lambda tile: False},
    ),
    ("weight_dequant", "blockwise"): KernelSignature(
        args={"q_ptr": FP8, "s_ptr": F32, "w_ptr": "*{out}", "N": I32, "K": I32,
              "stride_qn": I32, "stride_sn": I32, "stride_sk": I32},
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("fp8_gemm", "portable"): KernelSignature(
        args={"a_ptr": FP8, "b_ptr": FP8, "c_ptr": "*{out}", "as_ptr": F32, "bs_ptr": F32,
              "M": I32, "N": I32, "K": I32,
              "stride_am": I32, "stride_bn": I32, "stride_cm": I32, "stride_asm": I32, "stride_bsn": I32},
        constexprs=GEMM_BLOCKS,
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    # x in the output's dtype (bf16, fp16, fp32 alike); bias and split K taken, so both are in the compiled code.
    ("fp8_linear", "portable"): KernelSignature(
        args={"x_ptr": "*{out}", "b_ptr": FP8, "c_ptr": "*{out}", "bs_ptr": F32, "bias_ptr": "*{out}",
              "ws_ptr": F32, "count_ptr": "*i32", "M": I32, "N": I32, "K": I32,
              "stride_xm": I32, "stride_bn": I32, "stride_cm": I32, "stride_bsn": I32},
        constexprs={"BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N", "GROUP_M": "GROUP_M",
                    "N_MAJOR": lambda tile: tile["tile_order"] == "n_major",
                    "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2), "HAS_BIAS": lambda tile: True,
                    "ROUND_FIRST": lambda tile: False},
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("fp8_bmm", "portable"): KernelSignature(
        args={"a_ptr": FP8, "b_ptr": FP8, "c_ptr": "*{out}", "as_ptr": F32, "bs_ptr": F32,
              "M": I32, "N": I32, "K": I32,
              "stride_ab": I32, "stride_am": I32, "stride_bb": I32, "stride_bn": I32, "stride_cb": I32,
              "stride_cm": I32, "stride_asb": I32, "stride_asm": I32, "stride_ask": I32,
              "stride_bsb": I32, "stride_bsn": I32, "stride_bsk": I32},
        constexprs=GEMM_BLOCKS,
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    # a, b and c as 3-D boxes [1, rows, cols] of their [B, rows, cols] views.
    ("fp8_bmm", "tma_persistent"): KernelSignature(
        args={"a_desc": "tensordesc<fp8e4nv[1, {BLOCK_M}, {BLOCK_K}]>",
              "b_desc": "tensordesc<fp8e4nv[1, {BLOCK_N}, {BLOCK_K}]>",
              "c_desc": "tensordesc<{out}[1, {BLOCK_M}, {BLOCK_N}]>",
              "as_ptr": F32, "bs_ptr": F32, "b_ptr": FP8, "c_ptr": "*{out}", "B": I32, "M": I32, "N": I32, "K": I32,
              "stride_asb": I32, "stride_asm": I32, "stride_ask": I32,
              "stride_bsb": I32, "stride_bsn": I32, "stride_bsk": I32,
              "stride_bb": I32, "stride_bn": I32, "stride_cb": I32, "stride_cm": I32, "num_programs": I32},
        constexprs={**GEMM_BLOCKS, "BATCH_INNER": "batch_inner", "SWAP_AB": "swap_ab", "FLATTEN": "flatten",
                    "WARP_SPECIALIZE": "warp_specialize", "PDL": "pdl", "PREFETCH_WEIGHTS": "prefetch_weights",
                    "POINTER_STORE": lambda tile: tile["epilogue"] == "pointer"},
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("fp8_gemm", "tma_persistent"): KernelSignature(
        args={**FP8_GEMM_DESCRIPTORS,
              "as_ptr": F32, "bs_ptr": F32, "c_ptr": "*{out}", "ws_ptr": F32, "count_ptr": "*i32",
              "M": I32, "N": I32, "K": I32,
              "stride_asm": I32, "stride_bsn": I32, "stride_cm": I32, "num_programs": I32},
        constexprs={**GEMM_BLOCKS, "NUM_STAGES": "num_stages", "SPLIT_K": "SPLIT_K",
                    "WARP_SPECIALIZE": "warp_specialize", "SWAP_AB": "swap_ab"},
        options=("num_warps",),
        out_types=("bf16", "fp16", "fp32"),
    ),
    # The Gluon kernel: edge_tiles tiles compile with a half-width edge (N = 2112's), the others without one.
    ("fp8_gemm", "deferred_gluon"): KernelSignature(
        args={**FP8_GEMM_DESCRIPTORS,
              "edge_b_desc": "tensordesc<fp8e4nv[{EDGE_BLOCK_N}, {BLOCK_K}]>",
              "edge_c_desc": "tensordesc<{out}[{BLOCK_M}, {EDGE_BLOCK_N}]>",
              "as_ptr": F32, "bs_ptr": F32, "M": I32, "N": I32, "K": I32, "stride_asm": I32, "stride_bsn": I32,
              "num_programs": I32, "edge_first": I32},
        constexprs={"GROUP_M": "GROUP_M", "NUM_STAGES": "num_stages",
                    "EDGE_N": lambda tile: tile["BLOCK_N"] // 2 if tile["edge_tiles"] else 0,
                    "num_warps": "num_warps"},
        out_types=("bf16", "fp16", "fp32"),
        gluon=True,
    ),
    # GPTQ: "{out}" is the activation dtype (x, scales and y share it); g_idx is taken
    # (HAS_G_IDX) so the act-order path compiles too; split-K atomics land in fp32.
    ("gptq_gemm", "splitk"): KernelSignature(
        args={"x_ptr": "*{out}", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*{out}", "g_ptr": "*i32",
              "y_ptr": "*fp32", "M": I32, "N": I32, "K": I32,
              "stride_xm": I32, "stride_qwk": I32, "stride_qzg": I32, "stride_sg": I32, "stride_ym": I32},
        constexprs={"HAS_G_IDX": lambda tile: True, "UNIFORM_GROUP": lambda tile: False,
                    "GROUP_SIZE": "GROUP_SIZE", "ZERO_OFFSET": "ZERO_OFFSET",
                    "BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K", "GROUP_M": "GROUP_M",
                    "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2), "UPCAST_DOT": lambda tile: False},
        options=("num_warps", "num_stages"),
        out_types=("fp16", "bf16"),
    ),
    # Prepared W4A16: act-order resolved (HAS_PERM, groups contiguous) with the GPU's asm unpack;
    # split-K of at least 2 so the in-kernel reduction is in the compiled code.
    ("w4a16_gemm", "mma"): KernelSignature(
        args=W4A16_ARGS,
        constexprs={"HAS_PERM": lambda tile: True, "UNIFORM_GROUP": lambda tile: True, "GROUP_SIZE": "GROUP_SIZE",
                    "BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K", "GROUP_M": "GROUP_M",
                    "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2),
                    "MAGIC_BITS": lambda tile: 0x6400, "MAGIC_BIAS": lambda tile: 1024,
                    "FP32_MATH": lambda tile: False, "ASM_DEQUANT": lambda tile: True},
        options=("num_warps", "num_stages"),
        out_types=("fp16", "bf16"),
    ),
    ("w4a16_gemm", "planes_mma"): KernelSignature(
        args={name: kind for name, kind in W4A16_ARGS.items() if name != "stride_qwk"},
        constexprs={"HAS_PERM": lambda tile: True, "UNIFORM_GROUP": lambda tile: True,
                    "WORD_GROUPS": lambda tile: True, "GROUP_SIZE": "GROUP_SIZE",
                    "BLOCK_M": "BLOCK_M", "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K", "GROUP_M": "GROUP_M",
                    "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2),
                    "MAGIC_BITS": lambda tile: 0x6400, "MAGIC_BIAS": lambda tile: 1024,
                    "FP32_MATH": lambda tile: False, "ASM_DEQUANT": lambda tile: True,
                    "SCALE_AFTER": lambda tile: tile["BLOCK_M"] <= 16},
        options=("num_warps", "num_stages"),
        out_types=("fp16", "bf16"),
    ),
    # The CUDA-core GEMV: packed half2 dots for fp16 checkpoint-order words, as its launcher picks.
    ("w4a16_gemm", "gemv"): KernelSignature(
        args=W4A16_ARGS,
        constexprs={"HAS_PERM": lambda tile: True, "UNIFORM_GROUP": lambda tile: True,
                    "WORD_GROUPS": lambda tile: tile["weights"] != "k_planes", "GROUP_SIZE": "GROUP_SIZE",
                    "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K", "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2),
                    "MAGIC_BIAS": lambda tile: 1024, "FP32_MATH": lambda tile: False,
                    "HALF2_DOT": lambda tile: tile["out"] == "fp16" and tile["weights"] != "k_planes"},
        options=("num_warps", "num_stages"),
        out_types=("fp16", "bf16"),
    ),
    # x, the k_planes words (PLANE_ROWS = 16 per column) and the (scale, zero) pairs come by TMA.
    ("w4a16_gemm", "overlap_gluon"): KernelSignature(
        args={"x_desc": "tensordesc<{out}[{BLOCK_M}, {BLOCK_K}]>", "w_desc": "tensordesc<i32[{BLOCK_N}, 16]>",
              "p_desc": "tensordesc<i32[1, {BLOCK_N}]>", "y_ptr": "*{out}", "ws_ptr": F32, "count_ptr": "*i32",
              "M": I32, "N": I32, "K": I32, "stride_ym": I32},
        constexprs={"GROUP_M": "GROUP_M", "SPLIT_K": lambda tile: max(tile["SPLIT_K"], 2),
                    "NUM_STAGES": "num_stages", "num_warps": "num_warps", "GROUP_SIZE": "GROUP_SIZE"},
        out_types=("fp16", "bf16"),
        gluon=True,
    ),
    ("w4a16_gemm", "gemv_mma_gluon"): KernelSignature(
        args={"x_ptr": "*{out}", "perm_ptr": "*i32", "w_ptr": "*i32", "p_ptr": "*i32", "y_ptr": "*{out}",
              "M": I32, "N": I32, "stride_xm": I32, "stride_pg": I32, "stride_ym": I32},
        # K unrolls at compile time: one that is not a whole number of plane tiles, so the masks past K and
        # past the last warp's tiles are in the code, with act-order's gather of x.
        constexprs={"K": lambda tile: 4160, "CHUNK_TILES": lambda tile: tile["BLOCK_K"] // 128,
                    "HAS_PERM": lambda tile: True, "GROUP_SIZE": "GROUP_SIZE", "num_warps": "num_warps"},
        out_types=("fp16", "bf16"),
        gluon=True,
    ),
    # The MoE kernels (kernel_defs/moe_fp8.toml): grouped GEMMs in both layouts, and the MoE layer's gate-up GEMM
    # ("{out}" is x's dtype there); the layer's other kernels are in BESIDE.
    ("fp8_grouped_gemm", "portable"): KernelSignature(
        args={"a_ptr": FP8, "b_ptr": FP8, "c_ptr": "*{out}", "as_ptr": F32, "bs_ptr": F32, "group_ptr": "*i32",
              "M": I32, "N": I32, "K": I32, "E": I32, "stride_am": I32, "stride_be": I32, "stride_bn": I32,
              "stride_cm": I32, "stride_asm": I32, "stride_bse": I32, "stride_bsn": I32},
        constexprs=GEMM_BLOCKS,
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("fp8_grouped_gemm_masked", "portable"): KernelSignature(
        args={"a_ptr": FP8, "b_ptr": FP8, "c_ptr": "*{out}", "as_ptr": F32, "bs_ptr": F32, "count_ptr": "*i32",
              "MAX_M": I32, "N": I32, "K": I32, "stride_ae": I32, "stride_am": I32, "stride_be": I32, "stride_bn": I32,
              "stride_ce": I32, "stride_cm": I32, "stride_ase": I32, "stride_asm": I32, "stride_bse": I32,
              "stride_bsn": I32},
        constexprs=GEMM_BLOCKS,
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16", "fp32"),
    ),
    ("moe_fp8", "sorted"): KernelSignature(
        args={"xq_ptr": FP8, "xs_ptr": F32, "w_ptr": FP8, "ws_ptr": F32,
              "h_ptr": lambda tile: FP8 if tile["fuse_act"] else F32, "hs_ptr": F32,
              "rows_ptr": "*i32", "block_expert_ptr": "*i32", "meta_ptr": "*i32",
              "N": I32, "K": I32, "topk": I32, "max_blocks": I32, "stride_xm": I32, "stride_xsm": I32,
              "stride_we": I32, "stride_wn": I32, "stride_wse": I32, "stride_wsn": I32, "stride_hm": I32,
              "stride_hsm": I32},
        constexprs={**GEMM_BLOCKS, "FUSE_ACT": "fuse_act", "ROUND_FIRST": lambda tile: False},
        options=("num_warps", "num_stages"),
        out_types=("bf16", "fp16"),
    ),
    # The W4A16 MoE layer (kernel_defs/moe_w4a16.toml): its gate-up GEMM ("{out}" is x's dtype, h's and the scales');
    # routing, act-order's gather, down GEMM and combine are in BESIDE. Act-order's gathered rows are compiled in
    # (GATHERED, gate and up apart); the decode tile compiles the per-row group lookup (group_size < block_k), the
    # others one group per K tile and, from 64 rows, the PTX unpack, as launch() picks them.
    ("moe_w4a16", "sorted"): KernelSignature(
        args={**MOE_W4A16_WEIGHTS, "x_ptr": "*{out}", "h_ptr": "*{out}", "topk": I32, "stride_xm": I32,
              "stride_xup": I32, "stride_hm": I32},
        constexprs={**MOE_W4A16_CONSTEXPRS, "GATHERED": lambda tile: True, "UP_APART": lambda tile: True},
        options=("num_warps", "num_stages"),
        out_types=("fp16", "bf16"),
    ),
    ("gptq_dequant", "blockwise"): KernelSignature(
        args={"qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*{out}", "g_ptr": "*i32", "w_ptr": "*{out}",
              "N": I32, "K": I32, "stride_qwk": I32, "stride_qzg": I32, "stride_sg": I32},
        constexprs={"HAS_G_IDX": lambda tile: False, "UNIFORM_GROUP": lambda tile: True,
                    "GROUP_SIZE": "GROUP_SIZE", "ZERO_OFFSET": "ZERO_OFFSET",
                    "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K"},
        out_types=("fp16", "bf16"),
    ),
    # Prepared weights to w [N, K] (w4a16_gemm's dequantize + cuBLAS path). bf16 (the matrix) compiles the
    # per-row groups, fp16 one group per tile (test_w4a16_dequant_stores_16_bytes_at_a_time). N and K (so the
    # words' and w's row strides) are multiples of 16 on real shapes: the JIT specializes them, loads and stores
    # vectorize by them.
    ("w4a16_dequant", "blockwise"): KernelSignature(
        args={"qw_ptr": "*i32", "z_ptr": "*{out}", "s_ptr": "*{out}", "g_ptr": "*i32", "w_ptr": "*{out}",
              "perm_ptr": "*i32", "N": I32, "K": I32, "stride_qwk": I32, "stride_zg": I32, "stride_sg": I32,
              "stride_wn": I32},
        constexprs={"HAS_PERM": lambda tile: False, "UNIFORM_GROUP": lambda tile: tile["out"] == "fp16",
                    "GROUP_SIZE": "GROUP_SIZE", "BLOCK_N": "BLOCK_N", "BLOCK_K": "BLOCK_K",
                    "MAGIC_BITS": lambda tile: 0x6400 if tile["out"] == "fp16" else 0x4300,
                    "MAGIC_BIAS": lambda tile: 1024 if tile["out"] == "fp16" else 128,
                    "FP32_MATH": lambda tile: False},
        out_types=("fp16", "bf16"),
        aligned_ints=("N", "K", "stride_qwk", "stride_wn"),
    ),
}


# Kernels a module launches beside its main one (named after the module), as `<module>_<name>`: per (op, impl),
# name -> signature. Compiled for every tile of the entry too (their blocks come from it).
MOE_INDEX = {"rows_ptr": "*i32", "meta_ptr": "*i32"}
# The MoE layers' routing and combine (common/moe_routing_kernels.py.j2), the same in moe_fp8 and moe_w4a16.
MOE_ALIGN = KernelSignature(
    args={"ids_ptr": "*i32", **MOE_INDEX, "block_expert_ptr": "*i32", "num_assignments": I32, "topk": I32,
          "num_experts": I32, "max_rows": I32, "max_blocks": I32, "stride_it": I32, "stride_ik": I32},
    constexprs={"BLOCK_M": "BLOCK_M", "EXPERTS_PAD": lambda tile: 512, "CHUNK": lambda tile: 1024,
                "CHUNK_BLOCKS": lambda tile: 16},
    options=(), fixed={"num_warps": 4}, out_types=("bf16", "fp16"))
MOE_COMBINE = KernelSignature(
    args={"out_ptr": "*{out}", "weights_ptr": F32, "ids_ptr": "*i32", "y_ptr": "*{out}", "N": I32,
          "topk": I32, "num_experts": I32, "stride_om": I32, "stride_wt": I32, "stride_wk": I32,
          "stride_it": I32, "stride_ik": I32, "stride_ym": I32},
    constexprs={"BLOCK_N": lambda tile: 512}, options=(), fixed={"num_warps": 4}, out_types=("bf16", "fp16"))
BESIDE: dict[tuple[str, str], dict[str, KernelSignature]] = {
    ("moe_fp8", "sorted"): {
        "align": MOE_ALIGN,
        "quant": KernelSignature(
            args={"x_ptr": "*{out}", "q_ptr": FP8, "s_ptr": F32, "M": I32, "K": I32, "stride_xm": I32},
            constexprs={"BLOCK_M": lambda tile: 8, "ROUND_FIRST": lambda tile: False},
            options=(), fixed={"num_warps": 2}, out_types=("bf16", "fp16")),
        "act": KernelSignature(
            args={"gu_ptr": F32, "q_ptr": FP8, "s_ptr": F32, **MOE_INDEX, "inter": I32, "stride_gum": I32,
                  "stride_qm": I32, "stride_sm": I32},
            constexprs={"BLOCK_M": "BLOCK_M", "ROUND_FIRST": lambda tile: False},
            options=(), fixed={"num_warps": 4}, out_types=("bf16", "fp16")),
        "down": KernelSignature(
            args={"h_ptr": FP8, "hs_ptr": F32, "w_ptr": FP8, "ws_ptr": F32, "out_ptr": "*{out}", "rows_ptr": "*i32",
                  "block_expert_ptr": "*i32", "meta_ptr": "*i32", "N": I32, "K": I32, "max_blocks": I32,
                  "stride_hm": I32, "stride_hsm": I32, "stride_we": I32, "stride_wn": I32, "stride_wse": I32,
                  "stride_wsn": I32, "stride_om": I32},
            constexprs=GEMM_BLOCKS, options=("num_warps", "num_stages"), out_types=("bf16", "fp16")),
        "combine": MOE_COMBINE,
    },
    ("moe_w4a16", "sorted"): {
        "align": MOE_ALIGN,
        # Act-order: x's rows through gate's and up's permutations at DeepSeek-V3's H = 7168 (padded to 8192).
        "gather": KernelSignature(
            args={"src_ptr": "*{out}", "perm_ptr": "*i32", "dst_ptr": "*{out}", **MOE_INDEX, "block_expert_ptr": "*i32",
                  "K": I32, "topk": I32, "stride_sm": I32, "stride_pe": I32, "stride_ps": I32, "stride_ds": I32,
                  "stride_dm": I32},
            constexprs={"SEGMENTS": lambda tile: 2, "BY_TOKEN": lambda tile: True, "BLOCK_M": "BLOCK_M",
                        "K_PAD": lambda tile: 8192},
            options=(), fixed={"num_warps": 8}, out_types=("bf16", "fp16"),
            aligned_ints=("K", "stride_sm", "stride_pe", "stride_ps", "stride_ds", "stride_dm")),
        "down": KernelSignature(
            args={**MOE_W4A16_WEIGHTS, "h_ptr": "*{out}", "out_ptr": "*{out}", "stride_hm": I32, "stride_om": I32},
            constexprs=MOE_W4A16_CONSTEXPRS, options=("num_warps", "num_stages"), out_types=("fp16", "bf16")),
        "combine": MOE_COMBINE,
    },
}


def signature_of(entry: KernelEntry, tile: dict, kernel: str = "") -> tuple[KernelSignature, str, Path]:
    """(signature, kernel function name, module path) of the kernel the tile's implementation launches (kernel:
    the name of one launched beside it, BESIDE)."""
    module = entry.modules[tile["impl"]]
    if kernel:
        return BESIDE[(entry.op, tile["impl"])][kernel], f"{module.path.stem}_{kernel}", module.path
    return SIGNATURES[(entry.op, tile["impl"])], module.path.stem, module.path


def pointer_attrs(signature: dict, arg_names: list[str], aligned_ints: tuple[str, ...] = ()) -> dict:
    """The launcher passes freshly allocated (16-byte aligned) tensors: mark pointers (and
    aligned_ints) divisible by 16, as Triton's JIT would specialize them."""
    return {(arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in signature.items() if kind.startswith("*") or name in aligned_ints}


# ---------------------------------------------------------------------------------------------
# Compile jobs and the worker that runs them (in a subprocess without the interpreter)

ENTRIES = {entry.name: entry for entry in load_manifest()}


# Tiles the templates take but no shipped definition uses, compiled by name (Job.tile).
EXTRA_TILES: dict[str, dict] = {
    # fp8_bmm's sm_90 options no shipped tile sets (a flattened pipeline with batch-inner order, warp specialization).
    "bmm-flatten": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                                    options={"flatten": True, "batch_inner": True}),
                               find_impl("fp8_bmm", "tma_persistent")),
    "bmm-ws": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                               options={"warp_specialize": True}), find_impl("fp8_bmm", "tma_persistent")),
    # Programmatic dependent launch with the weight prefetch, and the pointer epilogue (swapped and not).
    "bmm-pdl-pointer": tile_params(Tile(block_m=64, block_n=128, num_warps=4, num_stages=3,
                                        options={"flatten": True, "pdl": True, "prefetch_weights": True,
                                                 "epilogue": "pointer"}), find_impl("fp8_bmm", "tma_persistent")),
    "bmm-pdl-swap-pointer": tile_params(Tile(block_m=16, block_n=64, num_warps=4, num_stages=2,
                                             options={"swap_ab": True, "persistent": False, "pdl": True,
                                                      "prefetch_weights": True, "epilogue": "pointer"}),
                                        find_impl("fp8_bmm", "tma_persistent")),
}


@dataclass(frozen=True)
class Job:
    entry: str
    cc: int
    tile: int | str  # index into the entry's tile buckets, or a name in EXTRA_TILES
    out: str = "bf16"
    kernel: str = ""  # a kernel the module launches beside its main one (BESIDE), by name

    @property
    def params(self) -> dict:
        if isinstance(self.tile, str):
            return EXTRA_TILES[self.tile]
        return ENTRIES[self.entry].tiles[self.tile].params

    @property
    def key(self) -> str:
        return f"{self.entry}-sm{self.cc}-tile{self.tile}-{self.out}" + (f"-{self.kernel}" if self.kernel else "")


def jit_kernel(path: Path, function: str):
    """The @triton.jit `function` of the generated module at path, from a fresh import of it (worker
    process only)."""
    import triton

    name = f"kdsl_compile_matrix.{path.stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    kernel = getattr(module, function)
    assert isinstance(kernel, triton.runtime.JITFunction), f"{function} is not a JIT function: {type(kernel)}"
    return kernel


def compile_job(job: Job):
    """triton.compile the job's kernel for its arch; the worker's whole purpose."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    entry = ENTRIES[job.entry]
    tile = job.params
    spec, function, path = signature_of(entry, tile, job.kernel)
    kernel = jit_kernel(path, function)
    # Signatures may read the prepared layout's weights order (the GEMV's packed half2 dot).
    # and the scheme's constexprs (GROUP_SIZE, ZERO_OFFSET), which launch() passes from the entry.
    signature, constexprs, options = spec.build(
        {**tile, **entry.constexprs, "weights": (entry.layout or {}).get("weights")}, job.out)
    params = list(kernel.arg_names)
    missing = [p for p in params if p not in signature]
    extra = [p for p in signature if p not in params]
    if missing or extra:
        raise AssertionError(
            f"the signature of {function} is out of date with {path.name}: "
            f"kernel parameters not described {missing}, described but not parameters {extra}"
        )
    signature = {p: signature[p] for p in params}  # in parameter order
    attrs = pointer_attrs(signature, params, spec.aligned_ints)
    if spec.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        from kdsl.aot.worker import gluon_descriptor_types

        source = GluonASTSource(kernel, gluon_descriptor_types(signature), constexprs, attrs)
    else:
        source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", job.cc, 32), options=options)


def worker(out_dir: Path, jobs: list[Job]) -> None:
    """Compile each job; write <key>.ptx and one results file. Never raises for a failed compile."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "the compile worker must run without the interpreter"
    results = {}
    for job in jobs:
        start = time.perf_counter()
        try:
            compiled = compile_job(job)
        except Exception as error:  # reported by the test that owns the job
            results[job.key] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            continue
        (out_dir / f"{job.key}.ptx").write_text(compiled.asm["ptx"], encoding="utf-8")
        results[job.key] = {
            "ok": True,
            "seconds": time.perf_counter() - start,
            "cubin_bytes": len(compiled.asm.get("cubin") or b""),
            "num_warps": compiled.metadata.num_warps,
        }
    (out_dir / f"results-{os.getpid()}.json").write_text(json.dumps(results), encoding="utf-8")


def run_workers(jobs: list[Job], out_dir: Path, processes: int = 2) -> dict:
    """Deal jobs round robin to `processes` worker subprocesses running in parallel; merge their results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    shares = [jobs[i::processes] for i in range(processes)]
    workers = []
    for share in shares:
        if not share:
            continue
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(out_dir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        workers.append((proc, json.dumps([asdict(job) for job in share])))
    failures = []
    for proc, payload in workers:
        stdout, stderr = proc.communicate(payload, timeout=900)
        if proc.returncode != 0:
            failures.append(f"compile worker exited {proc.returncode}:\n{stderr[-4000:]}")
    assert not failures, "\n".join(failures)
    results = {}
    for path in out_dir.glob("results-*.json"):
        results.update(json.loads(path.read_text(encoding="utf-8")))
    return results


# ---------------------------------------------------------------------------------------------
# The jobs the tests ask for


def archs_of(entry: KernelEntry) -> list[int]:
    return [cc for cc in COMPILE_ARCHS if cc >= entry.min_arch and (entry.max_arch is None or cc <= entry.max_arch)]


def _matrix():
    """Every entry x every arch it claims x every tile bucket (one skipped param per entry without a signature)."""
    for entry in ENTRIES.values():
        unsigned = sorted(impl for impl in entry.modules if (entry.op, impl) not in SIGNATURES)
        if unsigned:
            reason = f"no signature for {entry.op}/{unsigned}: add rows to SIGNATURES in tests/test_compile_matrix.py"
            yield pytest.param(Job(entry.name, 0, 0), id=f"{entry.name}-no-signature", marks=pytest.mark.skip(reason=reason))
            continue
        if entry.scheme.startswith(("gptq.", "w4a16.")) and entry.scheme not in FULL_GPTQ_SCHEMES:
            # The GPTQ schemes differ only in baked constants: one scheme gets the whole
            # matrix, the others one compile each (newest arch, prefill tile) to keep CI short.
            cc, index = archs_of(entry)[-1], len(entry.tiles) - 1
            yield pytest.param(Job(entry.name, cc, index), id=f"{entry.name}-sm{cc}-tile{index}")
            continue
        for cc in archs_of(entry):
            for index in range(len(entry.tiles)):
                yield pytest.param(Job(entry.name, cc, index), id=f"{entry.name}-sm{cc}-tile{index}")
                for kernel in BESIDE.get((entry.op, entry.tiles[index].params["impl"]), {}):
                    yield pytest.param(Job(entry.name, cc, index, kernel=kernel),
                                       id=f"{entry.name}-sm{cc}-tile{index}-{kernel}")


def _fp8_entry(op: str, impl: str) -> KernelEntry:
    matches = [e for e in ENTRIES.values() if e.op == op and e.impl == impl and e.scheme.startswith("block_fp8.")]
    assert matches, f"no generated {op}/{impl} kernel"
    return matches[0]


TMA = _fp8_entry("fp8_gemm", "tma_persistent")
PORTABLE = _fp8_entry("fp8_gemm", "portable")
BMM = _fp8_entry("fp8_bmm", "portable")
BMM_TMA = _fp8_entry("fp8_bmm", "tma_persistent")
DEQUANT = _fp8_entry("weight_dequant", "blockwise")


def last(entry: KernelEntry) -> int:
    """Index of the prefill bucket (explicit, so the job matches the matrix's and compiles once)."""
    return len(entry.tiles) - 1


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """Compile every job of the selected tests of this module, once, in worker subprocesses.

    Returns (results by job key, folder of <key>.ptx files)."""
    jobs = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        job = params.get("job")
        if isinstance(job, Job) and item.module is request.module and not item.get_closest_marker("skip"):
            jobs[job.key] = job
    out_dir = tmp_path_factory.mktemp("compile_matrix")
    start = time.perf_counter()
    results = run_workers(sorted(jobs.values(), key=lambda j: j.key), out_dir)
    wall = time.perf_counter() - start
    seconds = [r["seconds"] for r in results.values() if r.get("ok")]
    print(f"\ncompile matrix: {len(jobs)} compiles in {wall:.1f} s wall "
          f"({sum(seconds):.1f} s of compiling, slowest {max(seconds, default=0):.1f} s)")
    return results, out_dir


def ptx_of(compiled, job: Job) -> str:
    results, out_dir = compiled
    result = results.get(job.key)
    assert result is not None, f"{job.key} was not compiled"
    assert result["ok"], f"{job.key} does not compile:\n{result['error']}"
    return (out_dir / f"{job.key}.ptx").read_text(encoding="utf-8")


@pytest.mark.parametrize("job", list(_matrix()))
def test_compiles(job, compiled):
    ptx = ptx_of(compiled, job)
    result = compiled[0][job.key]
    assert f".target sm_{job.cc}" in ptx
    assert result["cubin_bytes"] > 0, "ptxas produced no cubin"
    spec = signature_of(ENTRIES[job.entry], job.params, job.kernel)[0]
    assert result["num_warps"] == spec.fixed.get("num_warps", job.params["num_warps"])


def test_every_block_fp8_entry_has_a_signature():
    fp8 = [e for e in ENTRIES.values() if e.scheme.startswith("block_fp8.")]
    missing = sorted({(e.op, impl) for e in fp8 for impl in e.modules} - set(SIGNATURES))
    assert not missing, f"add rows to SIGNATURES for {missing}"
    for entry in fp8:
        assert archs_of(entry), f"{entry.name} claims no arch the matrix compiles for"


def first_mma(entry: KernelEntry) -> int:
    """Index of the first bucket whose tiles feed an MMA (block_m > 1)."""
    return next(i for i, tile in enumerate(entry.tiles) if tile.params["BLOCK_M"] > 1)


BMM_TMA_TILES = [i for i, tile in enumerate(BMM_TMA.tiles) if tile.params["impl"] == "tma_persistent"]


@pytest.mark.parametrize("job", [Job(TMA.name, 90, first_mma(TMA)), Job(TMA.name, 90, last(TMA)),
                                 *(Job(BMM_TMA.name, 90, i) for i in BMM_TMA_TILES),
                                 Job(BMM_TMA.name, 90, "bmm-flatten"), Job(BMM_TMA.name, 90, "bmm-ws"),
                                 Job(BMM_TMA.name, 90, "bmm-pdl-pointer"), Job(BMM_TMA.name, 90, "bmm-pdl-swap-pointer")],
                         ids=["decode", "prefill", *(f"bmm-tile{i}" for i in BMM_TMA_TILES),
                              "bmm-flatten", "bmm-ws", "bmm-pdl-pointer", "bmm-pdl-swap-pointer"])
def test_hopper_gemm_uses_wgmma(job, compiled):
    ptx = ptx_of(compiled, job)
    assert "wgmma" in ptx
    assert re.search(r"wgmma\.mma_async\S*e4m3\.e4m3", ptx), "wgmma does not take e4m3 operands"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    if isinstance(job.tile, str) and job.tile.startswith("bmm-pdl"):
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
        assert "prefetch.global.L2" in ptx


DEFERRED = [i for i, tile in enumerate(TMA.tiles) if tile.params["impl"] == "deferred_gluon"]


@pytest.mark.parametrize("job", [Job(TMA.name, 90, i) for i in DEFERRED], ids=[f"tile{i}" for i in DEFERRED])
def test_deferred_rescale_keeps_one_wgmma_in_flight(job, compiled):
    """The Gluon kernel waits for all but the newest wgmma group before each rescale (wait 1), and for
    none only after its last K block."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"wgmma\.mma_async\S*e4m3\.e4m3", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert waits.count("1") >= 2, f"no rescale overlaps a wgmma: waits {waits}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"


GPTQ_HOPPER = next(e for e in ENTRIES.values()
                   if e.op == "w4a16_gemm" and e.scheme == "w4a16.int4.g128" and e.min_arch == 90)
OVERLAP = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "overlap_gluon"]


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in OVERLAP for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in OVERLAP for out in ("fp16", "bf16")])
def test_overlap_dequant_keeps_one_wgmma_in_flight(job, compiled):
    """The Gluon GPTQ kernel feeds the wgmma dequantized weights from registers and waits for all but the
    newest wgmma group before the next block's dequant, bringing its operands by TMA."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    # The register operand: the A fragment is a brace list of 32-bit registers, not a shared-memory descriptor.
    assert re.search(rf"wgmma\.mma_async\S*\.f32\.{out}\.{out}\s+\{{[^}}]*\}},\s*\{{%r", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert waits.count("1") >= 2, f"no dequant overlaps a wgmma: waits {waits}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"


MMA_GEMV = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "gemv_mma_gluon"]
TRITON_GEMV = [i for i, tile in enumerate(GPTQ_HOPPER.tiles) if tile.params["impl"] == "gemv"]


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in MMA_GEMV for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in MMA_GEMV for out in ("fp16", "bf16")])
def test_mma_gemv_feeds_mma_sync_from_16_byte_loads(job, compiled):
    """The Gluon GEMV sums over K on mma.sync (m16n8k16, fp32 accumulators), not wgmma, and reads the
    k_planes words four at a time."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{out}\.{out}\.f32", ptx)
    assert "wgmma" not in ptx
    assert re.search(r"ld\.global\S*\.v4\.b32", ptx), "words are not loaded 16 bytes at a time"


@pytest.mark.parametrize("job", [Job(GPTQ_HOPPER.name, 90, i, out) for i in TRITON_GEMV for out in ("fp16", "bf16")],
                         ids=[f"tile{i}-{out}" for i in TRITON_GEMV for out in ("fp16", "bf16")])
def test_prepared_triton_gemv_compiles(job, compiled):
    """The Triton GEMV, the mma.sync GEMV's alternative: CUDA cores only."""
    ptx = ptx_of(compiled, job)
    assert "wgmma" not in ptx and "mma.sync" not in ptx


@pytest.mark.parametrize("job", [Job(PORTABLE.name, 89, 0), Job(PORTABLE.name, 89, last(PORTABLE)),
                                 Job(BMM.name, 89, 0), Job(BMM.name, 89, last(BMM))],
                         ids=["decode", "prefill", "bmm-decode", "bmm-prefill"])
def test_portable_gemm_uses_fp8_mma_on_ada(job, compiled):
    ptx = ptx_of(compiled, job)
    assert re.search(r"mma\.sync\.aligned\.\S*\.e4m3\.e4m3", ptx), "no e4m3 tensor-core mma in the PTX"
    assert "wgmma" not in ptx


GROUPED = _fp8_entry("fp8_grouped_gemm", "portable")
MASKED = _fp8_entry("fp8_grouped_gemm_masked", "portable")
MOE = _fp8_entry("moe_fp8", "sorted")


@pytest.mark.parametrize("job", [Job(GROUPED.name, 89, 0), Job(GROUPED.name, 89, last(GROUPED)),
                                 Job(MASKED.name, 89, 0), Job(MOE.name, 89, 0), Job(MOE.name, 89, last(MOE)),
                                 Job(MOE.name, 89, 0, kernel="down"), Job(MOE.name, 89, last(MOE), kernel="down")],
                         ids=["grouped-decode", "grouped-prefill", "masked-decode", "moe-gate-up-decode",
                              "moe-gate-up-fused", "moe-down-decode", "moe-down-prefill"])
def test_moe_gemms_use_fp8_mma_on_ada(job, compiled):
    ptx = ptx_of(compiled, job)
    assert re.search(r"mma\.sync\.aligned\.\S*\.e4m3\.e4m3", ptx), "no e4m3 tensor-core mma in the PTX"


MOE_W4A16 = {e.min_arch: e for e in ENTRIES.values() if e.op == "moe_w4a16" and e.scheme == "w4a16.int4.g128"}


@pytest.mark.parametrize("job", [
    Job(MOE_W4A16[80].name, 80, 0, "fp16"), Job(MOE_W4A16[80].name, 80, last(MOE_W4A16[80])),
    Job(MOE_W4A16[80].name, 80, 0, "fp16", kernel="down"),
    Job(MOE_W4A16[80].name, 80, last(MOE_W4A16[80]), kernel="down"),
    Job(MOE_W4A16[90].name, 90, 0), Job(MOE_W4A16[90].name, 90, last(MOE_W4A16[90]), kernel="down"),
], ids=["sm80-gate-up-decode-fp16", "sm80-gate-up-prefill", "sm80-down-decode-fp16", "sm80-down-prefill",
        "sm90-gate-up-decode", "sm90-down-prefill"])
def test_moe_w4a16_gemms_use_tensor_cores(job, compiled):
    """The int4 MoE GEMMs multiply the dequantized weights on fp16/bf16 tensor cores (mma.sync, or wgmma on
    Hopper), accumulating in fp32."""
    ptx = ptx_of(compiled, job)
    out = job.out.replace("fp", "f")
    mma = rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{out}\.{out}\.f32|wgmma\.mma_async\S*\.f32\.{out}\.{out}"
    assert re.search(mma, ptx), f"no {job.out} tensor-core MMA in the PTX"


@pytest.mark.parametrize("job", [Job(MOE_W4A16[80].name, 80, 0, kernel="gather"),
                                 Job(MOE_W4A16[90].name, 90, last(MOE_W4A16[90]), "fp16", kernel="gather")],
                         ids=["sm80-bf16", "sm90-fp16"])
def test_moe_w4a16_act_order_gather_is_coalesced(job, compiled):
    """Act-order's gather reads x's row and writes the permuted rows 16 bytes a thread (the whole row, contiguous)
    and permutes in registers through shared memory (tl.gather), with no per-element global load of x."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "x's row is not loaded 16 bytes at a time"
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "the gathered rows are not stored 16 bytes at a time"
    assert re.search(r"ld\.shared", ptx), "no shared-memory permutation"
    assert not re.search(r"ld\.global(\.\w+)*\.b16", ptx), "x read one element at a time"


@pytest.mark.parametrize("job", [
    Job(PORTABLE.name, 89, last(PORTABLE), "fp16"), Job(PORTABLE.name, 89, last(PORTABLE), "fp32"),
    Job(GROUPED.name, 89, last(GROUPED), "fp32"), Job(MASKED.name, 89, last(MASKED), "fp32"),
    Job(MOE.name, 89, last(MOE), "fp16"), Job(MOE.name, 89, last(MOE), "fp16", kernel="combine"),
    Job(BMM.name, 89, last(BMM), "fp16"), Job(BMM.name, 89, last(BMM), "fp32"),
    Job(TMA.name, 90, last(TMA), "fp16"), Job(TMA.name, 90, last(TMA), "fp32"),
    Job(BMM_TMA.name, 90, BMM_TMA_TILES[-1], "fp16"), Job(BMM_TMA.name, 90, BMM_TMA_TILES[-1], "fp32"),
    Job(DEQUANT.name, 89, last(DEQUANT), "fp16"), Job(DEQUANT.name, 89, last(DEQUANT), "fp32"),
], ids=lambda job: f"{ENTRIES[job.entry].op}-{ENTRIES[job.entry].impl}-{job.out}" + (f"-{job.kernel}" if job.kernel else ""))
def test_other_output_dtypes_compile(job, compiled):
    entry = ENTRIES[job.entry]
    assert job.out in signature_of(entry, job.params, job.kernel)[0].out_types
    ptx = ptx_of(compiled, job)
    assert f".target sm_{job.cc}" in ptx


W4A16_DEQUANT = {e.min_arch: e for e in ENTRIES.values() if e.op == "w4a16_dequant" and e.scheme == "w4a16.int4.g128"}


@pytest.mark.parametrize("job", [Job(W4A16_DEQUANT[cc].name, cc, 0, out) for cc in (80, 90) for out in ("fp16", "bf16")],
                         ids=[f"sm{cc}-{out}" for cc in (80, 90) for out in ("fp16", "bf16")])
def test_w4a16_dequant_stores_16_bytes_at_a_time(job, compiled):
    """w4a16_dequant writes four bytes of w for each byte it reads: its stores of w's K-contiguous rows go out
    16 bytes at a time, in both layouts (checkpoint words on sm_80, k_planes on sm_90) and both group paths."""
    ptx = ptx_of(compiled, job)
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "no 16-byte stores of w"


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(Path(sys.argv[2]), [Job(**raw) for raw in json.loads(sys.stdin.read())])
