"""Definition models: schemes, tiles, variants, definition files."""
from kdsl.schema.definition import (
    DefinitionError,
    DefinitionGroupError,
    KernelDefinition,
    LoadedDefinition,
    load_definition,
    load_definitions,
    parse_definition,
    tile_problems,
)
from kdsl.schema.hf_config import HFQuantization, read_hf_config, scheme_from_hf
from kdsl.schema.scheme import GPTQ, W4A16, BlockFP8, Scheme
from kdsl.schema.tiling import Tile, Variant

__all__ = [
    "BlockFP8", "GPTQ", "W4A16", "Scheme", "scheme_from_hf", "read_hf_config", "HFQuantization", "Tile", "Variant", "KernelDefinition",
    "LoadedDefinition", "DefinitionError", "DefinitionGroupError", "load_definition", "load_definitions",
    "parse_definition", "tile_problems",
]
