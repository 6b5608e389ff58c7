"""What every scheme unit provides, and the pieces its units share.

A SchemeHandler is one quantization format's code for kdsl.nn and kdsl.parallel: the module a float nn.Linear
becomes (quantize_), the checkpoint formats it reads (LayerFormat: tensor specs per layer and how they become a
module) and its tensor-parallel shard rules. nn.convert, kdsl.checkpoint and kdsl.parallel look the handler up by
the scheme's type (kdsl.nn.schemes.handler_for) instead of branching on it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kdsl.schema import HFQuantization

HALVES = ("F16", "BF16")
FLOATS = HALVES + ("F32",)
ACT_DTYPES = (torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """The checkpoint does not fit the model: names the tensor, the expected and the found shape or dtype."""


class ShardError(ValueError):
    """A tensor cannot be cut for a rank: names the tensor, the rank and the shape."""


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    required: bool = True


def act_dtype_of(scales: torch.Tensor, act_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype int4 layers compute in: the model's (or load_quantized's dtype=), else the scales'."""
    if act_dtype in ACT_DTYPES:
        return act_dtype
    return scales.dtype if scales.dtype in ACT_DTYPES else torch.float16


# --- checkpoint formats -----------------------------------------------------------------------------------

class LayerFormat:
    """One checkpoint format's quantized linear: marker is the role whose tensor marks a layer as quantized."""

    marker = "weight"
    tp = False  # load_quantized's tp_plan can cut these layers (kdsl.parallel)
    experts = False  # reads per-expert tensors into transformers' fused experts modules (expert_specs, build_experts)

    def __init__(self, hf: HFQuantization):
        self.hf, self.scheme = hf, hf.scheme

    def marks(self, dtype: str) -> bool:
        return True

    def specs(self, k: int, n: int) -> dict[str, Spec]:
        raise NotImplementedError

    def build(self, t: dict[str, torch.Tensor], act_dtype: torch.dtype | None) -> nn.Module:
        raise NotImplementedError

    def check_values(self, key: str, role: str, tensor: torch.Tensor, k: int, n: int) -> None:
        """Checks on tensor values (read at build time): CheckpointError naming the tensor."""

    def read_dtypes(self, act_dtype: torch.dtype | None) -> dict[str, torch.dtype]:
        """{role: dtype} the tensor-parallel MLP converts lazily read tensors to as they are read."""
        return {}


# --- shard rules: the common checks -----------------------------------------------------------------------

DIMS = ("column", "row")
PACK = 8  # int4 values per int32


def whole(t) -> torch.Tensor:
    """A tensor, or everything of a lazily read checkpoint tensor (anything indexable like one)."""
    return t if isinstance(t, torch.Tensor) else t[:]


def check_rank(rank: int, world_size: int, dim: str) -> None:
    if dim not in DIMS:
        raise ValueError(f"dim: expected 'column' or 'row', got {dim!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")


def even(name: str, shape, axis_name: str, total: int, rank: int, world: int, multiple: int = 1,
         why: str = "") -> tuple[int, int]:
    """[start, end) of rank's even share of total, or ShardError naming the tensor, rank and shape."""
    size = total // world
    if total % world or size % multiple:
        need = f"{axis_name} / {world} = {total / world:g} must be a whole number" + (
            f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ShardError(f"{name} {tuple(shape)}: cannot cut rank {rank} of {world}: {need}"
                         + (f" ({why})" if why else ""))
    return rank * size, (rank + 1) * size


# --- what a handler's shard rules give kdsl.parallel ------------------------------------------------------

@dataclass
class ColumnShard:
    """A rank's output-feature shard as a module: ColumnParallelLinear wraps it."""
    local: nn.Module
    out_features: int              # the whole layer's N
    out_slice: slice | None = None  # the real outputs among local's (FP8 off-grid shards carry padding)


@dataclass
class RowShard:
    """A rank's input-feature shard as a module: RowParallelLinear wraps it and adds bias after the reduce."""
    local: nn.Module
    in_features: int                # the whole layer's K
    in_index: torch.Tensor | slice | None
    bias: torch.Tensor | None


@dataclass
class GateUpShard:
    """A gated MLP's gate and up column shards for one rank: one module computing both (gate_slice, up_slice of
    its output) or, where they cannot share a GEMM, gate's module and up's."""
    local: nn.Module
    gate_slice: slice
    up_slice: slice | None = None
    up: nn.Module | None = None


def tensor_of(t: Mapping, role: str, name: str, optional: bool = False):
    """t[name] of the linear called role, refusing a t that is not a mapping and a missing required tensor."""
    if not isinstance(t, Mapping):
        raise TypeError(f"{role}: expected a mapping of checkpoint tensors (e.g. {{'{name}': ...}}), "
                        f"got {type(t).__name__}")
    if name not in t or t[name] is None:
        if optional:
            return None
        raise KeyError(f"{role}: no {name!r} among {sorted(t)}")
    return t[name]


def same_shape(role: str, name: str, tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{role}.{name}: expected shape {tuple(expected)} (from the other linears), "
                         f"got {tuple(tensor.shape)}")


def cat_bias(biases: list, sizes: list[int]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    like = next(b for b in biases if b is not None)
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in zip(biases, sizes)])


# --- the handler ------------------------------------------------------------------------------------------

class SchemeHandler:
    """One scheme type's code for kdsl.nn and kdsl.parallel (registered in kdsl.nn.schemes.HANDLERS).

    scheme_type: the Pydantic scheme it serves; module_class: the nn.Module its layers become; formats: the
    checkpoint formats (quantization_config source -> LayerFormat) whose layers it builds; tensors: the
    checkpoint tensor names of one linear, as (name, optional), in the order the tensor-parallel constructors
    take them."""

    scheme_type: type
    module_class: type[nn.Module]
    formats: dict[str, type[LayerFormat]] = {}
    tensors: tuple[tuple[str, bool], ...] = ()

    # quantize_: the module factory
    def unservable(self, scheme, k: int, n: int) -> str | None:
        """Why the scheme's kernels cannot take a linear of in_features k, out_features n (None: they can)."""
        raise NotImplementedError

    def from_float(self, scheme, linear: nn.Linear) -> nn.Module:
        """A float nn.Linear quantized into module_class (what quantize_ puts in its place)."""
        raise NotImplementedError

    def float_checkpoint(self, scheme, linear: nn.Linear) -> dict[str, torch.Tensor | None]:
        """A float nn.Linear quantized as from_float does, as the checkpoint tensors of checkpoint_scheme."""
        raise NotImplementedError

    def checkpoint_scheme(self, scheme):
        """The scheme float_checkpoint's tensors are in."""
        return scheme

    # kdsl.parallel: shard rules
    def read(self, t: Mapping, role: str) -> dict[str, torch.Tensor | None]:
        """The tensors of the linear called role out of mapping t, each required one present (else KeyError)."""
        return {name: tensor_of(t, role, name, optional) for name, optional in self.tensors}

    def column_shard(self, scheme, t: Mapping, *, rank: int, world_size: int, out_index=None) -> ColumnShard:
        """This rank's output-feature shard of the linear whose tensors t holds (out_index: GPTQ act-order's)."""
        raise NotImplementedError(self._no_shard_rules())

    def row_shard(self, scheme, t: Mapping, *, rank: int, world_size: int) -> RowShard:
        """This rank's input-feature shard of the linear whose tensors t holds."""
        raise NotImplementedError(self._no_shard_rules())

    def gate_up_shard(self, scheme, gate: Mapping, up: Mapping, down: Mapping, *, rank: int,
                      world_size: int) -> GateUpShard:
        """gate's and up's column shards producing exactly the features down's row shard reads, in its order;
        down is read() already."""
        raise NotImplementedError(self._no_shard_rules())

    def _no_shard_rules(self) -> str:
        return f"kdsl.parallel: {self.scheme_type.__name__} has no tensor-parallel shard rules yet"
