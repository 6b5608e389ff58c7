"""The GPTQ scheme model, its Hugging Face mapping, and how the registry picks GPTQ kernels."""
from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

import kdsl

HF_GPTQ = {
    "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
    "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
}

# ---------------------------------------------------------------------------------------------
# kdsl.GPTQ


def test_gptq_defaults():
    scheme = kdsl.GPTQ()
    assert scheme.kind == "gptq"
    assert scheme.bits == 4
    assert scheme.group_size == 128
    assert scheme.sym is True
    assert scheme.desc_act is False
    assert scheme.checkpoint_format == "gptq"
    assert scheme.act_dtype == "float16"
    assert scheme.pack_factor == 8
    assert scheme.name == "gptq.int4.g128.gptq"


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, -1])
def test_gptq_group_sizes_accepted(group_size):
    scheme = kdsl.GPTQ(group_size=group_size)
    assert scheme.group_size == group_size
    assert scheme.name == f"gptq.int4.{'gall' if group_size == -1 else f'g{group_size}'}.gptq"


@pytest.mark.parametrize("group_size", [100, 8, 0, -2, 96])
def test_gptq_bad_group_size_refused(group_size):
    with pytest.raises(ValidationError, match="group_size") as info:
        kdsl.GPTQ(group_size=group_size)
    assert str(group_size) in str(info.value)


@pytest.mark.parametrize("bits", [8, 3, 2])
def test_gptq_unsupported_bits_refused(bits):
    with pytest.raises(ValidationError, match="bits") as info:
        kdsl.GPTQ(bits=bits)
    message = str(info.value)
    assert f"bits = {bits}" in message and "supported" in message


def test_gptq_unknown_field_refused():
    with pytest.raises(ValidationError, match="groupsize"):
        kdsl.GPTQ(groupsize=128)


def test_gptq_bad_checkpoint_format_refused():
    with pytest.raises(ValidationError, match="checkpoint_format"):
        kdsl.GPTQ(checkpoint_format="awq")


def test_gptq_is_frozen_and_strict():
    scheme = kdsl.GPTQ()
    with pytest.raises(ValidationError):
        scheme.group_size = 64
    with pytest.raises(ValidationError, match="group_size"):
        kdsl.GPTQ(group_size="128")


def test_gptq_v2_name():
    assert kdsl.GPTQ(group_size=32, checkpoint_format="gptq_v2").name == "gptq.int4.g32.gptq_v2"


def test_sym_and_desc_act_do_not_change_the_kernel_name():
    assert kdsl.GPTQ(sym=False, desc_act=True).name == kdsl.GPTQ().name


# ---------------------------------------------------------------------------------------------
# scheme_from_hf


def test_scheme_from_hf_gptq():
    scheme = kdsl.scheme_from_hf(dict(HF_GPTQ))
    assert scheme == kdsl.GPTQ(desc_act=True, sym=False, group_size=128, bits=4, checkpoint_format="gptq")
    assert isinstance(scheme, kdsl.GPTQ)
    assert scheme.desc_act is True and scheme.sym is False


def test_scheme_from_hf_gptq_v2():
    scheme = kdsl.scheme_from_hf({**HF_GPTQ, "checkpoint_format": "gptq_v2", "group_size": 32})
    assert scheme.checkpoint_format == "gptq_v2"
    assert scheme.group_size == 32
    assert scheme.name == "gptq.int4.g32.gptq_v2"


def test_scheme_from_hf_gptq_defaults_for_missing_keys():
    assert kdsl.scheme_from_hf({"quant_method": "gptq"}) == kdsl.GPTQ()


def test_scheme_from_hf_group_all():
    assert kdsl.scheme_from_hf({**HF_GPTQ, "group_size": -1}).group_size == -1


@pytest.mark.parametrize("bits", [3, 8])
def test_scheme_from_hf_unsupported_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        kdsl.scheme_from_hf({**HF_GPTQ, "bits": bits})


def test_scheme_from_hf_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        kdsl.scheme_from_hf({**HF_GPTQ, "group_size": 100})


def test_scheme_from_hf_bad_checkpoint_format():
    with pytest.raises(ValueError, match="checkpoint_format"):
        kdsl.scheme_from_hf({**HF_GPTQ, "checkpoint_format": "marlin"})


@pytest.mark.parametrize("key, value", [("sym", "yes"), ("desc_act", 1), ("bits", "4"), ("group_size", True)])
def test_scheme_from_hf_wrong_types(key, value):
    with pytest.raises(ValueError, match=key):
        kdsl.scheme_from_hf({**HF_GPTQ, key: value})


def test_scheme_from_hf_unknown_method():
    with pytest.raises(ValueError, match="quant_method"):
        kdsl.scheme_from_hf({**HF_GPTQ, "quant_method": "squeezellm"})


# ---------------------------------------------------------------------------------------------
# registry


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_registry_selects_gptq_gemm(arch):
    entry = kdsl.registry.select("gptq_gemm", kdsl.GPTQ(group_size=64), arch=arch)
    assert entry.op == "gptq_gemm"
    assert entry.min_arch == 80
    assert entry.scheme == "gptq.int4.g64.gptq"
    assert entry.name.startswith("gptq_gemm__int4_g64_gptq__")


def test_registry_same_gptq_kernel_on_sm80_and_sm90():
    scheme = kdsl.GPTQ(group_size=64)
    assert kdsl.registry.select("gptq_gemm", scheme, arch="sm_80").name == \
        kdsl.registry.select("gptq_gemm", scheme, arch="sm_90").name


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("op", ["gptq_gemm", "gptq_dequant"])
def test_registry_has_every_declared_gptq_scheme(op, fmt, group_size):
    scheme = kdsl.GPTQ(group_size=group_size, checkpoint_format=fmt)
    entry = kdsl.registry.select(op, scheme, arch="sm_89")
    assert entry.scheme == scheme.name
    group = "gall" if group_size == -1 else f"g{group_size}"
    assert entry.name.startswith(f"{op}__int4_{group}_{fmt}__")


def test_registry_refuses_pre_ampere():
    with pytest.raises(kdsl.NoKernelError, match="sm_80 or newer"):
        kdsl.registry.select("gptq_gemm", kdsl.GPTQ(), arch="sm_75")


def test_registry_refuses_ungenerated_group_size():
    with pytest.raises(kdsl.NoKernelError, match="gptq.int4.g16.gptq"):
        kdsl.registry.select("gptq_gemm", kdsl.GPTQ(group_size=16), arch="sm_90")


def test_registry_explain_gptq():
    text = kdsl.registry.explain("gptq_gemm", kdsl.GPTQ(group_size=128), arch="sm_86", m=1)
    assert "gptq_gemm__int4_g128_gptq__splitk_sm80: CHOSEN" in text
    assert "tile bucket 0" in text


def _cli(repo_root, *args):
    return subprocess.run([sys.executable, "-m", "kdsl", *args], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)


def test_cli_explain_gptq_gemm(repo_root):
    done = _cli(repo_root, "explain", "gptq_gemm", "--arch", "sm_86")
    assert done.returncode == 0, done.stderr
    assert "CHOSEN" in done.stdout
    assert "gptq_gemm__" in done.stdout


def test_cli_explain_gptq_gemm_with_scheme(repo_root):
    done = _cli(repo_root, "explain", "gptq_gemm", "--scheme", "gptq.int4.g32.gptq_v2", "--arch", "sm_86", "--m", "1")
    assert done.returncode == 0, done.stderr
    assert "gptq_gemm__int4_g32_gptq_v2__splitk_sm80: CHOSEN" in done.stdout
