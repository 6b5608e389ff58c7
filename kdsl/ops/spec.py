"""An op as PyTorch sees it: one OpSpec per op, declared beside the op's public function in its family file
(kdsl/ops/<family>.py, a module-level `SPECS = (OpSpec(...), ...)`); kdsl.ops.library registers every declared
spec as torch.ops.kdsl.<name>, so adding an op touches its family file only.

What a spec holds and why:

- schema: the torch.library schema without the name, "(Tensor x, int group_size) -> (Tensor, Tensor)". None
  mutates its inputs; every output is a new contiguous tensor (a custom op may not return an alias of an input,
  so an op with `out=`, such as kdsl.ops.fp8_bmm, leaves it out of the schema: eagerly the Python function writes
  into out directly (no copy, no dispatcher); under torch.compile it calls the functional op and copies the
  result into out (out.copy_, which Dynamo traces as an ordinary in-place op). A mutating op (`Tensor(a!)? out`)
  could not return out, so it would need a second schema or a wrapper anyway, and auto_functionalize copies
  too). Block sizes, group sizes and bits are `int`, not `SymInt`: they pick a kernel, so a symbolic one is
  specialized (guarded) by Dynamo before the op sees it. Tensor sizes stay symbolic: under
  torch.compile(dynamic=True) one graph serves every M, because the Python that looks at M (tile choice,
  empty-M shortcuts, the 2-D fast path) runs inside the op, at run time, not in traced code; the fake kernels'
  checks on K and N become guards (K % 128 == 0), not specializations. (Dynamo's own 0/1 specialization still
  gives M = 1 a graph of its own, unless M is marked with torch._dynamo.mark_unbacked.) A Python object the
  public function takes (a W4A16Prepared, say) crosses the boundary as its tensors and plain fields.
- impl: the implementation (`_<op>_impl`, or an adapter that rebuilds what the public function takes from the
  op's arguments). Routing: the public functions (kdsl.ops.fp8_gemm, ...) call their implementation directly
  in eager mode: going through the dispatcher costs host microseconds per call, and eager decode is
  launch-bound. Under torch.compile (torch.compiler.is_compiling()), they call torch.ops.kdsl.<op> instead,
  which Dynamo records as one opaque node; its fake kernel gives the outputs' shapes, dtypes and strides, and
  the compiled graph runs the same implementation.
- fake: the fake kernel. Each op's checks live in one function, `_<op>_outputs`, that checks the arguments and
  allocates the empty outputs; the implementation and the fake kernel both call it, so the outputs the fake
  kernel describes are the ones the implementation returns, and a bad argument raises the same exception with
  the same message on both paths. Eagerly it raises before any launch. Under torch.compile it raises while
  Dynamo traces (the fake kernel runs then), and Dynamo reports it as torch._dynamo.exc.TorchRuntimeError whose
  message holds the original one ("got ValueError('b: N = 20 must be a multiple of 8')"). A check that needs
  data, not only metadata (gptq_gemm's and gptq_dequant's range check of g_idx's values), is left out of the
  fake kernel; the op raises it when it runs (ValueError, as eagerly). Checks of Python-only arguments made
  before the op is called (qzeros/scales missing in gptq_gemm, `prepared` not a W4A16Prepared, block_size not
  a pair) are plain Python raises in traced code: with fullgraph=True Dynamo stops with Unsupported ("Observed
  exception"); without it, Dynamo falls back to eager for that frame, which raises the original exception.
- host_syncing: the implementation waits on the GPU or copies from the host (a check of g_idx's values, awq_gemm
  preparing its weights on every call, awq_dequant's nibble order): a CUDA graph cannot capture it, so the op is
  tagged cudagraph_unsafe and torch.compile(mode="reduce-overhead") leaves it out. An op that reads the host only
  while no graph is being captured (the MoE ops' check_ids) stays capturable: it is not host_syncing.
- example: example(tile params, dtype, device) yields the arguments of a call of the op as its kernels' launch
  functions take them (kdsl.kernels.base.KernelImpl.launch, between `generated` and the tile), for a call that
  reaches the whole of the tile's code: every optional argument given (bias, g_idx, act-order's perm), K long
  enough for the tile's whole split, a partial last column; dtype is the activations' or the output's. Where an
  implementation refuses a call (its launch raises ValueError), the next call yielded is the one for it; calls that
  take other paths through the same kernels (moe_fp8 with and without its routing kernel) are yielded too. On meta
  tensors it describes launches without running them: tests/test_compile_matrix.py compiles their kernels for
  every arch from it (shared helpers: kdsl/ops/_examples.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kdsl.kernels.c_abi import OpAbi


@dataclass(frozen=True)
class OpSpec:
    """torch.ops.kdsl.<name>: its schema, implementation and fake kernel, and an example call of its kernels (see the
    module docstring)."""

    name: str
    schema: str
    impl: Callable
    fake: Callable
    host_syncing: bool = False
    example: Callable | None = None  # (tile params, dtype, device) -> launch arguments of example calls
    c_abi: OpAbi | None = None  # the op as `kdsl aot` exports it (None: not exported)

    @property
    def qualified_name(self) -> str:
        return f"kdsl::{self.name}"
