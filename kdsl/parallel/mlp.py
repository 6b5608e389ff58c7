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
layers (quantized as kdsl.quantize_ does). The shard rules are the scheme units' (kdsl.nn.schemes): FP8 needs
I / T % 128 == 0 (down's row shard); GPTQ act-order sorts down's K by group and cuts gate and up to produce
exactly those features in that order (gptq_row_index), so the chain needs no gather; AWQ cuts whole groups.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kdsl.nn.schemes import handler_for
from kdsl.parallel import comm
from kdsl.parallel.layers import RowParallelLinear, _rank_world
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ

ROLES = ("gate", "up", "down")


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
        return self.down.local.silu_mul_serves(local)

    # --- constructors ------------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, gate: Mapping, up: Mapping, down: Mapping, *, scheme, group=None,
                        reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                        symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: each linear's checkpoint tensors ({name: tensor}, the names of the scheme's checkpoint
        format), cut by the scheme's shard rules (kdsl.nn.schemes): down as a row shard, gate and up as the
        column shards producing exactly its input features."""
        handler = handler_for(scheme)
        rank, world = _rank_world(group)
        down = handler.read(down, "down")
        row = RowParallelLinear.from_checkpoint(down, scheme=scheme, group=group, input_is_parallel=True,
                                                reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                                symm_mem_max_bytes=symm_mem_max_bytes)
        s = handler.gate_up_shard(scheme, gate, up, down, rank=rank, world_size=world)
        return cls(s.local, row, gate_slice=s.gate_slice, up_slice=s.up_slice, up=s.up)

    @classmethod
    def from_fp8(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: BlockFP8 | None = None,
                 reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                 symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: {"weight": float8_e4m3fn [N, K], "weight_scale_inv": float32 blocks, "bias": optional}."""
        return cls.from_checkpoint(gate, up, down, scheme=scheme or BlockFP8(), group=group,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_gptq(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: GPTQ | None = None,
                  reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                  symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: {"qweight", "qzeros", "scales", "g_idx": optional (act-order), "bias": optional}.

        Act-order: down's K is sorted by group and cut (shard_gptq), and gate's and up's columns are cut in
        that order (gptq_row_index), so gate_up's shard is down's input as it is. gate and up are one GEMM
        where their g_idx agree (they do in GPTQ checkpoints: both quantize the same input), else two."""
        return cls.from_checkpoint(gate, up, down, scheme=scheme or GPTQ(), group=group,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_awq(cls, gate: Mapping, up: Mapping, down: Mapping, *, group=None, scheme: AWQ | None = None,
                 reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                 symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """gate, up, down: AutoAWQ "gemm" {"qweight", "qzeros", "scales", "bias": optional}."""
        return cls.from_checkpoint(gate, up, down, scheme=scheme or AWQ(), group=group,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    @classmethod
    def from_float(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, scheme: BlockFP8 | GPTQ | AWQ, *,
                   group=None, reduce_dtype: torch.dtype | None = None, all_reduce: str = "nccl",
                   symm_mem_max_bytes: int = comm.SYMM_MEM_MAX_BYTES) -> "ParallelMLP":
        """Quantize three float nn.Linear layers as kdsl.quantize_ does (FP8Linear.from_float: weight_quant in
        the scheme's blocks; W4A16Linear.from_float: round-to-nearest int4, no act-order), whole, so every rank's
        shards are those of the one-GPU quantized MLP, then cut them."""
        linears = {"gate": gate, "up": up, "down": down}
        for role, linear in linears.items():
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{role}: expected an nn.Linear, got {type(linear).__name__}")
        handler = handler_for(scheme)
        tensors = {role: handler.float_checkpoint(scheme, linear) for role, linear in linears.items()}
        return cls.from_checkpoint(**tensors, scheme=handler.checkpoint_scheme(scheme), group=group,
                                   reduce_dtype=reduce_dtype, all_reduce=all_reduce,
                                   symm_mem_max_bytes=symm_mem_max_bytes)

    # --- forward -----------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if self.fused_act:  # FP8: h quantized in down's activation groups, so down is one fp8_gemm
            return self.down.forward_silu_mul(h)
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
        return self.down.local.SILU_MUL_OP

