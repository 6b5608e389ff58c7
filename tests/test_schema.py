"""Definition models: schemes, tiles, variants, definition files and their error messages."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

import kdsl
from kdsl.schema import DefinitionError, KernelDefinition, Tile, Variant, load_definition

# ---------------------------------------------------------------------------------------------
# BlockFP8


def test_block_fp8_defaults():
    scheme = kdsl.BlockFP8()
    assert scheme.kind == "block_fp8"
    assert scheme.fmt == "e4m3"
    assert tuple(scheme.weight_block) == (128, 128)
    assert scheme.act_group == 128
    assert scheme.act_scaling == "dynamic"
    assert scheme.scale_fmt == "float32"
    assert scheme.out_dtype == "bfloat16"
    assert scheme.name == "block_fp8.e4m3.w128x128.a128.f32"


def test_block_fp8_accepts_a_list_for_weight_block():
    assert kdsl.BlockFP8(weight_block=[128, 128]) == kdsl.BlockFP8()


@pytest.mark.parametrize("block", [(96, 128), (128, 100), (3, 3)])
def test_block_fp8_weight_block_must_be_power_of_two(block):
    with pytest.raises(ValidationError, match="power of two"):
        kdsl.BlockFP8(weight_block=block)


@pytest.mark.parametrize("block", [(0, 128), (128, -128)])
def test_block_fp8_weight_block_must_be_positive(block):
    with pytest.raises(ValidationError, match="weight_block"):
        kdsl.BlockFP8(weight_block=block)


@pytest.mark.parametrize("group", [0, 8, 96])
def test_block_fp8_act_group_validated(group):
    with pytest.raises(ValidationError, match="act_group"):
        kdsl.BlockFP8(act_group=group)


def test_block_fp8_rejects_unknown_field():
    with pytest.raises(ValidationError, match="weight_blocks"):
        kdsl.BlockFP8(weight_blocks=(128, 128))


def test_block_fp8_rejects_unsupported_values():
    with pytest.raises(ValidationError, match="fmt"):
        kdsl.BlockFP8(fmt="e5m3")
    with pytest.raises(ValidationError, match="act_scaling"):
        kdsl.BlockFP8(act_scaling="static")


def test_block_fp8_is_frozen_and_hashable():
    scheme = kdsl.BlockFP8()
    with pytest.raises((ValidationError, TypeError, AttributeError)):
        scheme.act_group = 64
    assert scheme.act_group == 128
    assert hash(scheme) == hash(kdsl.BlockFP8())


# ---------------------------------------------------------------------------------------------
# scheme_from_hf

DEEPSEEK_V3 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def test_scheme_from_hf_deepseek_v3():
    scheme = kdsl.scheme_from_hf(dict(DEEPSEEK_V3))
    assert isinstance(scheme, kdsl.BlockFP8)
    assert scheme == kdsl.BlockFP8()
    assert scheme.name == "block_fp8.e4m3.w128x128.a128.f32"


def test_scheme_from_hf_does_not_mutate_its_input():
    config = dict(DEEPSEEK_V3)
    kdsl.scheme_from_hf(config)
    assert config == DEEPSEEK_V3


def test_scheme_from_hf_static_activation_refused():
    with pytest.raises(ValueError, match="activation_scheme"):
        kdsl.scheme_from_hf({**DEEPSEEK_V3, "activation_scheme": "static"})


@pytest.mark.parametrize("method", ["squeezellm", "bitsandbytes", None])
def test_scheme_from_hf_unknown_quant_method(method):
    config = {**DEEPSEEK_V3, "quant_method": method}
    with pytest.raises(ValueError, match="quant_method"):
        kdsl.scheme_from_hf(config)


def test_scheme_from_hf_missing_weight_block_size():
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "weight_block_size"}
    with pytest.raises(ValueError, match="weight_block_size"):
        kdsl.scheme_from_hf(config)


def test_scheme_from_hf_unsupported_fmt():
    with pytest.raises(ValueError, match="fmt"):
        kdsl.scheme_from_hf({**DEEPSEEK_V3, "fmt": "e5m2"})


def test_scheme_from_hf_not_a_dict():
    with pytest.raises((TypeError, ValueError)):
        kdsl.scheme_from_hf([("quant_method", "fp8")])


# ---------------------------------------------------------------------------------------------
# Tile and Variant


def test_tile_defaults_are_powers_of_two():
    tile = Tile()
    for size in (tile.block_m, tile.block_n, tile.block_k):
        assert size > 0 and size & (size - 1) == 0


@pytest.mark.parametrize("field", ["block_m", "block_n", "block_k"])
@pytest.mark.parametrize("value", [48, 0, -64])
def test_tile_block_must_be_power_of_two(field, value):
    with pytest.raises(ValidationError, match=field):
        Tile(**{field: value})


def test_tile_rejects_unknown_field():
    with pytest.raises(ValidationError, match="blok_m"):
        Tile(blok_m=64)


def _variant(tiles, **overrides):
    fields = {"op": "fp8_gemm", "impl": "portable", "min_arch": "sm_89", "tiles": tiles}
    fields.update(overrides)
    return Variant(**fields)


def test_variant_buckets_ok():
    variant = _variant([Tile(m_max=16), Tile(m_max=128), Tile()])
    assert [t.m_max for t in variant.tiles] == [16, 128, None]
    assert variant.min_cc == 89 and variant.max_cc is None


def test_variant_buckets_unsorted():
    with pytest.raises(ValidationError, match="m_max"):
        _variant([Tile(m_max=128), Tile(m_max=16), Tile()])


def test_variant_buckets_overlapping():
    with pytest.raises(ValidationError, match="m_max"):
        _variant([Tile(m_max=64), Tile(m_max=16), Tile()])


def test_variant_alternative_tiles_share_their_bucket():
    """Tiles with equal (m_max, n_min) are one bucket's alternatives; the bucket rules see the run as one tile."""
    variant = _variant([Tile(m_max=16), Tile(m_max=16), Tile(m_max=64, n_min=4096), Tile(m_max=64, n_min=4096),
                        Tile(m_max=64), Tile()])
    assert [(t.m_max, t.n_min) for t in variant.tiles][-2:] == [(64, None), (None, None)]


def test_variant_last_bucket_must_not_have_m_max():
    with pytest.raises(ValidationError, match="last bucket"):
        _variant([Tile(m_max=16), Tile(m_max=128)])


def test_variant_middle_bucket_needs_m_max():
    with pytest.raises(ValidationError, match="m_max"):
        _variant([Tile(m_max=16), Tile(), Tile(m_max=64), Tile()])


def test_variant_bucket_tiled_by_n():
    variant = _variant([Tile(m_max=16), Tile(m_max=128, n_min=8192), Tile(m_max=128, n_min=2048), Tile(m_max=128),
                        Tile(n_min=4096), Tile()])
    assert [(t.m_max, t.n_min) for t in variant.tiles] == [
        (16, None), (128, 8192), (128, 2048), (128, None), (None, 4096), (None, None)]


def test_variant_bucket_last_tile_must_serve_every_n():
    with pytest.raises(ValidationError, match=r"tiles\[1\] has n_min = 8192 but is the last tile of its M bucket"):
        _variant([Tile(m_max=16), Tile(m_max=128, n_min=8192), Tile()])
    with pytest.raises(ValidationError, match="last tile of its M bucket"):
        _variant([Tile(m_max=16), Tile(n_min=8192)])


def test_variant_bucket_wide_n_first():
    with pytest.raises(ValidationError, match=r"tiles\[1\].n_min = 8192 must be below the previous tile's \(2048\)"):
        _variant([Tile(m_max=16, n_min=2048), Tile(m_max=16, n_min=8192), Tile(m_max=16), Tile()])


def test_variant_bucket_tiles_differ_by_n_min():
    with pytest.raises(ValidationError, match=r"tiles\[1\] has the same m_max as tiles\[2\] but no n_min"):
        _variant([Tile(m_max=16, n_min=4096), Tile(m_max=16), Tile(m_max=16, n_min=1024), Tile(m_max=16), Tile()])


def test_variant_max_arch_below_min_arch():
    with pytest.raises(ValidationError, match="max_arch"):
        _variant([Tile()], min_arch="sm_90", max_arch="sm_89")


@pytest.mark.parametrize("arch", ["90", "sm90", "sm_9", "hopper"])
def test_variant_arch_names(arch):
    with pytest.raises(ValidationError, match="sm_90"):
        _variant([Tile()], min_arch=arch)


# ---------------------------------------------------------------------------------------------
# Definition files: load_definition and its messages (file name + field path)

SCHEME = """
[[schemes]]
kind = "block_fp8"
"""


def _write(tmp_path, text, name="my_defs.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _load_error(path) -> str:
    with pytest.raises(DefinitionError) as info:
        load_definition(path)
    message = str(info.value)
    assert path.name in message, f"error does not name the file: {message}"
    assert "Traceback" not in message
    return message


OPTIONS = {"persistent", "tile_order", "swap_ab", "warp_specialize", "edge_tiles", "split_fill",
           "split_min_steps", "overlap_dequant", "mma_gemv"}


def _tile_problems(lines: list[str], index: int, field: str) -> list[str]:
    """The error lines about tiles[index].field (an implementation's option: tiles[index].options.field),
    or with field "" those about tiles[index] as a whole."""
    if field:
        where = f"tiles[{index}].options.{field}" if field in OPTIONS else f"tiles[{index}].{field}"
        return [line for line in lines if where in line]
    return [line for line in lines if f"tiles[{index}]:" in line]


def test_load_good_definition(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ m_max = 16, block_m = 16, block_n = 64 }, { block_m = 64 }]
    """)
    loaded = load_definition(path)
    definition = loaded.definition
    assert isinstance(definition, KernelDefinition)
    assert definition.schemes == [kdsl.BlockFP8()]
    assert definition.variants[0].tiles[0].block_n == 64
    assert definition.variants[0].tiles[1].block_k == 128  # default filled in


def test_load_shipped_definitions(repo_root):
    loaded = load_definition(repo_root / "kernel_defs" / "block_fp8.toml")
    ops = {(v.op, v.impl) for v in loaded.definition.variants}
    assert ("fp8_gemm", "tma_persistent") in ops and ("fp8_gemm", "portable") in ops
    assert {"act_quant", "weight_quant", "weight_dequant"} <= {op for op, _ in ops}


def test_fp8_variant_on_sm80_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_80"
        tiles = [{ block_m = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].min_arch" in message
    assert "sm_89" in message


def test_warp_specialize_with_split_k_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        max_arch = "sm_90"
        tiles = [{ m_max = 128, block_m = 64, split_k = 4, options = { persistent = true, warp_specialize = true } },
                 { block_m = 64, options = { persistent = true, warp_specialize = true } }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].options.warp_specialize" in message and "split_k = 4" in message
    assert "tiles[1]" not in message  # warp specialization alone stays allowed


def test_deferred_gluon_tiles_are_checked(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        max_arch = "sm_90"
        tiles = [{ impl = "deferred_gluon", m_max = 128, block_m = 64, num_warps = 8 },
                 { impl = "deferred_gluon", m_max = 256, block_m = 64, block_k = 64 },
                 { impl = "deferred_gluon", m_max = 512, block_m = 64, block_n = 256 },
                 { impl = "deferred_gluon", m_max = 1024, block_m = 64, split_k = 2, options = { persistent = true, swap_ab = true } },
                 { impl = "deferred_gluon", block_m = 128, num_warps = 8, num_stages = 4 },
                 { block_m = 128, num_warps = 8, num_stages = 4 }]
    """)
    lines = _load_error(path).splitlines()
    assert any("one warpgroup per 64 rows" in line for line in _tile_problems(lines, 0, ""))
    assert any("needs 128, one scale group per K block" in line for line in _tile_problems(lines, 1, "block_k"))
    assert any("weight block" in line for line in _tile_problems(lines, 2, "block_n"))
    # Knobs of other kernels are not its knobs: named, not silently ignored.
    assert any("fp8_gemm/deferred_gluon does not implement this knob" in line
               for line in _tile_problems(lines, 3, "split_k"))
    assert any("has no option" in line for line in _tile_problems(lines, 3, "swap_ab"))
    assert not any("tiles[4]" in line for line in lines)  # the shipped prefill tile's shape
    assert not any("tiles[5]" in line for line in lines)  # its alternative


def test_deferred_gluon_as_the_last_tile_needs_an_alternative(tmp_path):
    """Gluon has no interpreter, so the kernel refuses CPU calls: a last tile of it would leave them unserved."""
    message = _load_error(_write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        max_arch = "sm_90"
        tiles = [{ impl = "deferred_gluon", block_m = 128, num_warps = 8 }]
    """))
    assert "tiles[0]: the last tile must serve every call" in message and "deferred_gluon" in message


def test_edge_tiles_are_checked(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        max_arch = "sm_90"
        tiles = [{ m_max = 128, block_m = 64, block_n = 64, options = { persistent = true, edge_tiles = true } },
                 { impl = "deferred_gluon", m_max = 512, block_m = 64, block_n = 128, options = { edge_tiles = true } },
                 { impl = "deferred_gluon", m_max = 1024, block_m = 128, num_warps = 8, num_stages = 6, options = { persistent = true, edge_tiles = true } },
                 { impl = "deferred_gluon", block_m = 128, block_n = 128, num_warps = 8, options = { persistent = true, edge_tiles = true } },
                 { block_m = 128, block_n = 128, num_warps = 8 }]
    """)
    lines = _load_error(path).splitlines()

    def problems(index, field="edge_tiles"):
        return _tile_problems(lines, index, field)

    # The Triton kernel has no edge tiles: the option is the Gluon kernel's.
    assert any("has no option" in line for line in problems(0))
    assert any("set persistent = true" in line for line in problems(1))
    # Six stages of 32 KB, the 32 KB epilogue tile and the edge's 16 KB: over an H100's 227 KB.
    assert any("KB of shared memory" in line for line in problems(2, ""))
    assert not problems(3) and not problems(3, "")  # the shipped prefill tile
    message = _load_error(_write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_m = 64, options = { edge_tiles = true } }]
    """, name="portable.toml"))
    assert "variants[0].tiles[0].options.edge_tiles" in message and "has no option" in message


def test_block_k_not_dividing_group_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_m = 16, block_n = 16, block_k = 256, num_stages = 1 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].block_k" in message
    assert "256" in message


def test_fp8_mma_tiles_take_one_mma_of_rows(tmp_path):
    """block_m = 1 is no switch to another algorithm: a block-FP8 MMA tile is refused for its MMA rows, and a
    GEMV is an implementation a tile names (fp8_gemm has none)."""
    message = _load_error(_write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        max_arch = "sm_90"
        tiles = [{ m_max = 1, block_m = 1, block_n = 64, block_k = 128 }, { block_m = 64 }]
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ impl = "gemv", m_max = 1, block_m = 1 }, { block_m = 64 }]
    """))
    assert "variants[0].tiles[0].block_m: 1 is below the 16 rows of one MMA" in message
    assert "no implementation 'gemv' of op 'fp8_gemm'" in message


def test_block_k_error_names_the_right_bucket(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        [[variants.tiles]]
        m_max = 16
        block_m = 16
        [[variants.tiles]]
        block_m = 16
        block_n = 16
        block_k = 256
        num_stages = 1
    """)
    message = _load_error(path)
    assert "variants[0].tiles[1].block_k" in message
    assert "tiles[0]" not in message


def test_shared_memory_over_limit_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_m = 256, block_n = 256, block_k = 128, num_stages = 8 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0]" in message
    assert "shared memory" in message


def test_shared_memory_checked_against_the_smallest_arch_in_range(tmp_path):
    # 4 * (128 + 128) * 128 = 128 KB: fits sm_90's 227 KB, not sm_89's 99 KB (nor sm_120's,
    # so the sm_90 variant must close its range to be accepted).
    tiles = "tiles = [{ block_m = 128, block_n = 128, block_k = 128, num_stages = 4 }]"
    ok = _write(tmp_path, SCHEME + f"""
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_90"
        max_arch = "sm_90"
        {tiles}
    """, name="ok.toml")
    load_definition(ok)
    bad = _write(tmp_path, SCHEME + f"""
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        {tiles}
    """, name="bad.toml")
    message = _load_error(bad)
    assert "shared memory" in message and "sm_89" in message


def test_tma_persistent_without_max_arch_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_90"
        tiles = [{ block_m = 64, block_n = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].max_arch" in message
    assert "sm_90" in message


def test_tma_persistent_below_sm90_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "tma_persistent"
        min_arch = "sm_89"
        max_arch = "sm_90"
        tiles = [{ block_m = 64, block_n = 64 }]
    """)
    assert "variants[0].min_arch" in _load_error(path)


def test_unknown_knob_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_m = 64, options = { swap_ab = true } }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].options.swap_ab" in message


@pytest.mark.parametrize("knob", ["split_fill = 1", "split_min_steps = 8"])
def test_split_knobs_only_where_the_launcher_caps_the_split(tmp_path, knob):
    path = _write(tmp_path, SCHEME + f"""
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{{ block_m = 64, options = {{ {knob} }} }}]
    """)
    message = _load_error(path)
    assert f"variants[0].tiles[0].options.{knob.split()[0]}" in message and "has no option" in message


@pytest.mark.parametrize("knob", ["split_fill", "split_min_steps"])
def test_split_knobs_must_be_positive(knob):
    from kdsl.kernels.block_fp8.fp8_gemm_tma_persistent import Options
    with pytest.raises(ValidationError, match=knob):
        Options(**{knob: 0})


def test_unknown_field_in_tile_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ blok_m = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].blok_m" in message
    assert "unknown field" in message


def test_unknown_top_level_field_rejected(tmp_path):
    path = _write(tmp_path, 'colour = "blue"\n' + SCHEME + """
        [[variants]]
        op = "act_quant"
        impl = "rowwise"
        min_arch = "sm_89"
        tiles = [{ block_m = 16 }]
    """)
    message = _load_error(path)
    assert "colour" in message and "unknown field" in message


def test_unknown_scheme_field_rejected(tmp_path):
    path = _write(tmp_path, """
        [[schemes]]
        kind = "block_fp8"
        weight_blok = [128, 128]

        [[variants]]
        op = "act_quant"
        impl = "rowwise"
        min_arch = "sm_89"
        tiles = [{ block_m = 16 }]
    """)
    message = _load_error(path)
    assert "schemes[0].weight_blok" in message


def test_unknown_op_and_impl_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "magic"
        min_arch = "sm_89"
        tiles = [{ block_m = 64 }]

        [[variants]]
        op = "fp4_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_m = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].impl" in message
    assert "variants[1].op" in message


def test_non_power_of_two_block_in_file_rejected(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm"
        impl = "portable"
        min_arch = "sm_89"
        tiles = [{ block_n = 96 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].block_n" in message


def test_toml_syntax_error(tmp_path):
    path = _write(tmp_path, SCHEME + """
        [[variants]]
        op = "fp8_gemm
    """)
    message = _load_error(path)
    assert "TOML" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.toml"
    message = _load_error(path)
    assert "nowhere.toml" in message


def test_schema_cli_prints_json_schema(repo_root):
    result = subprocess.run([sys.executable, "-m", "kdsl", "schema"], cwd=repo_root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert {"schemes", "variants"} <= set(schema["properties"])
    assert schema == KernelDefinition.model_json_schema()


GPTQ_SCHEME = """
[[schemes]]
kind = "gptq"
group_size = 128
"""

W4A16_SCHEME = """
[[schemes]]
kind = "w4a16"
group_size = 128
"""


def test_prepared_gptq_variant_needs_a_layout(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_80"
        tiles = [{ block_m = 16 }]
    """)
    message = _load_error(path)
    assert "variants[0].layout" in message and "declare their layout" in message


def test_layout_refused_on_checkpoint_kernels(tmp_path):
    path = _write(tmp_path, GPTQ_SCHEME + """
        [[variants]]
        op = "gptq_gemm"
        impl = "splitk"
        min_arch = "sm_80"
        layout = { zeros = "biased" }
        tiles = [{ block_m = 16 }]
    """)
    assert "takes no layout" in _load_error(path)


def test_layout_values_are_checked(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_80"
        layout = { zeros = "interleaved" }
        tiles = [{ block_m = 16 }]
    """)
    message = _load_error(path)
    assert "layout.zeros" in message and "biased" in message


def test_k_planes_layout_takes_biased_zeros(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        layout = { zeros = "packed", weights = "k_planes" }
        tiles = [{ block_m = 16, block_k = 128 }]
    """)
    message = _load_error(path)
    assert "variants[0].layout" in message and 'zeros = "biased" or "paired"' in message


def test_paired_zeros_take_k_planes(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_90"
        layout = { zeros = "paired" }
        tiles = [{ block_m = 16, block_k = 128 }]
    """)
    message = _load_error(path)
    assert "variants[0].layout" in message and 'weights = "k_planes"' in message


def test_k_planes_tiles_match_the_plane_tile(tmp_path):
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        layout = {{ zeros = "biased", weights = "k_planes" }}
        tiles = [{{ impl = "gemv", m_max = 1, block_m = 1, block_n = 64, block_k = 128 }}, {{ block_m = 64, {rest} }}]
    """
    load_definition(_write(tmp_path, W4A16_SCHEME + variant.format(rest="block_n = 128, block_k = 128"), name="ok.toml"))
    message = _load_error(_write(tmp_path, W4A16_SCHEME + variant.format(rest="block_n = 256, block_k = 64"),
                                 name="bad.toml"))
    assert "variants[0].tiles[1].block_k: 64" in message and "block_k = 128" in message
    assert "variants[0].tiles[1].block_n: 256" in message and "128 columns" in message


def test_k_planes_gemvs_step_over_whole_plane_tiles(tmp_path):
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        max_arch = "sm_90"
        layout = {{ zeros = "paired", weights = "k_planes" }}
        tiles = [{{ impl = "gemv_mma_gluon", m_max = 1, block_m = 1, block_n = 16, {chunk} }},
                 {{ impl = "gemv", m_max = 1, block_m = 1, block_n = 16, {gemv} }},
                 {{ block_m = 64, block_n = 128, {mma} }}]
    """
    load_definition(_write(tmp_path, W4A16_SCHEME + variant.format(chunk="block_k = 4096", gemv="block_k = 128",
                                                                   mma="block_k = 128"), name="ok.toml"))
    message = _load_error(_write(tmp_path, W4A16_SCHEME + variant.format(chunk="block_k = 64", gemv="block_k = 256",
                                                                         mma="block_k = 256"), name="bad.toml"))
    assert "variants[0].tiles[0].block_k: 64 is not a multiple of 128" in message  # the mma.sync GEMV's chunks
    assert "variants[0].tiles[1].block_k: 256; the k_planes GEMV steps one plane tile" in message
    assert "variants[0].tiles[2].block_k: 256" in message and "block_k = 128" in message


def test_mma_tile_below_16_rows_rejected(tmp_path):
    path = _write(tmp_path, GPTQ_SCHEME + """
        [[variants]]
        op = "gptq_gemm"
        impl = "splitk"
        min_arch = "sm_80"
        tiles = [{ block_m = 8 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].block_m" in message and "16" in message


def test_prepared_mma_takes_16_rows_and_the_gemv_1(tmp_path):
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_80"
        layout = {{ zeros = "biased" }}
        tiles = [{{ impl = "gemv", m_max = 1, block_m = {gemv_rows} }}, {{ block_m = {rows} }}]
    """
    load_definition(_write(tmp_path, W4A16_SCHEME + variant.format(gemv_rows=1, rows=64), name="ok.toml"))
    message = _load_error(_write(tmp_path, W4A16_SCHEME + variant.format(gemv_rows=16, rows=8), name="bad.toml"))
    assert "variants[0].tiles[1].block_m: 8 is below the 16 rows of one MMA" in message
    assert "variants[0].tiles[0].block_m: 16; a GEMV tile takes block_m = 1" in message


def test_one_op_tuned_per_arch_range_but_not_twice_for_one_range(tmp_path):
    variant = """
        [[variants]]
        op = "gptq_gemm"
        impl = "splitk"
        min_arch = "{arch}"
        {cap}
        tiles = [{{ block_m = 16 }}]
    """
    hopper = variant.format(arch="sm_90", cap='max_arch = "sm_90"')
    load_definition(_write(tmp_path, GPTQ_SCHEME + hopper + variant.format(arch="sm_80", cap=""), name="ok.toml"))
    message = _load_error(_write(tmp_path, GPTQ_SCHEME + hopper + variant.format(arch="sm_90", cap=""), name="bad.toml"))
    assert "variants[1]: duplicates variants[0]" in message and "min_arch" in message


def _lines_about(lines: list[str], index: int) -> list[str]:
    return [line for line in lines if f"tiles[{index}]" in line]


def test_overlap_gluon_tiles_are_checked(tmp_path):
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        max_arch = "sm_90"
        layout = { zeros = "paired", weights = "k_planes" }
        tiles = [{ impl = "overlap_gluon", m_max = 1, block_m = 1, block_n = 64 },
                 { impl = "overlap_gluon", m_max = 16, block_m = 16, block_n = 128, num_warps = 4 },
                 { impl = "overlap_gluon", m_max = 64, block_m = 64, block_n = 64, num_warps = 4, split_k = 8 },
                 { impl = "overlap_gluon", block_m = 256, block_n = 128, num_warps = 8, num_stages = 2 },
                 { block_m = 256, block_n = 128, num_warps = 8, num_stages = 2 }]
    """
    lines = _load_error(_write(tmp_path, W4A16_SCHEME + variant)).splitlines()
    assert any("below the 16 rows of one MMA" in line for line in _lines_about(lines, 0))
    assert any("one warpgroup per 64 columns" in line and "block_n = 128, num_warps = 4" in line
               for line in _lines_about(lines, 1))
    assert not _lines_about(lines, 2) and not _lines_about(lines, 3)  # split K and 256 rows are fine


def test_overlap_gluon_needs_hopper_and_the_paired_k_planes_layout(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_80"
        layout = { zeros = "biased" }
        tiles = [{ impl = "overlap_gluon", block_m = 64, block_n = 64, num_warps = 4 }, { block_m = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].min_arch: sm_80 is below sm_90, which w4a16_gemm/overlap_gluon needs" in message
    assert "w4a16_gemm/overlap_gluon uses instructions that exist only up to sm_90" in message
    assert "variants[0].tiles[0].impl" in message and 'weights = "k_planes", zeros = "paired"' in message


def test_gemv_mma_gluon_tiles_are_checked(tmp_path):
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        max_arch = "sm_90"
        layout = { zeros = "paired", weights = "k_planes" }
        tiles = [{ impl = "gemv_mma_gluon", m_max = 1, block_m = 1, block_n = 16, block_k = 256, num_warps = 8 },
                 { impl = "gemv_mma_gluon", m_max = 8, block_m = 1, block_n = 64, block_k = 128, split_k = 4 },
                 { impl = "gemv_mma_gluon", m_max = 16, block_m = 16, block_n = 16, block_k = 128 },
                 { impl = "gemv_mma_gluon", m_max = 16, block_m = 1, block_n = 16, options = { x_rows = 16, k_max = 4096 } },
                 { impl = "gemv_mma_gluon", m_max = 32, block_m = 1, block_n = 16, options = { x_rows = 16 } },
                 { impl = "gemv_mma_gluon", m_max = 64, block_m = 1, block_n = 16, options = { x_rows = 12 } },
                 { block_m = 64, block_n = 64, num_warps = 4 }]
    """
    lines = _load_error(_write(tmp_path, W4A16_SCHEME + variant)).splitlines()
    assert not _lines_about(lines, 0)  # the shipped kinds of tile
    assert not _lines_about(lines, 3)
    assert any("block_n = 16 (got 64)" in line for line in _lines_about(lines, 1))
    assert any("tiles[1].split_k: w4a16_gemm/gemv_mma_gluon does not implement this knob" in line for line in lines)
    assert any("block_m = 1" in line for line in _lines_about(lines, 2))
    assert any("set m_max <= 8, or options.x_rows = 16" in line for line in _lines_about(lines, 2))
    assert any("M up to 16; set m_max <= 16 (got 32)" in line for line in _lines_about(lines, 4))
    assert any("x_rows" in line for line in _lines_about(lines, 5))  # 8 or 16 only


def test_gemv_mma_gluon_needs_the_paired_k_planes_layout(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "mma"
        min_arch = "sm_80"
        layout = { zeros = "biased" }
        tiles = [{ impl = "gemv_mma_gluon", m_max = 1, block_m = 1, block_n = 16, block_k = 128 },
                 { block_m = 64, block_n = 64, num_warps = 4 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].impl" in message and 'weights = "k_planes", zeros = "paired"' in message


def test_alternative_tiles_follow_a_kernel_that_refuses_calls(tmp_path):
    """A tile with the m_max and n_min of the one before it serves where that one's kernel refuses a call:
    after a kernel that refuses none it could never run."""
    variant = """
        [[variants]]
        op = "w4a16_gemm"
        impl = "planes_mma"
        min_arch = "sm_90"
        max_arch = "sm_90"
        layout = {{ zeros = "paired", weights = "k_planes" }}
        tiles = [{{ impl = "{first}", m_max = 64, block_m = 64, block_n = 64 }},
                 {{ m_max = 64, block_m = 64, block_n = 64 }},
                 {{ block_m = 128, block_n = 64 }}]
    """
    load_definition(_write(tmp_path, W4A16_SCHEME + variant.format(first="overlap_gluon"), name="ok.toml"))
    message = _load_error(_write(tmp_path, W4A16_SCHEME + variant.format(first="planes_mma"), name="bad.toml"))
    assert "variants[0].tiles[1]: has the m_max and n_min of tiles[0]" in message and "refuses none" in message


def test_the_last_tile_refuses_no_call(tmp_path):
    path = _write(tmp_path, W4A16_SCHEME + """
        [[variants]]
        op = "w4a16_gemm"
        impl = "overlap_gluon"
        min_arch = "sm_90"
        max_arch = "sm_90"
        layout = { zeros = "paired", weights = "k_planes" }
        tiles = [{ block_m = 128, block_n = 64 }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0]" in message and "every call" in message


def test_overlap_dequant_is_a_knob_of_the_prepared_gemm_only(tmp_path):
    path = _write(tmp_path, GPTQ_SCHEME + """
        [[variants]]
        op = "gptq_gemm"
        impl = "splitk"
        min_arch = "sm_80"
        tiles = [{ block_m = 64, options = { overlap_dequant = true } }]
    """)
    message = _load_error(path)
    assert "variants[0].tiles[0].options.overlap_dequant" in message and "has no option" in message
