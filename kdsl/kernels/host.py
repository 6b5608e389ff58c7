"""Host arithmetic the implementations' launch functions share: ceil division, the SM count, the K split and its
scratch, persistent grids and Gluon TMA descriptors. Pure Python over torch; nothing here launches a kernel.

Launch functions take the CPU for Triton's interpreter and any other device for the GPU: CUDA, or meta, where a
launch is only described (tests/test_compile_matrix.py compiles the kernels of launches described on meta tensors)."""
from __future__ import annotations

import functools
import os
import sys
import threading

import torch

from kdsl.kernels import expressions
# Programs per SM the K split plans for (and a persistent grid launches), unless a tile's split_fill says how many
# of its programs fit on an SM at once (1 for a tile that takes a whole SM).
from kdsl.kernels.expressions import SPLIT_FILL

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(n: int, d: int) -> int:
    # Host code's ceil division: triton.cdiv is a constexpr function, about 3 us a call on the host.
    return -(-n // d)


def next_power_of_two(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): tl.arange sizes and tiles that cover n."""
    return 1 << max(n - 1, 0).bit_length()


_SM_COUNT: dict = {}
DESCRIBED_SM_COUNT = 132  # the SMs a launch described on meta tensors plans for: an H100's


def sm_count(device) -> int:
    if device.type == "meta":
        return DESCRIBED_SM_COUNT
    if device.type != "cuda":
        return expressions.INTERPRETER_SMS  # Triton's CPU interpreter: a few programs still exercise the loops
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def split_for(tile: dict, k_steps: int, tiles: int, sms: int | None) -> int:
    """The K split a tile launches with (kdsl.kernels.expressions.split_for, which launch descriptions call): at
    most the tile's SPLIT_K, each split at least its split_min_steps K steps; with an SM count, the split whose
    programs finish soonest on them (sms None, the interpreter: the largest split allowed)."""
    return expressions.split_for(k_steps, tiles, tile["SPLIT_K"], tile["split_min_steps"] or 0,
                                 tile["split_fill"] or 0, sms)


_DEPENDENT_LAUNCHES: dict = {}


def dependent_launches(device) -> bool:
    """Whether launches on `device` can be programmatically dependent (PDL, griddepcontrol): sm_90 and later,
    not the interpreter or the meta device."""
    if INTERPRETING or device.type != "cuda":
        return False
    if device.index not in _DEPENDENT_LAUNCHES:
        _DEPENDENT_LAUNCHES[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return _DEPENDENT_LAUNCHES[device.index]


def programs_for(sms: int, tiles: int, tile: dict) -> int:
    """Persistent tiles: as many programs as fit on the SMs at once (split_fill per SM) loop over the tiles;
    else one program per tile (kdsl.kernels.expressions.programs, which launch descriptions call)."""
    return expressions.programs(tiles, tile["persistent"], tile["split_fill"] or SPLIT_FILL, sms)


# (kernel, device) -> (fp32 workspace, int32 counters) of the split-K store (common/splitk_store.py.j2).
# kdsl/ops/_plan.py passes these to a replayed launch by address.
SPLITK_SCRATCH: dict = {}


def split_with_scratch(kernel, out, tile: dict, k_steps: int, tiles: int, sms: int | None, tile_elems: int):
    """(split_k, workspace, counters) of a launch of kernel: the K split split_for picks for the tile, and the
    scratch its partials go through (out itself, unused, where there is no split)."""
    split_k = split_for(tile, k_steps, tiles, sms)
    if split_k == 1:
        return 1, out, out
    return (split_k, *splitk_scratch(kernel, out.device, tiles, split_k, tile_elems))


def splitk_scratch(kernel, device, tiles: int, split_k: int, tile_elems: int):
    """(fp32 workspace, int32 counters) for `tiles` output tiles of tile_elems each, split split_k ways."""
    return scratch_buffers(kernel, device, tiles * split_k * tile_elems, tiles)


def scratch_buffers(kernel, device, need: int, tiles: int):
    """(fp32 workspace of at least `need` elements, int32 counters for `tiles` output tiles) of the split-K store,
    kept per kernel and device and grown on demand.

    Counters start at zero and every launch leaves them at zero, so no memset per call.
    Launches that share a kernel and a device must not run concurrently on different streams.
    """
    workspace, counters = SPLITK_SCRATCH.get((kernel, device), (None, None))
    if workspace is not None and workspace.numel() >= need and counters.numel() >= tiles:
        return workspace, counters
    need = max(need, 0 if workspace is None else workspace.numel())
    tiles = max(tiles, 0 if counters is None else counters.numel())
    to_graph_pool = device.type == "cuda" and _allocating_to_graph_pool(device)
    if not to_graph_pool:
        workspace, counters = _new_scratch(device, need, tiles)
    elif not torch.cuda.is_current_stream_capturing():
        # torch.compile's CUDA graph trees warming a graph up: their pool takes this thread's allocations and
        # refuses buffers that outlive the call. A helper thread's go to the ordinary pool, so the buffers are kept
        # and the graph recorded next finds them: zeroed once here, not by a memset in every replay (an FP8 Llama
        # layer's four split-K GEMMs recorded three a layer).
        workspace, counters = _on_helper_thread(_new_scratch, device, need, tiles)
    else:
        # Inside a capture (no warm-up run before it): the buffers belong to that graph, and their zeroing is
        # recorded for its replays, not run now.
        return _new_scratch(device, need, tiles)
    SPLITK_SCRATCH[(kernel, device)] = (workspace, counters)
    return workspace, counters


def _new_scratch(device, need: int, tiles: int):
    return torch.empty(need, dtype=torch.float32, device=device), torch.zeros(tiles, dtype=torch.int32, device=device)


def _on_helper_thread(make, device, *args):
    """make(device, *args) run on a helper thread (allocations there go to the ordinary pool), its work on the
    device finished before this returns."""
    result: dict = {}

    def run():
        try:
            with torch.cuda.device(device):
                result["value"] = make(device, *args)
                torch.cuda.current_stream(device).synchronize()
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            result["error"] = error

    helper = threading.Thread(target=run, name="kdsl-scratch")
    helper.start()
    helper.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _allocating_to_graph_pool(device) -> bool:
    """Whether new allocations go to a CUDA graph's memory pool: a capture, or torch.compile's CUDA graph trees
    warming a graph up in their pool (which refuses a buffer that outlives the call)."""
    if torch.cuda.is_current_stream_capturing():
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # only where torch.compile has loaded them
    try:
        manager = trees and trees.get_manager(device.index, create_if_none_exists=False)
        return bool(manager and manager.in_warmup)
    except (AttributeError, KeyError, TypeError):  # another torch's internals: as before, keep the buffers
        return False


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    # A pure function of its arguments, and a noticeable part of a launch's host time.
    from triton.experimental.gluon import language as gl

    element = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
               torch.float32: gl.float32, torch.int32: gl.int32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.lru_cache(maxsize=1)
def _gluon_descriptor_type():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor


def gluon_descriptor(t, block, shape=None, strides=None):
    """A Gluon TMA descriptor over the 2-D tensor t (unit stride along its rows; or t's memory as `shape` and
    `strides`), loading `block` at a time."""
    shape = list(t.shape) if shape is None else shape
    strides = [t.stride(0), 1] if strides is None else strides
    return _gluon_descriptor_type()(t, shape, strides, list(block), _shared_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=1)
def _tma_descriptor_type():
    # Imported on the first launch, not with kdsl: `import kdsl` does not import Triton.
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor


def tma_descriptor(t, shape: list, strides: list, block: list):
    """A Triton host TMA descriptor over t."""
    return _tma_descriptor_type()(t, shape, strides, block)
