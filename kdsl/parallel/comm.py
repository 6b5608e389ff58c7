"""The collectives of kdsl.parallel's layers, all capturable in a CUDA graph (no host sync per call).

all_reduce_: the sum over the group. "nccl" (the default) is dist.all_reduce, in place. "symm_mem" is torch's
symmetric-memory one-shot all-reduce (torch.ops.symm_mem.one_shot_all_reduce_copy_out, where the installed
torch has torch.distributed._symmetric_memory): each rank copies its partial into a buffer every rank can read
over NVLink and sums the peers' copies itself, one kernel with a barrier at its start and end, which at decode
sizes beats NCCL's latency. It serves CUDA tensors of bfloat16 or float32 (what torch's kernel dispatches)
up to max_bytes on an NCCL group; anything else, or a machine where the buffer cannot be set up, takes NCCL.
The buffer is one per (group, device, dtype), shared by every layer (the kernel's closing barrier makes the
next call's copy safe), and set up by a collective on the first eager call: run the model once before
capturing a graph (or call symm_mem_buffer first).

all_gather_last_dim: each rank's [..., n] into [..., world * n], rank r's columns at r * n, with one
all_gather_into_tensor into a contiguous [world, rows, n] buffer; at M = 1 that buffer is the output as it
is, else one copy interleaves the ranks' columns (NCCL gathers contiguous chunks only).
"""
from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import torch.distributed as dist

ALL_REDUCE = ("nccl", "symm_mem")
SYMM_MEM_MAX_BYTES = 1 << 20  # decode sizes: 1 MiB is M = 73 rows of 7168 bf16 outputs
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # torch's one-shot kernel dispatches these

_buffers: dict[tuple, torch.Tensor | None] = {}  # (group name, device, dtype) -> symmetric buffer, None: unavailable
_warned: set[str] = set()


def comm_dtype(dtype: torch.dtype, group) -> torch.dtype:
    """gloo does not reduce or gather bfloat16 on every build: carry it as float32 there."""
    if dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        return torch.float32
    return dtype


def check_all_reduce(all_reduce: str) -> str:
    if all_reduce not in ALL_REDUCE:
        raise ValueError(f"all_reduce: expected one of {', '.join(map(repr, ALL_REDUCE))}, got {all_reduce!r}")
    return all_reduce


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"kdsl.parallel: all_reduce='symm_mem' unavailable ({reason}); using NCCL", stacklevel=3)


def _symm_ops():
    """torch.ops.symm_mem's one-shot all-reduce ops, importing their module; None where torch has none."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  registers torch.ops.symm_mem
        ops = torch.ops.symm_mem
        ops.one_shot_all_reduce_out  # noqa: B018  (raises where the op is missing)
        return ops
    except (ImportError, AttributeError, RuntimeError):
        return None


@functools.cache
def _has_copy_out() -> bool:
    try:
        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _local_reason(device: torch.device, dtype: torch.dtype, group) -> str | None:
    """Why this rank cannot run the one-shot kernel, the same on every rank of a group (or None)."""
    if device.type != "cuda":
        return f"tensors on {device.type}, not CUDA"
    if dist.get_backend(group) != "nccl":
        return f"backend {dist.get_backend(group)}, not nccl"
    if dtype not in SYMM_MEM_DTYPES:
        return f"{dtype} (the one-shot kernel takes bfloat16 and float32)"
    if _symm_ops() is None:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out"
    return None


def _all_ranks(ok: bool, device: torch.device, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def symm_mem_buffer(group, device, dtype: torch.dtype, nbytes: int = SYMM_MEM_MAX_BYTES) -> torch.Tensor | None:
    """The group's symmetric buffer for dtype on device, set up on first use (a collective: every rank of the
    group calls it, outside CUDA-graph capture); None where the one-shot all-reduce is unavailable. The first
    call's nbytes sets the buffer's size."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (_group_name(group), device, dtype)
    if key in _buffers:
        return _buffers[key]
    reason = _local_reason(device, dtype, group)
    if reason is None and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kdsl.parallel: all_reduce='symm_mem' sets up its buffer with a collective, which a "
                           "CUDA graph cannot capture: run the layer once eagerly before capturing")
    buffer = None
    if _all_ranks(reason is None, device, group):  # every rank takes the same way: NCCL or one-shot
        try:
            import torch.distributed._symmetric_memory as symm_mem

            # The one-shot kernel reads the peers' buffers through their addresses: no multicast object needed.
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and not getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda _: False)(key[0]):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # deprecated (no longer needed) in newer torch
                    enable(key[0])
            with torch.inference_mode(False):  # a normal tensor: every later call writes into it
                buffer = symm_mem.empty(max(nbytes // dtype.itemsize, 1), dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, key[0])
        except Exception as error:  # no P2P, no handle exchange, ...: NCCL it is, on every rank
            reason, buffer = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", None
        if not _all_ranks(buffer is not None, device, group):
            reason, buffer = reason or "another rank could not set up its buffer", None
    else:
        reason = reason or "another rank cannot run it"
    if buffer is None:
        _warn_once(reason)
    _buffers[key] = buffer
    return buffer


def all_reduce_(t: torch.Tensor, group, all_reduce: str = "nccl", max_bytes: int = SYMM_MEM_MAX_BYTES) -> torch.Tensor:
    """The sum of t over group: t itself, reduced in place (NCCL), or a new tensor (symm_mem)."""
    nbytes = t.numel() * t.element_size()
    if all_reduce == "symm_mem" and 0 < nbytes <= max_bytes and nbytes % 16 == 0:
        buffer = symm_mem_buffer(group, t.device, t.dtype, max(max_bytes, SYMM_MEM_MAX_BYTES))
        src = t.contiguous().view(-1)
        if buffer is not None and src.numel() <= buffer.numel() and src.storage_offset() * src.element_size() % 16 == 0:
            out, mine, ops = torch.empty_like(src), buffer[:src.numel()], torch.ops.symm_mem
            if _has_copy_out():  # the copy into the buffer inside the kernel, where torch has that op
                ops.one_shot_all_reduce_copy_out(mine, src, "sum", _group_name(group), out)
            else:
                mine.copy_(src)
                ops.one_shot_all_reduce_out(mine, "sum", _group_name(group), out)
            return out.view(t.shape)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_last_dim(y: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """[..., n] on each rank -> [..., world_size * n], rank r's columns at [r * n, (r + 1) * n)."""
    *lead, n = y.shape
    rows = math.prod(lead)
    dtype = comm_dtype(y.dtype, group)
    out = torch.empty((world_size * rows, n), dtype=dtype, device=y.device)  # rank r's rows at r * rows
    if rows and n:
        dist.all_gather_into_tensor(out, y.reshape(rows, n).to(dtype).contiguous(), group=group)
    out = out.view(world_size, rows, n)
    full = out.view(rows, world_size * n) if rows == 1 else out.permute(1, 0, 2).reshape(rows, world_size * n)
    return full.to(y.dtype).view(*lead, world_size * n)
