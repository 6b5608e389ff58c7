"""Ahead-of-time export of kdsl's generated kernels (`python -m kdsl aot`), and launching exported cubins
from Python (`kdsl.aot.load(DIR)` or KDSL_AOT=DIR) so the first call on a new shape compiles nothing.

See docs/aot.md."""
from kdsl.aot.runtime import AOT_ENV, load, loaded, stats, unload  # noqa: F401
