"""Public face of the kernel registry: `kdsl.registry.select(...)`, `explain(...)`, `reset()`."""
from kdsl.runtime.registry import (  # noqa: F401
    DISABLE_ENV,
    FORCE_ARCH_ENV,
    NoKernelError,
    device_arch,
    dispatch,
    entries,
    explain,
    reset,
    select,
)
