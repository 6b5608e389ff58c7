"""Launch exported cubins from Python: `kdsl.aot.load(DIR)` or KDSL_AOT=DIR.

DIR is a folder written by `python -m kdsl aot` (its aot_manifest.json and cubins/; the C library need not be
built). While DIR is loaded it is a backend of kdsl.runtime.launcher (_serve): a launch of a kernel DIR
exports whose specialization (the constexprs and launch options the launch passes, and Triton's rules for the
arguments: integers equal to 1 or divisible by 16, pointers 16-byte aligned, 32- or 64-bit integers; a host TMA
descriptor's element type and block, and for Gluon's its NVMMA layout) was exported runs its cubin through the
CUDA driver, compiling nothing; any other launch goes to Triton's JIT as before (counted in stats()). A
descriptor argument is passed as the C launcher (kdsl__launch) passes it: a CUtensorMap encoded with
cuTensorMapEncodeTiled from the descriptor's base, shape and strides and the compiled kernel's box, swizzle and
element type (the manifest's per-spec `tma`), then its shape as int32s and strides as int64s, as many as the
export read from the PTX.
KDSL_AOT=DIR is loaded where the registry imports the first generated module: importing this module adds its
hook to kdsl.runtime.manifest (kdsl's package imports it), so the runtime never imports kdsl.aot, and no module
is patched.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path

from kdsl.aot.emit import AOT_FORMAT
from kdsl.aot.plan import int_key, pointer_key
from kdsl.runtime import launcher, manifest, registry

AOT_ENV = "KDSL_AOT"

_TRITON_TYPES = {
    "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float8_e4m3fn": "fp8e4nv",
    "torch.float8_e5m2": "fp8e5", "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8",
    "torch.int8": "i8", "torch.int16": "i16", "torch.bool": "i1",
}

_lock = threading.Lock()
_POINTER_TYPES: dict = {}  # torch dtype -> Triton pointer type, filled by load()
_DESCRIPTORS: dict = {}  # host TMA descriptor class -> True for Gluon's (names an NVMMA layout), filled by load()
_GLUON_LAYOUTS: dict = {}  # (block, element) -> the default NVMMA shared layout the exporter compiled with
_library = None  # the loaded AotLibrary
_wrappers: dict = {}  # JIT kernel launched through kdsl.runtime.launcher -> its AotKernel, or None (not exported)
_stats = {"aot": 0, "jit": 0}


class AotError(RuntimeError):
    """An export folder that cannot be used (missing, another format, or a CUDA driver call failed)."""


def argument_key(arg) -> tuple | None:
    """Triton's specialization of one kernel argument, as the exporter writes it: (type, claim)."""
    if type(arg) is int:
        return int_key(arg)
    data_ptr = getattr(arg, "data_ptr", None)
    if data_ptr is not None:
        element = _TRITON_TYPES.get(str(arg.dtype))
        return None if element is None else ("*" + element, pointer_key(data_ptr()))
    return None


class AotLibrary:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        path = self.folder / "aot_manifest.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise AotError(f"{path} does not exist: write it with `python -m kdsl aot --out {self.folder}`") from None
        if data.get("format") != AOT_FORMAT:
            raise AotError(f"{path} has format {data.get('format')!r}, this kdsl reads {AOT_FORMAT}")
        self.manifest = data
        self.tables: dict = {}  # kernel -> {(options key, argument key): spec}
        for spec in data["specializations"]:
            options = tuple(sorted({**spec["constexprs"], **spec["options"]}.items()))
            arguments = tuple((p["type"], p["claim"]) for p in spec["params"])
            self.tables.setdefault(spec["kernel"], {})[(options, arguments)] = spec
        self.functions: dict = {}  # (context, spec name) -> CUfunction
        self.driver = None

    def function(self, spec: dict, device=None):
        if self.driver is None:
            self.driver = _Driver()
        context = self.driver.current_context()
        if not context and device is not None:  # a thread where the CUDA runtime has not made one current yet
            import torch

            torch.cuda.set_device(device)
            context = self.driver.current_context()
        if not context:
            raise AotError("no CUDA context is current on this thread")
        key = (context, spec["name"])
        function = self.functions.get(key)
        if function is None:
            with _lock:
                function = self.functions.get(key)
                if function is None:
                    image = (self.folder / spec["cubin"]).read_bytes()
                    function = self.driver.load(image, spec["symbol"], spec["shared"])
                    self.functions[key] = function
        return function


class _Driver:
    """The few CUDA driver calls a launch needs, through ctypes."""

    def __init__(self, cuda=None):
        if cuda is None:
            try:
                cuda = ctypes.CDLL(os.environ.get("KDSL_AOT_LIBCUDA") or "libcuda.so.1")
            except OSError as error:
                raise AotError(f"cannot open the CUDA driver: {error}") from None
        self.cuda = cuda
        self.cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        # TMA descriptors (CUDA 12.0+); a driver without it still serves every other launch.
        self.encode_tiled = getattr(self.cuda, "cuTensorMapEncodeTiled", None)
        if self.encode_tiled is not None:
            u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            self.encode_tiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                                          u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.maps: dict = {}  # a descriptor's encode arguments -> its kernel arguments (CUtensorMap, ...), bounded

    def check(self, status: int, call: str) -> None:
        if status:
            text = ctypes.c_char_p()
            self.cuda.cuGetErrorString(status, ctypes.byref(text))
            raise AotError(f"{call} failed: CUDA error {status} ({(text.value or b'?').decode()})")

    def current_context(self) -> int:
        context = ctypes.c_void_p()
        self.check(self.cuda.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        return context.value or 0

    def load(self, image: bytes, entry: str, shared: int):
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        buffer = ctypes.create_string_buffer(image, len(image))
        self.check(self.cuda.cuModuleLoadData(ctypes.byref(module), buffer), "cuModuleLoadData")
        self.check(self.cuda.cuModuleGetFunction(ctypes.byref(function), module, entry.encode()),
                   "cuModuleGetFunction")
        if shared > 49152:
            self.check(self.cuda.cuFuncSetAttribute(function, 8, ctypes.c_int(shared)),  # MAX_DYNAMIC_SHARED_SIZE
                       "cuFuncSetAttribute")
        return function

    def descriptor(self, how: tuple, address: int, shape: tuple, strides: tuple) -> list:
        """A descriptor's kernel arguments as kdsl__launch passes them: its CUtensorMap, then `shapes` int32
        (its shape) and `strides` int64 (its strides). Kept per argument set (they depend on nothing else; the
        driver copies them at each launch), so a repeated call encodes and converts nothing."""
        key = (how, address, shape, strides)
        found = self.maps.get(key)
        if found is None:
            host_type, elem_size, box, swizzle, shapes, stride_params = how
            found = [self.tensor_map(host_type, address, shape, strides, elem_size, box, swizzle)]
            found += [ctypes.c_int32(shape[d]) for d in range(shapes)]
            found += [ctypes.c_int64(strides[d]) for d in range(stride_params)]
            if len(self.maps) >= 4096:
                self.maps.clear()
            self.maps[key] = found
        return found

    def tensor_map(self, host_type: int, address: int, shape: tuple, strides: tuple, elem_size: int, box: tuple,
                   swizzle: int):
        """A 128-byte CUtensorMap (64-byte aligned) as the C launcher's encode_tma and Triton's launcher
        (fill_tma_descriptor_tiled) build it: sizes innermost first, byte strides of every dimension but the
        innermost, element strides 1, no interleave, the kernel's swizzle and box, L2 promotion 128B, zero fill."""
        if self.encode_tiled is None:
            raise AotError("the CUDA driver has no cuTensorMapEncodeTiled (CUDA 12.0 or newer): TMA kernels cannot run")
        rank = len(shape)
        storage = ctypes.create_string_buffer(128 + 64)
        tensor_map = (ctypes.c_ubyte * 128).from_buffer(storage, -ctypes.addressof(storage) % 64)
        dims = (ctypes.c_uint64 * rank)(*shape[::-1])
        byte_strides = (ctypes.c_uint64 * max(1, rank - 1))(*[s * elem_size for s in strides[:-1]][::-1])
        boxes = (ctypes.c_uint32 * rank)(*box[::-1])
        element_strides = (ctypes.c_uint32 * rank)(*[1] * rank)
        self.check(self.encode_tiled(ctypes.addressof(tensor_map), host_type, rank, address, dims, byte_strides,
                                     boxes, element_strides, 0, swizzle, 2, 0),  # INTERLEAVE_NONE, L2_128B, FILL_NONE
                   f"cuTensorMapEncodeTiled (base 0x{address:x}, shape {list(shape)}, strides {list(strides)})")
        return tensor_map

    def launch(self, function, grid, threads: int, shared: int, stream: int, arguments: list) -> None:
        pointers = (ctypes.c_void_p * max(1, len(arguments)))(*[ctypes.addressof(a) for a in arguments])
        self.check(self.cuda.cuLaunchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, shared,
                                            ctypes.c_void_p(stream), pointers, None), "cuLaunchKernel")


class AotKernel:
    """The exported launches of one @triton.jit kernel: serve(grid, params, options) runs a launch's cubin.

    The per-call path is kept short (host time matters for decode): the specialization is looked up under
    the options in the order the launch passes them, and each spec's argument conversions are prepared once."""

    def __init__(self, jit, table: dict, library: AotLibrary):
        self.jit, self.table, self.library = jit, table, library
        self._fast: dict = {}  # (options as passed, argument keys) -> prepared launch, or None (JIT)

    def _prepare(self, options: dict, keys: tuple):
        # launch_pdl (fp8_bmm's pdl tiles) is a launch attribute, not part of what was compiled: the export
        # compiles those tiles without it and the cubin is launched without the programmatic-dependent-launch
        # attribute, as the C launcher does. That is correct: without the attribute the launch is ordered after
        # the previous work on the stream, so the kernel's grid-dependency wait (gdc_wait) finds its producer
        # finished and its early trigger (gdc_launch_dependents) has nothing to release; only the overlap of
        # its prologue with the producer's tail is lost.
        options = {name: value for name, value in options.items() if name != "launch_pdl"}
        spec = None if None in keys else self.table.get((tuple(sorted(options.items())), keys))
        if spec is None:
            return None
        passed, maps = [], iter(spec.get("tma") or ())
        for index, param in enumerate(spec["params"]):
            if param["claim"] == "1":
                continue  # compiled in
            if param["kind"] == "desc":
                tma = next(maps)
                passed.append((index, _DESC, (tma["host_type"], tma["elem_size"], tuple(tma["box"]), tma["swizzle"],
                                              tma["shape_params"], tma["stride_params"])))
            elif param["kind"] == "ptr":
                passed.append((index, _PTR, None))
            else:
                passed.append((index, _INT, ctypes.c_int32 if param["type"] == "i32" else ctypes.c_int64))
        return spec, tuple(passed), spec["hidden"], spec["num_warps"] * 32, spec["shared"]

    def serve(self, grid, params, options) -> bool:
        """Launch the exported cubin of this specialization: True; False where the export has none (counted:
        the launch goes to Triton's JIT)."""
        keys = tuple(map(_argument_key, params))
        fast_key = (tuple(options.items()), keys)
        try:
            prepared = self._fast[fast_key]
        except KeyError:
            prepared = self._fast[fast_key] = self._prepare(options, keys)
        except TypeError:  # an unhashable argument: not something the export covers
            prepared = None
        if prepared is None:
            _stats["jit"] += 1
            return False
        _stats["aot"] += 1
        spec, passed, hidden, threads, shared = prepared
        if callable(grid):
            grid = grid(options)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return True
        device = next(getattr(p, "base", p).device for p in params if hasattr(getattr(p, "base", p), "data_ptr"))
        function = self.library.function(spec, device)
        driver = self.library.driver
        arguments = []
        for i, kind, how in passed:
            param = params[i]
            if kind is _PTR:
                arguments.append(ctypes.c_uint64(param.data_ptr()))
            elif kind is _INT:
                arguments.append(how(param))
            else:  # a TMA descriptor: as the C launcher passes it, its CUtensorMap, shape (int32), strides (int64)
                arguments += driver.descriptor(how, param.base.data_ptr(), tuple(param.shape), tuple(param.strides))
        arguments += [ctypes.c_uint64(0)] * hidden
        driver.launch(function, grid, threads, shared, _stream(device), arguments)
        return True


_NOT_EXPORTED = None


def _serve(launch) -> bool:
    """kdsl.runtime.launcher's backend while an export is loaded: run the launch from its cubin where the export
    has the kernel's specialization (True), else leave it to Triton's JIT (False)."""
    kernel = launch.kernel
    try:
        wrapper = _wrappers[kernel]
    except KeyError:
        table = _library.tables.get(getattr(kernel, "__name__", None))
        wrapper = _wrappers[kernel] = _NOT_EXPORTED if table is None else AotKernel(kernel, table, _library)
    return wrapper is not _NOT_EXPORTED and wrapper.serve(launch.grid, launch.params, launch.constexprs)


_PTR, _INT, _DESC = "ptr", "int", "desc"


def _descriptor_key(arg, gluon: bool):
    """A host TMA descriptor's specialization as the exporter writes it (tensordesc<element[block]>), or None
    (to the JIT) for one the export does not describe: another padding than zero, tf32 rounding, or a Gluon
    descriptor whose shared layout is not the default NVMMA layout of its block (what the export compiled)."""
    if getattr(arg, "padding", "zero") != "zero" or getattr(arg, "round_f32_to_tf32", False):
        return None
    element = _POINTER_TYPES.get(getattr(arg.base, "dtype", None))
    if element is None:
        return None
    block = tuple(arg.block_shape)
    if gluon:
        key = (block, element)
        if key not in _GLUON_LAYOUTS:
            # Imported here, not at the top: `python -m kdsl.aot.worker` imports this package first, and runpy
            # warns when the module it is about to run was already imported by its package.
            from kdsl.aot.worker import default_layout

            _GLUON_LAYOUTS[key] = default_layout(block, element[1:])
        if _GLUON_LAYOUTS[key] is None or arg.layout != _GLUON_LAYOUTS[key]:
            return None
    return f"tensordesc<{element[1:]}[{', '.join(map(str, block))}]>", ""


def _stream(device) -> int:
    """The current CUDA stream of device, as Triton's own launcher reads it (torch's raw stream getter)."""
    import torch

    try:
        return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                                  torch.cuda.current_device())
    except AttributeError:
        return torch.cuda.current_stream(device).cuda_stream


def _argument_key(arg):
    kind = type(arg)
    if kind is int:
        return int_key(arg)
    gluon = _DESCRIPTORS.get(kind)
    if gluon is not None:
        return _descriptor_key(arg, gluon)
    element = _POINTER_TYPES.get(getattr(arg, "dtype", None)) if hasattr(arg, "data_ptr") else None
    if element is None:
        return argument_key(arg)
    return element, "D" if arg.data_ptr() % 16 == 0 else ""


def load(folder) -> AotLibrary:
    """Launch the kernels exported to `folder` instead of compiling them (until unload())."""
    global _library
    import torch

    library = AotLibrary(Path(folder))
    unload()
    for name, element in _TRITON_TYPES.items():
        dtype = getattr(torch, name.split(".", 1)[1], None)
        if dtype is not None:
            _POINTER_TYPES[dtype] = "*" + element
    _DESCRIPTORS.update(_descriptor_classes())
    _library = library
    _wrappers.clear()
    launcher.add_backend(_serve)
    _forget_launch_plans()
    return library


def _descriptor_classes() -> dict:
    """Triton's host TensorDescriptor and Gluon's tiled one (False / True: names its NVMMA shared layout); not
    their subclasses or Gluon's im2col descriptor, which the export does not describe."""
    classes = {}
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        classes[TensorDescriptor] = False
    except ImportError:
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

        classes[GluonTensorDescriptor] = True
    except ImportError:
        pass
    return classes


def unload() -> None:
    """Back to compiling every kernel with Triton's JIT."""
    global _library
    launcher.remove_backend(_serve)
    _wrappers.clear()
    _library = None
    _forget_launch_plans()


def _forget_launch_plans() -> None:
    """kdsl.ops' launch plans (kdsl/ops/_plan.py) replay the kernels they recorded: drop them so calls go
    through the launcher, and so the export (or, after unload, the JIT). A launch from a cubin leaves nothing
    to replay (kdsl.runtime.launcher records None), so calls served by the export take the ops' ordinary path."""
    registry.plans.clear()


def loaded() -> AotLibrary | None:
    return _library


def stats() -> dict:
    """Launches through exported cubins ("aot") and through Triton's JIT ("jit") since the process began."""
    return dict(_stats)


def load_from_env() -> None:
    """KDSL_AOT=DIR: load DIR once, when the registry first imports a generated module."""
    folder = os.environ.get(AOT_ENV, "").strip()
    if folder and _library is None:
        load(folder)


def _on_module_import(kernel_module, module) -> None:
    """The runtime's module hook: the first generated module imported loads KDSL_AOT=DIR (if set and nothing is
    loaded); from then on the launcher asks the export about every launch."""
    if _library is None:
        load_from_env()


manifest.add_module_hook(_on_module_import)
