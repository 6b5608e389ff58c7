"""Test configuration: Triton's interpreter on the CPU, GPU tests only where there is a GPU.

The environment is set here, at the very top, before anything imports triton or kdsl:
Triton decides between JIT and interpreter when a kernel is defined (that is, when a
generated module is imported), and warns on every compile unless TRITON_DEFAULT_FP_FUSION
is set.

    python -m pytest tests                      CPU: generated kernels run in the interpreter
    KDSL_TEST_GPU=1 python -m pytest tests -m gpu    GPU machine: real kernels, no interpreter
"""
import os

GPU_RUN = os.environ.get("KDSL_TEST_GPU") == "1"
if not GPU_RUN:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import kdsl  # noqa: E402
from kdsl.runtime import manifest  # noqa: E402

# tests/ is not a package; let test modules `import reference`.
sys.path.insert(0, str(Path(__file__).parent))

REPO_ROOT = Path(__file__).resolve().parents[1]


def interpreting() -> bool:
    """True when CPU tensors go through the generated kernels (Triton's interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    """Each test starts from a fresh registry, no arch override, nothing disabled, a fixed seed."""
    monkeypatch.delenv(kdsl.registry.FORCE_ARCH_ENV, raising=False)
    monkeypatch.delenv(kdsl.registry.DISABLE_ENV, raising=False)
    kdsl.registry.reset()
    torch.manual_seed(0)
    yield
    kdsl.registry.reset()


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


def run_described(described):
    """Run a unit's launch description, one Launch or a generator of them, and return what a generator returns (the
    MoE routing's buffers)."""
    from kdsl.kernels.base import Launch
    from kdsl.runtime import launcher

    if type(described) is Launch:
        launcher.run(described)
        return None
    while True:
        try:
            launcher.run(next(described))
        except StopIteration as stop:
            return stop.value


def kernel_paths(kernel_prefixes: tuple[str, ...] | None = None, must_launch: bool = False):
    """A `device` fixture over the three paths an op takes: the generated kernels in Triton's interpreter (CPU
    tensors), kdsl's torch fallback (interpreter off) and, marked gpu, CUDA. It yields the device to put tensors on;
    afterwards it checks that the fallback launched nothing, and that on the other paths every launched kernel's
    name starts with one of kernel_prefixes (None: any) and, with must_launch, that one was."""
    @pytest.fixture(params=["interpreter", "fallback", pytest.param("cuda", marks=pytest.mark.gpu)])
    def device(request, monkeypatch, launched):
        if request.param == "fallback":
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        elif request.param == "interpreter" and not interpreting():
            pytest.skip("Triton's interpreter is off")
        yield torch.device("cuda" if request.param == "cuda" else "cpu")
        if request.param == "fallback":
            assert launched == [], launched
        else:
            assert launched or not must_launch, "no generated kernel ran"
            assert kernel_prefixes is None or all(name.startswith(kernel_prefixes) for name in launched), launched
    return device


def wrap_launch(monkeypatch, kernel_module, wrapper) -> None:
    """Make entry.launch call wrapper(original) for kernel_module (a kdsl.runtime KernelModule) until the test
    ends: KernelModule.launch hands out the function manifest._LAUNCHES keeps for its module and scheme."""
    monkeypatch.setitem(manifest._LAUNCHES, kernel_module.key, wrapper(kernel_module.launch))


@pytest.fixture
def launched(monkeypatch):
    """Record the kernel name (scheme and implementation: KernelModule.kernel_name) of every generated module the
    ops launch (wraps each module's launch function, per scheme)."""
    names: list[str] = []
    # A launch plan's replay does not call launch() (kdsl/ops/_plan.py): none is kept while names are watched.
    kdsl.registry.plans.clear()
    monkeypatch.setattr(kdsl.ops._plan, "RECORD", False)
    for entry in kdsl.registry.entries():
        for kernel_module in entry.modules.values():
            def spy(original, _name=kernel_module.kernel_name):
                def launch(*args, **kwargs):
                    names.append(_name)
                    return original(*args, **kwargs)
                return launch

            wrap_launch(monkeypatch, kernel_module, spy)
    return names
