"""What a kernel implementation declares: the unit kdsl generates, validates, dispatches and tunes.

An implementation is one module under kdsl/kernels/<family>/: its `Options` model (the knobs only
it honours, validated there), the common tile fields it reads, its arch range, its shared-memory
estimate, its own validation rules, its template (device code only), its launch (the host code: from a
call's arguments to the launches it makes, as data that kdsl.runtime.launcher runs) and its run-time
refusal, and the values `kdsl tune` tries for its options. Tile geometry every GEMM shares (block sizes, warps, stages, group_m, split_k) lives in
kdsl.schema.Tile; everything else is an option of one implementation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from kdsl.kernels.c_abi import ImplLaunch
from kdsl.strict_model import StrictModel


class Launch(NamedTuple):
    """One kernel launch as data: kernel[grid](*params, **constexprs). params are the kernel's leading
    arguments in signature order, constexprs the keyword rest (constexprs and launch options such as
    num_warps); grid has three entries. A tuple: built on every call, so it must be cheap."""

    kernel: object
    grid: tuple
    params: tuple
    constexprs: dict


def dependent(launch: Launch) -> Launch:
    """The launch as a programmatic dependent launch (PDL) of the kernel before it on the stream, for a kernel
    that can be one: it takes a PDL constexpr (False as its launch describes it) under which it waits
    (gdc_wait) before reading anything that kernel writes; other launches come back unchanged. The caller
    knows what the kernel before it writes and checks kdsl.kernels.host.dependent_launches for the device."""
    if launch.constexprs.get("PDL") is not False:
        return launch
    return launch._replace(constexprs={**launch.constexprs, "PDL": True, "launch_pdl": True})


class Generated:
    """A generated module as its implementation's launch reads it for one scheme: `kernel`, the @jit kernel named
    after the module (`name`); `kernels`, each kernel named after it by the rest of its name ("" for `kernel`,
    "_down", ...); `module`, for the constants the template rendered (PACK, LAYOUT, ...); `constexprs`, the
    scheme's numbers its kernels take as constexpr arguments ({"GROUP_SIZE": 128, ...}: the module serves several
    schemes); `scheme`, the scheme's numbers a launch description names (kdsl.schema.scheme.launch_values);
    `layout`, the prepared weights layout its kernels read ("" for checkpoint tensors). Built once per module and
    scheme."""

    __slots__ = ("module", "name", "kernel", "kernels", "constexprs", "scheme", "layout")

    def __init__(self, module, name: str, constexprs: dict | None = None, scheme: dict | None = None):
        self.module = module
        self.name = name
        self.constexprs = constexprs or {}
        self.scheme = scheme or {}
        self.kernels = {attr[len(name):]: value for attr, value in vars(module).items()
                        if attr.startswith(name) and hasattr(value, "arg_names")}
        self.kernel = self.kernels.get("")
        self.layout = (getattr(module, "LAYOUT", None) or {}).get("weights") or ""


class NoOptions(StrictModel):
    """An implementation with no knobs of its own."""


def _no_shared(scheme, tile, options) -> int:
    return 0


def _no_problems(where: str, scheme, variant, tile, options) -> list[str]:
    return []


@dataclass(frozen=True)
class KernelImpl:
    family: str  # the scheme kind it serves
    op: str
    impl: str
    template: str  # path under kdsl/kernels (beside the unit); shared includes come from kdsl/codegen/templates
    min_arch: int  # hardware floor, e.g. 89 for fp8 tensor cores
    max_arch: int | None  # hardware cap, e.g. 90 for wgmma
    summary: str
    tile_knobs: frozenset[str]  # common Tile fields it reads, beyond m_max and num_warps
    options: type[StrictModel] = NoOptions
    shared_bytes: Callable[[object, object, object], int] = _no_shared  # (scheme, tile, options) -> bytes/program
    problems: Callable[..., list[str]] = field(default=_no_problems)  # (where, scheme, variant, tile, options)
    reads_prepared_weights: bool = False  # its variants must declare a `layout`
    min_block_m: int = 1  # 16 where block_m rows feed an MMA (tl.dot's smallest M)
    gemv_block_m: bool = False  # block_m = 1 selects a GEMV instead of the MMA
    gemv_max_m: int = 1  # the most rows its GEMV (block_m = 1) serves well
    # (Generated, *the op's launch arguments, tile params) -> a Launch or an iterable of them (kdsl.runtime.launcher):
    # kdsl.kernels.described.described(its launch description) for a unit the AOT C dispatcher launches too, else a
    # function of its own
    launch: Callable | None = None
    # (Generated, tile params, kdsl.runtime Call) -> why the tile should not serve the call, or None
    refusal: Callable | None = None
    # A dequantizer: the op whose dequantize + cuBLAS path it serves (that op's variants set dequant_min_m).
    dequant_for: str | None = None
    # `kdsl tune`'s values for its options, per kind of bucket (kdsl.tune.space: "decode", "mid", "prefill",
    # "gemv"): {"prefill": {"persistent": (False, True)}}. An option left out keeps the current tile's value.
    tune_grid: Mapping[str, Mapping[str, tuple]] = field(default_factory=dict)

    @property
    def launch_descriptions(self) -> Mapping[str, ImplLaunch]:
        """Its launch descriptions by the prepared weights layout of the entry it serves ("": any), which its launch
        evaluates and the AOT C dispatcher compiles; none (a launch function of its own): `kdsl aot` does not
        export it."""
        return getattr(self.launch, "descriptions", {})

    def resolve(self, tile) -> StrictModel:
        """The tile's options, validated by this implementation's model, defaults filled."""
        return self.options.model_validate(tile.options)


# n_min: GEMM call sites pass N to the tile selection (kdsl.runtime KernelEntry.tile_for).
GEMM_KNOBS = frozenset({"block_m", "block_n", "block_k", "group_m", "num_stages", "n_min"})


def warpgroup_per_64(where: str, what: str, field_name: str, size: int, num_warps: int) -> list[str]:
    """The Gluon kernels give each warpgroup (4 warps) one wgmma of 64 rows of the tile's `field_name`."""
    if size == 16 * num_warps and num_warps in (4, 8):
        return []
    return [f"{where}: needs one warpgroup per 64 {what}: {field_name} = 64 with num_warps = 4 or "
            f"{field_name} = 128 with num_warps = 8 (got {field_name} = {size}, num_warps = {num_warps})"]
