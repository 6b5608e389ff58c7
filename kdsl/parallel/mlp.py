"""A gated MLP, down(silu(gate(x)) * up(x)), tensor parallel as Megatron and vLLM run it: one all-reduce.

Each rank holds the rows of gate and of up that produce its I / T intermediate features, stacked into one
weight (gate's, then up's), so one GEMM computes both with no gather; SiLU * up runs locally on that shard;
down is row parallel over the same I / T features (RowParallelLinear, input_is_parallel), so the only
communication is down's all-reduce of [..., H], in the activation dtype by default (reduce_dtype=torch.float32
for float32 partials; all_reduce="symm_mem" for torch's one-shot kernel at decode sizes).

SiLU * up is one generated kernel where one serves (fused_act): for FP8, kdsl.ops.silu_mul_quant writes h already
quantized in down's 1x128 activation groups, so down is one fp8_gemm with no act_quant of its own (gate_up GEMM ->
silu_mul_quant -> down GEMM -> all-reduce); for W4A16, kdsl.ops.silu_mul writes h in the activation dtype. Both
compute h in fp32 and round it once. With gate and up as two GEMMs (their act-order g_idx differ), or
fused_act = False, torch's silu and mul run instead.

Constructors take the three linears' checkpoint tensors (mappings with their usual names) or float nn.Linear
layers (quantized as kdsl.quantize_ does). The shard rules are kdsl.parallel.sharding's: FP8 needs
I / T % 128 == 0 (down's row shard); GPTQ act-order sorts down's K by group and cuts gate and up to produce
exactly those features in that order (gptq_row_index), so the chain needs no gather; AWQ cuts whole groups.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kdsl import ops
from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.runtime import registry
from kdsl.parallel import comm
from kdsl.parallel.layers import RowParallelLinear, _rank_world
from kdsl.parallel.sharding import FP8Shard, gptq_row_index, shard_awq, shard_fp8, shard_gptq
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ

ROLES = ("gate", "up", "down")


def _get(t: Mapping, role: str, name: str, optional: bool = False):
    if not isinstance(t, Mapping):
        raise TypeError(f"{role}: expected a mapping of checkpoint tensors (e.g. {{'{name}': ...}}), "
                        f"got {type(t).__name__}")
    if name not in t or t[name] is None:
        if optional:
            return None
        raise KeyError(f"{role}: no {name!r} among {sorted(t)}")
    return t[name]


def _same_shape(role: str, name: str, tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{role}.{name}: expected shape {tuple(expected)} (from the other linears), "
                         f"got {tuple(tensor.shape)}")


def _stack_fp8(parts: list[FP8Shard], block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              list[slice]]:
    """The column shards of gate and up as one FP8 weight: each part but the last padded with zero rows to
    whole scale blocks, so the next part's rows line up with its own scale rows; the slices of the real
    outputs (no padding at all when I / T is a multiple of the block)."""
    weights, scales, biases, slices, row = [], [], [], [], 0
    for i, p in enumerate(parts):
        w = p.weight
        full = p.weight_scale_inv.shape[0] * block_n
        if i < len(parts) - 1 and w.shape[0] != full:
            w = torch.cat([w, w.new_zeros(full - w.shape[0], w.shape[1])])
        slices.append(slice(row + p.pad_front, row + p.pad_front + p.out_features))
        weights.append(w)
        scales.append(p.weight_scale_inv)
        biases.append(p.bias)
        row += w.shape[0]
    bias = None
    if any(b is not None for b in biases):
        dtype = next(b.dtype for b in biases if b is not None)
        bias = torch.zeros(row, dtype=dtype, device=weights[0].device)
        at = 0
        for w, b in zip(weights, biases):
            if b is not None:
                bias[at:at + b.shape[0]] = b
            at += w.shape[0]
    return torch.cat(weights), torch.cat(scales), bias, slices


def _cat_bias(biases: list, sizes: list[int]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    like = next(b for b in biases if b is not None)
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in zip(biases, sizes)])


class ParallelMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) over a torch.distributed group: fused gate_up column shard (no gather),
    SiLU * mul locally, row-parallel down with one all-reduce. forward takes and returns the whole [..., H]."""

    def __init__(self, gate_up: nn.Module, down: RowParallelLinear, *, gate_slice: slice, up_slice: slice | None = None,
                 up: nn.Module | None = None):
        super().__init__()
        if not isinstance(down, RowParallelLinear) or not down.input_is_parallel:
            raise TypeError("down: expected a RowParallelLinear with input_is_parallel=True")
        if (up is None) == (up_slice is None):
            raise ValueError("pass up_slice (gate_up computes gate and up) or up (a module of its own), not both")
        self.gate_up, self.up, self.down = gate_up, up, down
        self.gate_slice, self.up_slice = gate_slice, up_slice
        self.group, self.rank, self.world_size = down.group, down.rank, down.world_size
        self.hidden_size, self.intermediate_size = down.out_features, down.in_features
        # h = silu(gate) * up in one generated kernel (False: torch's silu and mul; a plain attribute, which the
        # bench turns off to time the unfused path on the same weights).
        self.fused_act = self.fused_act_serves()

    def fused_act_serves(self) -> bool:
        """Whether silu_mul_quant (FP8 down) or silu_mul (W4A16 down) can run on gate_up's output as it is: one
        GEMM writing [..., 2 I_r], gate's I_r columns then up's, with no padding between them (FP8 shards of I / T
        off the 128 grid would carry some), and a generated kernel serving the op (silu_mul_quant: for down's
        activation group)."""
        local = self.gate_slice.stop - self.gate_slice.start
        if (self.up is not None or self.gate_slice != slice(0, local) or self.up_slice != slice(local, 2 * local)
                or getattr(self.gate_up, "out_features", None) != 2 * local):
            return False
        if isinstance(self.down.local, FP8Linear):
            group = self.down.local.scheme.act_group
            schemes = registry.scheme_fields("silu_mul_quant").values()
            served = any(fields.get("act_group") == group for fields in schemes)
            return served and local % group == 0
        return bool(registry.served_schemes("silu_mul"))

    # --- constructors ------------------------------------------------------------------------------------

    @classmethod
    def from_fp8(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: BlockFP8 | None = None,
                 reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                 symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: {"weight": float8_e4m3fn [N, K], "weight_scale_inv": float32 blocks, "bias": optional}."""
        scheme = scheme or BlockFP8()
        rank, world = _rank_world(group)
        dw = _get(down, "down", "weight")
        hidden, inter = dw.shape
        row = RowParallelLinear.from_fp8(dw, _get(down, "down", "weight_scale_inv"), _get(down, "down", "bias", True),
                                         group=group, input_is_parallel=True, scheme=scheme, reduce_dtype=reduce_dtype,
                                         all_reduce=all_reduce, symm_mem_max_bytes=symm_mem_max_bytes)
        parts = []
        for role, t in (("gate", gate), ("up", up)):
            w = _get(t, role, "weight")
            _same_shape(role, "weight", w, (inter, hidden))
            parts.append(shard_fp8(w, _get(t, role, "weight_scale_inv"), _get(t, role, "bias", True), rank=rank,
                                   world_size=world, dim="column", block=scheme.weight_block, name=f"{role}.weight"))
        weight, scale, bias, (gate_slice, up_slice) = _stack_fp8(parts, scheme.weight_block[0])
        return cls(FP8Linear(weight, scale, bias, scheme), row, gate_slice=gate_slice, up_slice=up_slice)

    @classmethod
    def from_gptq(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: GPTQ | None = None,
                  reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                  symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: {"qweight", "qzeros", "scales", "g_idx": optional (act-order), "bias": optional}.

        Act-order: down's K is sorted by group and cut (shard_gptq), and gate's and up's columns are cut in
        that order (gptq_row_index), so gate_up's shard is down's input as it is. gate and up are one GEMM
        where their g_idx agree (they do in GPTQ checkpoints: both quantize the same input), else two."""
        scheme = scheme or GPTQ()
        rank, world = _rank_world(group)
        dq = _get(down, "down", "qweight")
        inter, hidden = dq.shape[0] * 8, dq.shape[1]
        d_gidx = _get(down, "down", "g_idx", True)
        row = RowParallelLinear.from_gptq(dq, _get(down, "down", "qzeros"), _get(down, "down", "scales"), d_gidx,
                                          _get(down, "down", "bias", True), group=group, input_is_parallel=True,
                                          scheme=scheme, reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                          symm_mem_max_bytes=symm_mem_max_bytes)
        index = gptq_row_index(d_gidx, inter, rank=rank, world_size=world, group_size=scheme.group_size)
        size = inter // world
        if torch.equal(index, torch.arange(rank * size, (rank + 1) * size, device=index.device)):
            index = None  # down's rows are in order: gate and up cut as plain column shards
        shards = []
        for role, t in (("gate", gate), ("up", up)):
            q = _get(t, role, "qweight")
            _same_shape(role, "qweight", q, (hidden // 8, inter))
            shards.append(shard_gptq(q, _get(t, role, "qzeros"), _get(t, role, "scales"), _get(t, role, "g_idx", True),
                                     _get(t, role, "bias", True), rank=rank, world_size=world, dim="column",
                                     group_size=scheme.group_size, bits=scheme.bits, out_index=index))
        g, u = shards
        if (g.g_idx is None) == (u.g_idx is None) and (g.g_idx is None or torch.equal(g.g_idx, u.g_idx)):
            local = W4A16Linear.from_gptq(torch.cat([g.qweight, u.qweight], 1), torch.cat([g.qzeros, u.qzeros], 1),
                                          torch.cat([g.scales, u.scales], 1), g.g_idx,
                                          _cat_bias([g.bias, u.bias], [size, size]), scheme)
            return cls(local, row, gate_slice=slice(0, size), up_slice=slice(size, 2 * size))
        gate_local, up_local = (W4A16Linear.from_gptq(s.qweight, s.qzeros, s.scales, s.g_idx, s.bias, scheme)
                                for s in shards)
        return cls(gate_local, row, gate_slice=slice(0, size), up=up_local)

    @classmethod
    def from_awq(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: AWQ | None = None,
                 reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                 symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: AutoAWQ "gemm" {"qweight", "qzeros", "scales", "bias": optional}."""
        scheme = scheme or AWQ()
        rank, world = _rank_world(group)
        dq = _get(down, "down", "qweight")
        inter, hidden = dq.shape[0], dq.shape[1] * 8
        row = RowParallelLinear.from_awq(dq, _get(down, "down", "qzeros"), _get(down, "down", "scales"),
                                         _get(down, "down", "bias", True), group=group, input_is_parallel=True,
                                         scheme=scheme, reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                         symm_mem_max_bytes=symm_mem_max_bytes)
        shards = []
        for role, t in (("gate", gate), ("up", up)):
            q = _get(t, role, "qweight")
            _same_shape(role, "qweight", q, (hidden, inter // 8))
            shards.append(shard_awq(q, _get(t, role, "qzeros"), _get(t, role, "scales"), _get(t, role, "bias", True),
                                    rank=rank, world_size=world, dim="column", group_size=scheme.group_size))
        g, u = shards
        size = inter // world
        local = W4A16Linear.from_awq(torch.cat([g.qweight, u.qweight], 1), torch.cat([g.qzeros, u.qzeros], 1),
                                     torch.cat([g.scales, u.scales], 1), _cat_bias([g.bias, u.bias], [size, size]),
                                     scheme)
        return cls(local, row, gate_slice=slice(0, size), up_slice=slice(size, 2 * size))

    @classmethod
    def from_float(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, scheme: BlockFP8 | GPTQ | AWQ, *,
                   group=None, reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                   symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """Quantize three float nn.Linear layers as kdsl.quantize_ does (FP8Linear.from_float: weight_quant in
        the scheme's blocks; W4A16Linear.from_float: round-to-nearest int4, no act-order), whole, so every rank's
        shards are those of the one-GPU quantized MLP, then cut them."""
        options = dict(group=group, reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                       symm_mem_max_bytes=symm_mem_max_bytes)
        linears = {"gate": gate, "up": up, "down": down}
        for role, linear in linears.items():
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{role}: expected an nn.Linear, got {type(linear).__name__}")

        def bias(linear, dtype=None):
            return None if linear.bias is None else linear.bias.detach().to(dtype or linear.bias.dtype)

        if isinstance(scheme, BlockFP8):
            tensors = {}
            for role, linear in linears.items():
                q, s = ops.weight_quant(linear.weight.detach(), block_size=scheme.weight_block)
                tensors[role] = {"weight": q, "weight_scale_inv": s, "bias": bias(linear)}
            return cls.from_fp8(**tensors, scheme=scheme, **options)
        if not isinstance(scheme, (GPTQ, AWQ)):
            raise TypeError(f"scheme: expected kdsl.BlockFP8, kdsl.GPTQ or kdsl.AWQ, got {type(scheme).__name__}")
        sym = getattr(scheme, "sym", False)  # as W4A16Linear.from_float: AWQ schemes get asymmetric RTN weights
        tensors = {}
        for role, linear in linears.items():
            weight = linear.weight.detach()
            dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
            ck = ops.gptq_quantize(weight.to(dtype), bits=scheme.bits, group_size=scheme.group_size, sym=sym)
            tensors[role] = {**{name: ck[name] for name in ("qweight", "qzeros", "scales")},
                             "bias": bias(linear, dtype)}
        gptq = GPTQ(bits=scheme.bits, group_size=scheme.group_size, sym=sym, checkpoint_format="gptq")
        return cls.from_gptq(**tensors, scheme=gptq, **options)

    # --- forward -----------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if self.fused_act:
            down = self.down
            if isinstance(down.local, FP8Linear):  # h quantized in down's activation groups: down is one fp8_gemm
                q, s = ops.silu_mul_quant(h, down.local.scheme.act_group)
                return down.forward_quantized(q, s, h.dtype)
            return down(ops.silu_mul(h))
        if self.up is None:
            gate, up = h[..., self.gate_slice], h[..., self.up_slice]
        else:
            gate, up = h, self.up(x)
        return self.down(F.silu(gate).mul_(up))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"rank={self.rank}/{self.world_size}, gate_up={'one GEMM' if self.up is None else 'two GEMMs'}, "
                f"act={self._act_name()}")

    def _act_name(self) -> str:
        if not self.fused_act:
            return "torch silu, mul"
        return "silu_mul_quant" if isinstance(self.down.local, FP8Linear) else "silu_mul"

