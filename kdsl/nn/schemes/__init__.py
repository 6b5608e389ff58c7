"""Schemes as units: one handler per scheme type, found by the scheme's type as torchao's quantize_ finds a
config's handler.

Each unit (block_fp8.py, gptq.py, awq.py; int4.py holds what GPTQ and AWQ share) owns its module factory, its
checkpoint formats (tensor specs per layer and how they become modules) and its tensor-parallel shard rules.
kdsl.nn.convert, kdsl.checkpoint and kdsl.parallel call handler_for(scheme) and hold no per-scheme branches.
Adding a scheme: docs/extending.md.
"""
from __future__ import annotations

from kdsl.nn.schemes.awq import AWQHandler
from kdsl.nn.schemes.base import CheckpointError, LayerFormat, SchemeHandler, ShardError, Spec
from kdsl.nn.schemes.block_fp8 import BlockFP8Handler
from kdsl.nn.schemes.gptq import GPTQHandler

# The one mapping: scheme type -> its handler (in the order refusals list them).
HANDLERS: dict[type, SchemeHandler] = {handler.scheme_type: handler
                                       for handler in (BlockFP8Handler(), GPTQHandler(), AWQHandler())}


def handler_for(scheme) -> SchemeHandler:
    """The handler of scheme's type; TypeError naming the type and the schemes that have one."""
    handler = HANDLERS.get(type(scheme))
    if handler is None:
        names = [f"kdsl.{cls.__name__}" for cls in HANDLERS]
        raise TypeError(f"scheme: expected {', '.join(names[:-1])} or {names[-1]}, got {type(scheme).__name__}")
    return handler


__all__ = ["HANDLERS", "handler_for", "SchemeHandler", "LayerFormat", "Spec", "CheckpointError", "ShardError"]
