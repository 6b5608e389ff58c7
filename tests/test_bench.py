"""`kdsl bench`: shapes, shape files, report, JSON document and exit codes on CPU; one GPU run."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from kdsl.bench import add_parser, cli, report, timing
from kdsl.bench.results import ERROR, OK, UNAVAILABLE, WRONG, Result, Timing
from kdsl.bench.shapes import OPS, Case, ShapeFileError, load_shape_file, preset_cases, resolve_shapes


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kdsl")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def write(tmp_path, doc: object, name: str = "shapes.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


# ---- shapes ----

def test_deepseek_v3_preset_is_the_default_and_has_the_issue_shapes():
    assert parse().shapes == "deepseek-v3"
    cases = preset_cases("deepseek-v3")
    fp8 = {(c.n, c.k) for c in cases if c.op == "fp8_gemm"}
    assert fp8 == {(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)}
    assert sorted({c.m for c in cases if c.op == "fp8_gemm"}) == [1, 16, 64, 128, 512, 4096]
    assert len([c for c in cases if c.op == "fp8_gemm"]) == 30
    assert [(c.m, c.k) for c in cases if c.op == "act_quant"] == [(4096, 7168), (16384, 7168)]
    assert [(c.n, c.k) for c in cases if c.op == "weight_dequant"] == [(7168, 16384), (24576, 1536)]
    gptq = [c for c in cases if c.op == "gptq_gemm"]
    assert {(c.k, c.n) for c in gptq} == {(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)}
    assert sorted({c.m for c in gptq}) == [1, 16, 64, 256] and len(gptq) == 16
    bmm = [c for c in cases if c.op == "fp8_bmm"]  # issue 33: MLA at 128 and 16 heads
    assert {(c.batch, c.n, c.k) for c in bmm} == {(128, 512, 128), (128, 128, 512), (16, 512, 128), (16, 128, 512)}
    assert sorted({c.m for c in bmm}) == [1, 16, 64, 128, 512, 4096] and len(bmm) == 24
    assert bmm[0].label() == "BATCH=128 M=1 N=512 K=128"


def test_llama_preset_covers_every_op_with_valid_shapes():
    cases = preset_cases("llama")
    # Llama has no MLA and no MoE
    assert {c.op for c in cases} == set(OPS) - {"fp8_bmm", "moe_fp8", "fp8_grouped_gemm", "fp8_grouped_gemm_masked",
                                                "moe_w4a16"}
    assert (6144, 4096) in {(c.n, c.k) for c in cases if c.op == "fp8_gemm"}
    for c in cases:
        assert c.op == "weight_dequant" or c.k % 128 == 0
        assert c.op != "gptq_gemm" or c.n % 8 == 0


def test_case_label_names_only_the_dims_of_its_op():
    assert Case("fp8_gemm", m=16, n=2112, k=7168).label() == "M=16 N=2112 K=7168"
    assert Case("act_quant", m=4096, k=7168).label() == "M=4096 K=7168"
    assert Case("weight_dequant", n=7168, k=16384).dims() == {"n": 7168, "k": 16384}


def test_shape_file_with_every_op(tmp_path):
    path = write(tmp_path, {"fp8_gemm": [{"m": [1, 16], "n": 2112, "k": 7168}],
                            "act_quant": [{"m": 4096, "k": 7168}],
                            "weight_dequant": [{"n": 7168, "k": 16384}],
                            "gptq_gemm": [{"m": [1], "k": 4096, "n": 4096}],
                            "fp8_bmm": [{"batch": 16, "m": [1, 64], "n": 512, "k": 128}]})
    assert resolve_shapes(path) == [
        Case("fp8_gemm", m=1, n=2112, k=7168), Case("fp8_gemm", m=16, n=2112, k=7168),
        Case("act_quant", m=4096, k=7168), Case("weight_dequant", n=7168, k=16384),
        Case("gptq_gemm", m=1, n=4096, k=4096),
        Case("fp8_bmm", batch=16, m=1, n=512, k=128), Case("fp8_bmm", batch=16, m=64, n=512, k=128)]


@pytest.mark.parametrize("doc, expected", [
    ("{not json", "invalid JSON at line 1"),
    ([{"m": 1}], "expected a JSON object"),
    ({"fp8_gemm_v2": []}, "unknown op 'fp8_gemm_v2'"),
    ({"fp8_gemm": {"m": 1}}, "fp8_gemm: expected a list"),
    ({"fp8_gemm": [{"m": 1, "k": 7168}]}, "fp8_gemm[0]: missing key 'n'"),
    ({"act_quant": [{"m": 1, "k": 7168, "n": 5}]}, "act_quant[0]: unknown key 'n'"),
    ({"gptq_gemm": [{"m": [1, 0], "n": 4096, "k": 4096}]}, "gptq_gemm[0].m: expected a positive integer, got 0"),
    ({"gptq_gemm": [{"m": 1, "n": "4096", "k": 4096}]}, "gptq_gemm[0].n: expected a positive integer"),
    ({"fp8_gemm": [{"m": True, "n": 256, "k": 256}]}, "fp8_gemm[0].m: expected a positive integer, got True"),
    ({"fp8_gemm": [{"m": [], "n": 256, "k": 256}]}, "fp8_gemm[0].m: empty list"),
    ({"fp8_gemm": [{"m": 1, "n": 256, "k": 100}]}, "fp8_gemm[0].k: 100 is not a multiple"),
    ({"gptq_gemm": [{"m": 1, "n": 4100, "k": 4096}]}, "gptq_gemm[0].n: 4100 is not a multiple of 8"),
    ({"weight_dequant": ["7168x16384"]}, "weight_dequant[0]: expected an object"),
    ({"fp8_bmm": [{"m": 1, "n": 512, "k": 128}]}, "fp8_bmm[0]: missing key 'batch'"),
    ({"fp8_bmm": [{"batch": 0, "m": 1, "n": 512, "k": 128}]}, "fp8_bmm[0].batch: expected a positive integer"),
    ({"fp8_bmm": [{"batch": 2, "m": 1, "n": 520, "k": 128}]}, "fp8_bmm[0].n: 520 is not a multiple of 16"),
])
def test_bad_shape_file_names_file_and_key(tmp_path, doc, expected):
    path = write(tmp_path, doc, name="bad.json")
    with pytest.raises(ShapeFileError) as info:
        load_shape_file(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(path) and expected in str(info.value)


def test_graph_timing_covers_small_m_and_every_gptq_gemm():
    """CUDA-graph timing where launch overhead could hide the kernel, and at every M for
    gptq_gemm, whose bar is stated on graph timing."""
    from kdsl.bench.cases import graph_timed
    assert graph_timed(Case("fp8_gemm", m=128, n=2112, k=7168))
    assert not graph_timed(Case("fp8_gemm", m=512, n=2112, k=7168))
    assert graph_timed(Case("gptq_gemm", m=256, n=4096, k=4096))
    assert not graph_timed(Case("act_quant", m=4096, k=7168))
    assert graph_timed(Case("fp8_bmm", batch=128, m=512, n=512, k=128))  # issue 33's bar: graphs up to M = 512
    assert graph_timed(Case("fp8_bmm", batch=16, m=4096, n=128, k=512))  # and beyond: eager is host-bound there


def test_unknown_preset_or_missing_file():
    with pytest.raises(ShapeFileError, match="not a preset .*deepseek-v3.* and no such shape file"):
        resolve_shapes("deepseek-v4")


def test_run_reports_a_bad_shape_file_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, {"fp8_gemm": [{"m": 1, "k": 7168}]})
    assert cli.run(parse("--shapes", path)) == 2
    err = capsys.readouterr().err
    assert path in err and "missing key 'n'" in err and "Traceback" not in err


def test_op_choices_are_checked_by_argparse(capsys):
    assert parse("--op", "fp8_gemm", "act_quant", "--op", "gptq_gemm").op == ["fp8_gemm", "act_quant", "gptq_gemm"]
    with pytest.raises(SystemExit) as info:
        parse("--op", "int8_gemm")
    assert info.value.code == 2 and "invalid choice: 'int8_gemm'" in capsys.readouterr().err


# ---- exit codes before any GPU work ----

def test_run_without_cuda_exits_2_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.run(parse("--op", "act_quant")) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err


def test_plot_without_matplotlib_exits_2_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "matplotlib_available", lambda: False)
    assert cli.run(parse("--plot", str(tmp_path / "r.png"))) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_json_path_in_a_missing_directory_is_refused_before_running(tmp_path, capsys):
    assert cli.run(parse("--json", str(tmp_path / "nope" / "r.json"))) == 2
    assert "directory does not exist" in capsys.readouterr().err


def test_command_line_is_recorded_as_typed():
    assert cli.command_line(["/x/kdsl/__main__.py", "bench", "--op", "fp8_gemm"]) == "python -m kdsl bench --op fp8_gemm"


# ---- report ----

def hand_made_results() -> list[Result]:
    gemm = Case("fp8_gemm", m=16, n=2112, k=7168)
    flops = 2 * 16 * 2112 * 7168
    fast = Result(gemm, "fp8_gemm", Timing(eager_ms=0.010, graph_ms=0.008, host_us=50.0),
                  {"cublas_blockwise": Timing(eager_ms=0.020, graph_ms=0.012, host_us=40.0, rel_err=3e-3),
                   "bf16_matmul": Timing(eager_ms=0.030)}, flops=flops, bytes_moved=10**7, rel_err=4e-3, tolerance=2e-2)
    no_cublas = Result(Case("fp8_gemm", m=1, n=2112, k=7168), "fp8_gemm", Timing(eager_ms=0.010),
                       {"cublas_blockwise": Timing(error="RuntimeError: Invalid scaling configuration"),
                        "bf16_matmul": Timing(eager_ms=0.015)}, flops=flops // 16, bytes_moved=10**7,
                       rel_err=5e-3, tolerance=2e-2)
    wrong = Result(Case("gptq_gemm", m=64, n=4096, k=4096), "gptq_gemm", Timing(eager_ms=0.05),
                   {"fp16_matmul": Timing(eager_ms=0.04)}, flops=2 * 64 * 4096 * 4096, bytes_moved=10**7,
                   rel_err=0.5, tolerance=2e-2, status=WRONG, detail="rel err 0.5 > 0.02")
    crashed = Result(Case("gptq_gemm", m=64, n=4096, k=4096), "gptq_gemm[prepared]", Timing(error="TypeError: x"),
                     {"fp16_matmul": Timing(eager_ms=0.04)}, status=ERROR, detail="TypeError: x", rel_err=math.nan)
    missing = Result(Case("act_quant", m=4096, k=7168), "act_quant", Timing(error="kdsl.ops has no act_quant"),
                     status=UNAVAILABLE, detail="kdsl.ops has no act_quant", memory_bound=True)
    quant = Result(Case("act_quant", m=16384, k=7168), "act_quant", Timing(eager_ms=0.2),
                   {"copy": Timing(eager_ms=0.1), "torch": Timing(eager_ms=1.0)}, bytes_moved=3 * 10**8,
                   rel_err=0.03, tolerance=5e-2, memory_bound=True)
    return [fast, no_cublas, wrong, crashed, missing, quant]


def test_result_rates_ratios_and_ceiling():
    fast, no_cublas, *_, quant = hand_made_results()
    assert fast.ratio("cublas_blockwise") == pytest.approx(2.0)
    assert fast.ratio("cublas_blockwise", "graph") == pytest.approx(1.5)
    assert fast.ratio("bf16_matmul", "graph") is None
    assert fast.ceiling_fraction() == pytest.approx(2.0)  # the fastest baseline decides
    assert no_cublas.ceiling_fraction() == pytest.approx(1.5)
    assert fast.tflops(0.010) == pytest.approx(2 * 16 * 2112 * 7168 / 1e-5 / 1e12)
    assert quant.memory_bound and quant.rate(0.2) == pytest.approx(1.5)  # 3e8 B in 0.2 ms
    assert quant.ceiling_fraction() == pytest.approx(0.5)  # half the copy bandwidth


def test_table_marks_wrong_missing_baselines_and_unavailable_ops():
    table = report.format_table(hand_made_results())
    lines = table.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("==")] == ["fp8_gemm", "gptq_gemm", "act_quant"]
    header = next(line for line in lines if line.startswith("shape"))
    assert "TFLOP/s" in header and "vs cublas_blockwise" in header and "vs bf16_matmul" in header
    row = next(line for line in lines if line.startswith("M=16 N=2112"))
    assert "2.00x / 1.50x" in row and "3.00x" in row and "vs best" in header and row.endswith("ok")
    row = next(line for line in lines if line.startswith("M=1 N=2112"))
    assert "n/a" in row and "1.50x" in row
    assert "baseline cublas_blockwise unavailable for M=1 N=2112 K=7168: RuntimeError" in table
    assert next(line for line in lines if "gptq_gemm  " in line and "M=64" in line).endswith("WRONG")
    assert "M=64 N=4096 K=4096 gptq_gemm: WRONG: rel err 0.5 > 0.02" in table
    assert next(line for line in lines if "gptq_gemm[prepared]" in line).endswith("ERROR")
    assert next(line for line in lines if line.startswith("M=4096 K=7168")).endswith("n/a")
    row = next(line for line in lines if line.startswith("M=16384 K=7168"))
    assert "of copy BW" in table and "TB/s" in table and " 50% " in row


def test_json_document_structure(tmp_path):
    results = hand_made_results()
    env = {"gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8"}
    doc = report.build_document(results, shapes="deepseek-v3", ops=["fp8_gemm", "gptq_gemm", "act_quant"],
                                command="python -m kdsl bench", environment=env)
    report.write_json(doc, tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())  # strict JSON: NaN became null
    assert doc["schema_version"] == report.SCHEMA_VERSION == 1
    assert set(doc) == {"schema_version", "tool", "command", "date", "environment", "shapes", "ops", "timing",
                        "summary", "results"}
    assert doc["environment"] == env and doc["command"] == "python -m kdsl bench" and "T" in doc["date"]
    assert doc["summary"] == {"results": 6, "ok": 3, "wrong": 1, "errors": 1, "not_available": 1}
    first = doc["results"][0]
    assert set(first) == {"op", "impl", "shape", "status", "detail", "flops", "bytes", "rel_err", "tolerance",
                          "ceiling_fraction", "kdsl", "baselines"}
    assert first["shape"] == {"m": 16, "n": 2112, "k": 7168} and first["status"] == "ok"
    assert isinstance(first["flops"], int) and isinstance(first["kdsl"]["tflops"], float)
    assert set(first["kdsl"]) == {"eager_ms", "graph_ms", "host_us", "tflops", "tbps", "error", "rel_err"}
    cublas = first["baselines"]["cublas_blockwise"]
    assert cublas["ratio_eager"] == pytest.approx(2.0) and cublas["ratio_graph"] == pytest.approx(1.5)
    assert cublas["rel_err"] == pytest.approx(3e-3)
    assert doc["results"][1]["baselines"]["cublas_blockwise"]["error"].startswith("RuntimeError")
    assert doc["results"][1]["baselines"]["cublas_blockwise"]["ratio_eager"] is None
    assert doc["results"][3]["rel_err"] is None and doc["results"][3]["impl"] == "gptq_gemm[prepared]"
    assert doc["results"][4]["status"] == "not available" and doc["results"][4]["baselines"] == {}
    assert doc["results"][5]["shape"] == {"m": 16384, "k": 7168}
    assert doc["results"][5]["ceiling_fraction"] == pytest.approx(0.5)


# ---- references the GPU run checks kdsl against (device-agnostic) ----

def test_gptq_reference_unpacks_int4_along_k_and_n():
    from kdsl.bench.timing import gptq_reference_weight, unpack_int4

    q = torch.tensor([[3, 0, 15, 7, 1, 2, 9, 4]], dtype=torch.int64)  # eight values along K, one column
    packed = sum(int(v) << (4 * i) for i, v in enumerate(q[0]))
    qweight = torch.tensor([[packed - (1 << 32) if packed >= 1 << 31 else packed]], dtype=torch.int32)
    assert unpack_int4(qweight, dim=0)[:, 0].tolist() == q[0].tolist()  # survives the int32 sign bit
    qzeros = torch.tensor([[0x76543210]], dtype=torch.int32)  # column n stores zero n
    assert unpack_int4(qzeros, dim=1).tolist() == [list(range(8))]
    scales = torch.full((1, 1), 0.5, dtype=torch.float16)
    zero_as_stored = torch.tensor([[6]], dtype=torch.int32)  # "gptq" stores zero - 1: the real zero is 7
    w = gptq_reference_weight(qweight, zero_as_stored, scales, torch.zeros(8, dtype=torch.int32))
    assert w[:, 0].tolist() == [(v - 7) * 0.5 for v in q[0].tolist()]


def test_act_quant_check_flags_scales_that_are_not_amax_over_448():
    from kdsl.bench.cases.act_quant import check_act_quant
    from kdsl.bench.timing import torch_act_quant

    x = torch.randn(4, 256, dtype=torch.bfloat16)
    q, s = torch_act_quant(x)
    ref_s = x.float().view(4, 2, 128).abs().amax(-1) / 448
    err, why = check_act_quant((q, s), x, ref_s)
    assert err < 5e-2 and why is None
    _, why = check_act_quant((q, s * 1.001), x, ref_s)
    assert "scales differ" in why
    _, why = check_act_quant((q, s[:, :1]), x, ref_s)
    assert "shapes" in why


def test_gemm_check_flags_wrong_values_and_shapes():
    from kdsl.bench.timing import check_close

    ref = torch.randn(8, 256)
    assert check_close(ref.bfloat16(), ref, 2e-2)[1] is None
    assert "rel err" in check_close(ref * 1.1, ref, 2e-2)[1]
    assert "shape" in check_close(ref[:4], ref, 2e-2)[1]
    assert "rel err nan" in check_close(ref * math.nan, ref, 2e-2)[1]


def test_fp8_references_agree_with_unquantized_math():
    from kdsl.bench.timing import fp8_gemm_reference, torch_act_quant, torch_weight_quant

    x, w = torch.randn(8, 256, dtype=torch.bfloat16), torch.randn(200, 256, dtype=torch.bfloat16)  # ragged N
    (a, a_s), (b, b_s) = torch_act_quant(x), torch_weight_quant(w)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and b_s.shape == (2, 2)
    ref = fp8_gemm_reference(a, a_s, b, b_s)
    exact = x.float() @ w.float().T
    assert ref.shape == (8, 200) and ((ref - exact).norm() / exact.norm()).item() < 0.06


# ---- the whole run path on CPU, with stand-in kdsl ops and timers ----

def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of unpack_int4: eight 4-bit values per int32 along `dim`, wrapped to int32."""
    v = values.to(torch.int64)
    v = v.view(-1, 8, v.shape[1]) if dim == 0 else v.view(v.shape[0], -1, 8).transpose(1, 2)
    packed = sum(v[:, i] << (4 * i) for i in range(8))
    packed = (packed + 2**31) % 2**32 - 2**31
    return packed.to(torch.int32)


def fake_ops(wrong_dequant: bool):
    """kdsl.ops stand-ins built from the bench's own references; weight_dequant can be made wrong."""
    import types

    from kdsl.bench import timing

    def gptq_quantize(w, *, bits=4, group_size=128, sym=True):
        n, k = w.shape
        groups = w.float().t().reshape(k // group_size, group_size, n)
        scales = (groups.abs().amax(1) / 7).half()
        q = (torch.round(groups / scales.float()[:, None]) + 8).clamp(0, 15).reshape(k, n)
        zeros = torch.full((k // group_size, n), 7)  # "gptq" format: zero 8 stored as 7
        return {"qweight": pack_int4(q, 0), "qzeros": pack_int4(zeros, 1), "scales": scales,
                "g_idx": torch.arange(k, dtype=torch.int32) // group_size}

    def gptq_gemm(x, qweight, qzeros, scales, g_idx=None, *, bits=4, group_size=128, checkpoint_format="gptq"):
        g = torch.arange(qweight.shape[0] * 8) // group_size
        return (x.float() @ timing.gptq_reference_weight(qweight, qzeros, scales, g)).half()

    def weight_dequant(q, s, block_size=(128, 128), out_dtype=torch.bfloat16):
        w = timing.fp8_weight_reference(q, s)
        return (w * 1.5 if wrong_dequant else w).to(out_dtype)

    def gptq_dequant(qweight, qzeros, scales, g_idx=None, *, bits=4, group_size=128, checkpoint_format="gptq"):
        g = torch.arange(qweight.shape[0] * 8) // group_size
        return timing.gptq_reference_weight(qweight, qzeros, scales, g).t().half()

    def fp8_bmm(a, a_s, b, b_s, out_dtype=torch.bfloat16):
        return torch.stack([timing.fp8_gemm_reference(a[g], a_s[g], b[g], b_s[g]) for g in range(a.shape[0])]
                           ).to(out_dtype)

    return types.SimpleNamespace(
        act_quant=lambda x, group_size=128: timing.torch_act_quant(x), gptq_dequant=gptq_dequant, fp8_bmm=fp8_bmm,
        fp8_gemm=lambda a, a_s, b, b_s, out_dtype=torch.bfloat16: timing.fp8_gemm_reference(a, a_s, b, b_s).to(out_dtype),
        weight_dequant=weight_dequant, gptq_quantize=gptq_quantize, gptq_gemm=gptq_gemm)


@pytest.fixture
def cpu_bench(monkeypatch):
    """Drive kdsl.bench.cases.run_case on CPU: fake timers, no CUDA sync, kdsl.ops replaced by `install`."""
    import sys

    import triton.testing

    import kdsl
    from kdsl.bench import timing

    def cudagraph(fn, return_mode):
        raise RuntimeError("no graphs on CPU")

    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, return_mode: (fn(), 0.25)[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", cudagraph)
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "cpu stand-in", "torch": torch.__version__})
    monkeypatch.setattr(timing, "machine_ceilings", lambda: (1e12, 1e15))  # 1 TB/s, 1 PFLOP/s

    def install(ops) -> None:
        monkeypatch.setitem(sys.modules, "kdsl.ops", ops)
        monkeypatch.setattr(kdsl, "ops", ops, raising=False)

    return install


def test_run_case_checks_times_and_flags_on_cpu_stand_ins(cpu_bench):
    from kdsl.bench import timing
    from kdsl.bench.cases import run_case

    cpu_bench(fake_ops(wrong_dequant=True))
    (gemm,) = run_case(Case("fp8_gemm", m=3, n=200, k=256))
    copies = timing.MAX_COPIES  # 50 KB of weights: the copies cap decides; times are per call
    assert gemm.status == OK and gemm.rel_err < 1e-2 and gemm.kdsl.eager_ms == pytest.approx(0.25 / copies)
    assert gemm.kdsl.graph_ms is None  # a failing CUDA-graph capture is recorded as None
    assert gemm.baselines["bf16_matmul"].eager_ms == pytest.approx(0.25 / copies)
    assert gemm.baselines["cublas_blockwise"].error or gemm.baselines["cublas_blockwise"].eager_ms
    (quant,) = run_case(Case("act_quant", m=4, k=256))
    assert quant.status == OK and quant.bytes_moved == 4 * 256 * 3 + 4 * 4 * 2 and quant.ratio("copy") == 1.0
    (dequant,) = run_case(Case("weight_dequant", n=130, k=200))
    assert dequant.status == WRONG and "rel err" in dequant.detail and dequant.kdsl.eager_ms == 0.25
    (gptq,) = run_case(Case("gptq_gemm", m=2, n=16, k=256))
    assert gptq.status == OK and gptq.rel_err < 1e-2 and set(gptq.baselines) == {"fp16_matmul", "roofline"}
    (gptq_deq,) = run_case(Case("gptq_dequant", n=16, k=256))
    # int32 words (K/8 x N), qzeros (G x N/8), fp16 scales (G x N), fp16 output (N x K)
    assert gptq_deq.status == OK and gptq_deq.bytes_moved == 4 * 32 * 16 + 4 * 2 * 2 + 2 * 2 * 16 + 2 * 16 * 256
    assert set(gptq_deq.baselines) == {"copy", "torch"} and gptq_deq.ratio("copy") == 1.0
    # rated in TB/s where the case module says MEMORY_BOUND
    assert [r.memory_bound for r in (gemm, quant, dequant, gptq, gptq_deq)] == [False, True, True, False, True]


def test_fp8_bmm_case_on_cpu_stand_ins(cpu_bench):
    """fp8_bmm: three baselines checked against the fp32 reference where they compute the quantized product,
    a roofline from the (stand-in) machine ceilings, and graph-timed cases cycling through copies of the weights."""
    from kdsl.bench import timing
    from kdsl.bench.cases import run_case

    cpu_bench(fake_ops(wrong_dequant=False))
    (small,) = run_case(Case("fp8_bmm", batch=2, m=3, n=128, k=256))
    assert small.status == OK and small.rel_err < 1e-2
    assert set(small.baselines) == {"bf16_bmm", "cublas_blockwise_loop", "fp8_gemm_loop", "roofline"}
    assert small.baselines["fp8_gemm_loop"].rel_err < 1e-2
    copies = timing.MAX_COPIES  # b has 64 KB: the copies cap, not the byte count, decides
    assert small.kdsl.eager_ms == pytest.approx(0.25 / copies)
    bytes_moved = 2 * 3 * 256 + 2 * 128 * 256 + 4 * (2 * 3 * 2 + 2 * 1 * 2) + 2 * 2 * 3 * 128
    assert small.bytes_moved == bytes_moved and small.flops == 2 * 2 * 3 * 128 * 256
    roofline_ms = 1e3 * bytes_moved / 1e12  # memory-bound at this size
    assert small.baselines["roofline"].eager_ms == pytest.approx(roofline_ms)
    assert small.ceiling_fraction() == pytest.approx(roofline_ms / (0.25 / copies))
    table = report.format_table([small])
    assert "of roofline" in table and "TB/s" in table and "vs fp8_gemm_loop" in table and "vs roofline" not in table
    (large,) = run_case(Case("fp8_bmm", batch=1, m=520, n=128, k=128))  # past COLD_MAX_M: one call each
    assert large.status == OK and large.kdsl.eager_ms == 0.25


def test_fp8_gemm_and_gptq_gemm_calls_read_cold_weight_copies(cpu_bench, monkeypatch):
    """Up to COLD_MAX_M every callable, kdsl's rows and the baselines, cycles through distinct copies of the weights
    (one prepared object per copy), so a CUDA graph of one call reads each copy once; times are per call, and the
    roofline is bytes / copy rate or FLOPs / the FP8 rate (fp8_gemm), half of it (gptq_gemm's fp16)."""
    from kdsl.bench import timing
    from kdsl.bench.cases import run_case

    ops = fake_ops(wrong_dequant=False)
    seen: dict[str, list[int]] = {}

    def spy(name, fn, weight):
        def call(*args, **kwargs):
            seen.setdefault(name, []).append(weight(args).data_ptr())
            return fn(*args, **kwargs)
        return call

    plain_gemm = ops.gptq_gemm
    ops.fp8_gemm = spy("fp8_gemm", ops.fp8_gemm, lambda args: args[2])
    ops.gptq_prepare = lambda qweight, qzeros, scales, g_idx=None, **kw: (qweight.clone(), qzeros, scales)
    ops.gptq_gemm = spy("gptq_gemm", lambda x, w, *args, **kw: plain_gemm(x, *w) if isinstance(w, tuple)
                        else plain_gemm(x, w, *args, **kw),
                        lambda args: args[1][0] if isinstance(args[1], tuple) else args[1])
    matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", spy("matmul", matmul, lambda args: args[1]))
    cpu_bench(ops)
    monkeypatch.setattr(timing, "COLD_BYTES", 3 * 128 * 256)  # three copies of a 128 x 256 fp8 weight

    (gemm,) = run_case(Case("fp8_gemm", m=2, n=128, k=256), host_time=False)
    assert gemm.status == OK and gemm.kdsl.eager_ms == pytest.approx(0.25 / 3)
    assert len(set(seen["fp8_gemm"])) == len(set(seen["matmul"])) == 3  # kdsl's and bf16's weights
    bytes_moved = 2 * 256 + 128 * 256 + 4 * (2 * 2 + 1 * 2) + 2 * 2 * 128
    assert gemm.bytes_moved == bytes_moved
    assert gemm.baselines["roofline"].eager_ms == pytest.approx(1e3 * bytes_moved / 1e12)
    assert "of roofline" in report.format_table([gemm])

    seen.clear()
    monkeypatch.setattr(timing, "COLD_BYTES", 2 * 768 * 128 // 2)  # two copies of a K = 768, N = 128 int4 weight
    results = run_case(Case("gptq_gemm", m=2, n=128, k=768), host_time=False)
    assert [r.impl for r in results] == ["gptq_gemm", "gptq_gemm[prepared]", "gptq_gemm[prepared,desc_act]"]
    assert [r.variant_of for r in results] == [None, None, "gptq_gemm[prepared]"]
    # (the stand-in gptq_prepare ignores g_idx, so its desc_act row is WRONG: timed all the same)
    assert [r.status for r in results[:2]] == [OK, OK]
    assert all(r.kdsl.eager_ms == pytest.approx(0.25 / 2) for r in results)
    # two copies of the checkpoint, one prepared object per copy, and two prepared copies of the desc_act one
    assert len(set(seen["gptq_gemm"])) == 6
    assert len(set(seen["matmul"])) == 2
    flops = 2 * 2 * 128 * 768
    assert results[0].baselines["roofline"].eager_ms == pytest.approx(
        1e3 * max(results[0].bytes_moved / 1e12, flops / 0.5e15))

    seen.clear()  # past COLD_MAX_M: one call each
    (prefill,) = run_case(Case("fp8_gemm", m=timing.COLD_MAX_M + 1, n=128, k=256), host_time=False)
    assert prefill.kdsl.eager_ms == 0.25 and len(seen["fp8_gemm"]) == 2  # the check's call and the timed one


def test_a_variant_row_is_reported_as_its_time_over_the_row_it_is_held_against():
    """Act-order's cost: the desc_act row's time over the plain row's of the same shape, on CUDA-graph times where
    both have one (else eager), in the table and the JSON; a shape whose plain row has no time gets none."""
    def row(case, impl, eager, graph, variant_of=None):
        return Result(case, impl, Timing(eager_ms=eager, graph_ms=graph), variant_of=variant_of)

    decode, prefill, broken = (Case("gptq_gemm", m=m, n=4096, k=4096) for m in (1, 2048, 16))
    plain, act = "gptq_gemm[prepared]", "gptq_gemm[prepared,desc_act]"
    results = [row(decode, plain, 0.020, 0.0060), row(decode, act, 0.030, 0.0072, plain),
               row(prefill, plain, 0.100, None), row(prefill, act, 0.104, None, plain),
               row(broken, plain, None, None), row(broken, act, 0.01, 0.01, plain)]
    table = report.format_table(results)
    assert f"{act} / {plain}: time ratio (>1: the variant is slower)" in table
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{act} / {plain}"))
    cells = [line.split() for line in lines[at + 2:at + 5]]
    assert [c[-2:] for c in cells] == [["1.200", "graph"], ["1.040", "eager"], ["-", "-"]]
    doc = report.build_document(results, shapes="s", ops=["gptq_gemm"], command="c", environment={})
    by_m = {(r["shape"]["m"], r["impl"]): r for r in doc["results"]}
    assert by_m[(1, act)]["time_vs_variant_of"] == pytest.approx(1.2) and by_m[(1, act)]["variant_times"] == "graph"
    assert by_m[(2048, act)]["variant_of"] == plain and by_m[(2048, act)]["time_vs_variant_of"] == pytest.approx(1.04)
    assert by_m[(16, act)]["time_vs_variant_of"] is None and "variant_of" not in by_m[(1, plain)]


def test_host_time_is_measured_for_graph_timed_cases_unless_turned_off(cpu_bench):
    from kdsl.bench.cases import run_case

    cpu_bench(fake_ops(wrong_dequant=False))
    (timed,) = run_case(Case("gptq_gemm", m=1, n=16, k=128))
    assert timed.kdsl.host_us > 0 and timed.baselines["fp16_matmul"].host_us > 0
    assert "of roofline" in report.format_table([timed]) and "host us (x fp16_matmul)" in report.format_table([timed])
    (skipped,) = run_case(Case("gptq_gemm", m=1, n=16, k=128), host_time=False)
    assert skipped.status == OK and skipped.kdsl.host_us is None and skipped.baselines["fp16_matmul"].host_us is None
    assert parse("--no-host-time").host_time is False and parse().host_time is True


def test_host_time_batches_about_host_calls_calls_whatever_a_callable_makes(cpu_bench):
    """A callable cycling through 64 weight copies makes 64 calls: its host-time batches hold 2 of them (128 calls),
    not HOST_CALLS of them, so the launch queue never fills behind cold-weight kernels."""
    from kdsl.bench import timing

    invocations = []
    t = timing.measure(lambda: invocations.append(1), graph=True, calls=64)
    assert t.host_us is not None and len(invocations) == 1 + 3 * 2  # do_bench's one, then three batches of two
    invocations.clear()
    timing.measure(lambda: invocations.append(1), graph=True)
    assert len(invocations) == 1 + 3 * timing.HOST_CALLS


def test_gptq_prepared_row_appears_with_gptq_prepare(cpu_bench):
    from kdsl.bench.cases import run_case

    ops = fake_ops(wrong_dequant=False)
    plain_gemm = ops.gptq_gemm
    ops.gptq_prepare = lambda qweight, qzeros, scales, g_idx=None, **kw: (qweight, qzeros, scales)
    ops.gptq_gemm = lambda x, w, *args, **kw: plain_gemm(x, *w) if isinstance(w, tuple) else plain_gemm(x, w, *args, **kw)
    cpu_bench(ops)
    results = run_case(Case("gptq_gemm", m=1, n=16, k=128))
    assert [r.impl for r in results] == ["gptq_gemm", "gptq_gemm[prepared]", "gptq_gemm[prepared,desc_act]"]
    assert [r.status for r in results[:2]] == [OK, OK]
    assert results[0].baselines is results[1].baselines is results[2].baselines  # timed once, shared

    def refuse(*args, **kwargs):
        raise NotImplementedError("no repacking yet")

    ops.gptq_prepare = refuse
    plain, prepared, desc_act = run_case(Case("gptq_gemm", m=1, n=16, k=128))
    assert plain.status == OK and prepared.status == ERROR and "no repacking yet" in prepared.detail
    assert desc_act.status == ERROR and "no repacking yet" in desc_act.detail


def test_missing_ops_are_not_available_and_kdsl_errors_are_failures(cpu_bench):
    import types

    from kdsl.bench.cases import run_case

    def broken(x, group_size=128):
        raise ValueError("x: expected bf16")

    cpu_bench(types.SimpleNamespace(act_quant=broken))
    (missing,) = run_case(Case("fp8_gemm", m=1, n=128, k=128))
    assert missing.status == UNAVAILABLE and "kdsl.ops has no fp8_gemm" in missing.detail and not missing.failed
    (error,) = run_case(Case("act_quant", m=1, k=128))
    assert error.status == ERROR and error.failed and "ValueError: x: expected bf16" in error.detail


def test_run_end_to_end_on_cpu_stand_ins(cpu_bench, tmp_path, capsys):
    cpu_bench(fake_ops(wrong_dequant=True))
    shapes = write(tmp_path, {"fp8_gemm": [{"m": [1, 4], "n": 256, "k": 256}], "weight_dequant": [{"n": 128, "k": 128}]})
    out = tmp_path / "bench.json"
    assert cli.run(parse("--shapes", shapes, "--json", str(out))) == 1  # weight_dequant is wrong
    captured = capsys.readouterr()
    assert "[1/3] fp8_gemm M=1 N=256 K=256 ..." in captured.err and "[3/3] weight_dequant N=128 K=128" in captured.err
    assert "1 of 3 results WRONG or failing: weight_dequant N=128 K=128 weight_dequant: WRONG" in captured.err
    assert "== fp8_gemm" in captured.out and "WRONG" in captured.out
    doc = json.loads(out.read_text())
    assert doc["ops"] == ["fp8_gemm", "weight_dequant"] and doc["environment"]["gpu"] == "cpu stand-in"
    assert [r["status"] for r in doc["results"]] == ["ok", "ok", "WRONG"]
    assert cli.run(parse("--shapes", shapes, "--op", "fp8_gemm")) == 0
    assert "all 2 results correct" in capsys.readouterr().err


def test_kernel_breakdown_sums_gpu_events_by_name_per_call():
    from kdsl.bench import profile

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "dur": 30.0}, {"cat": "kernel", "name": "quant", "dur": 2.0},
        {"cat": "kernel", "name": "gemm", "dur": 34.0}, {"cat": "gpu_memset", "name": "Memset (Device)", "dur": 1.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 50.0},  # host side: not device time
        {"cat": "kernel", "name": "quant", "dur": 2.0}, {"cat": "ac2g", "name": "flow"}]}
    events = profile.trace_events(trace)
    assert sorted(events) == [("Memset (Device)", 1.0), ("gemm", 30.0), ("gemm", 34.0), ("quant", 2.0), ("quant", 2.0)]
    # one kernel launched with two grids (a generated kernel serving gate-up and down): a line per grid
    two = profile.trace_events({"traceEvents": [
        {"cat": "kernel", "name": "moe", "dur": 5.0, "args": {"grid": [64, 1, 1]}},
        {"cat": "kernel", "name": "moe", "dur": 3.0, "args": {"grid": [112, 1, 1]}},
        {"cat": "kernel", "name": "act", "dur": 1.0, "args": {"grid": [8, 1, 1]}}]})
    assert two == [("moe grid=[64, 1, 1]", 5.0), ("moe grid=[112, 1, 1]", 3.0), ("act", 1.0)]
    # two runs of a callable making two calls (weight copies): per call is a quarter of each total, largest first
    totals = profile.per_call_totals(events, runs=2, calls=2)
    assert list(totals) == ["gemm", "quant", "Memset (Device)"]
    assert totals == {"gemm": 16.0, "quant": 1.0, "Memset (Device)": 0.25}


def test_kernels_flag_adds_each_timed_implementations_breakdown(cpu_bench, tmp_path, capsys, monkeypatch):
    from kdsl.bench import profile

    cpu_bench(fake_ops(wrong_dequant=False))
    seen = []

    def fake_kernel_times(fn, calls=1):
        seen.append(calls)
        if len(seen) == 1:  # the profiler failing on one callable leaves that breakdown out, not the run
            raise RuntimeError("CUPTI unavailable")
        return {f"kernel_{len(seen)}": 2.0, "tail": 0.5}

    monkeypatch.setattr(profile, "kernel_times", fake_kernel_times)
    shapes = write(tmp_path, {"fp8_gemm": [{"m": [4], "n": 256, "k": 256}]})
    out = tmp_path / "bench.json"
    assert cli.run(parse("--shapes", shapes, "--kernels", "--json", str(out))) == 0
    captured = capsys.readouterr()
    assert "no kernel breakdown for fp8_gemm M=4 N=256 K=256" in captured.err and "CUPTI unavailable" in captured.err
    (result,) = json.loads(out.read_text())["results"]
    timed = {"kdsl": result["kdsl"], **{name: t for name, t in result["baselines"].items()
                                        if name != "roofline" and t["error"] is None}}
    # every timed implementation was profiled once, with the calls (weight copies) its timing made; the first
    # profile (a baseline's: they run before kdsl's) failed and only that breakdown is missing
    breakdowns = [t["kernels_us"] for t in timed.values() if "kernels_us" in t]
    assert len(seen) == len(timed) >= 2 and len(breakdowns) == len(timed) - 1
    assert "kernels_us" not in result["baselines"]["roofline"]
    assert result["kdsl"]["kernels_us"] == {f"kernel_{len(seen)}": 2.0, "tail": 0.5}  # kdsl is profiled last
    assert len(set(seen)) == 1 and seen[0] > 1
    assert "== per-kernel device time (--kernels) ==" in captured.out
    assert "fp8_gemm M=4 N=256 K=256 fp8_gemm: kernels 2.5 us" in captured.out
    assert f"2.00 us  kernel_{len(seen)}" in captured.out
    # without the flag nothing is profiled and the JSON has no breakdown
    seen.clear()
    assert cli.run(parse("--shapes", shapes, "--json", str(out))) == 0
    assert seen == [] and "kernels_us" not in json.loads(out.read_text())["results"][0]["kdsl"]


def test_kernel_section_lists_a_cases_shared_baseline_once():
    case = Case("gptq_gemm", m=1, n=16, k=256)
    base = {"fp16_matmul": Timing(graph_ms=0.012, kernels_us={"nvjet": 10.0, "splitKreduce": 2.0})}
    plain = Result(case, "gptq_gemm[prepared]", Timing(graph_ms=0.006, kernels_us={"gemv": 5.5}), base)
    desc = Result(case, "gptq_gemm[prepared,desc_act]", Timing(graph_ms=0.007, kernels_us={"gemv": 5.4, "gather": 1.4}),
                  base)
    text = report.format_kernels([plain, desc])
    assert text.count("fp16_matmul: kernels 12.0 us of 12.0 us per call") == 1
    assert "gptq_gemm[prepared,desc_act]: kernels 6.8 us of 7.0 us per call" in text
    assert text.index("5.40 us  gemv") < text.index("1.40 us  gather")
    assert report.format_kernels([Result(case, "gptq_gemm", Timing(graph_ms=0.01))]) == ""


def test_kernels_flag_is_refused_with_tp_only(capsys, monkeypatch):
    assert cli.run(parse("--tp", "2", "--kernels")) == 2
    assert "--kernels: per-op and --model runs only, not with --tp" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.run(parse("--model", "llama-3-8b", "--kernels")) == 2  # taken, then refused for the missing GPU
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ---- end to end on a GPU ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_fp8_gemm_bench_end_to_end(tmp_path, capsys):
    shapes = write(tmp_path, {"fp8_gemm": [{"m": [16], "n": 256, "k": 512}]})
    out = tmp_path / "bench.json"
    assert cli.run(parse("--shapes", shapes, "--json", str(out))) == 0
    captured = capsys.readouterr()
    assert "[1/1] fp8_gemm M=16 N=256 K=512" in captured.err and "== fp8_gemm" in captured.out
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["ops"] == ["fp8_gemm"]
    assert doc["environment"]["gpu"] == torch.cuda.get_device_name()
    (result,) = doc["results"]
    assert result["status"] == "ok" and result["rel_err"] < 2e-2
    assert result["kdsl"]["eager_ms"] > 0 and result["flops"] == 2 * 16 * 256 * 512
    assert set(result["baselines"]) == {"cublas_blockwise", "bf16_matmul", "roofline"}
    assert result["baselines"]["bf16_matmul"]["ratio_eager"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_breakdown_names_the_generated_kernel_on_a_gpu(tmp_path, capsys):
    shapes = write(tmp_path, {"fp8_gemm": [{"m": [16], "n": 2048, "k": 2048}]})
    out = tmp_path / "bench.json"
    assert cli.run(parse("--shapes", shapes, "--kernels", "--no-host-time", "--json", str(out))) == 0
    (result,) = json.loads(out.read_text())["results"]
    kernels = result["kdsl"]["kernels_us"]
    assert kernels and all(us > 0 for us in kernels.values())
    assert any(name.startswith("fp8_gemm__") for name in kernels), kernels  # the generated module's kernel
    # the kernels run inside the timed call: their sum cannot exceed it by more than timing noise
    assert sum(kernels.values()) < 1.5 * result["kdsl"]["graph_ms"] * 1e3
    assert "kernels_us" in result["baselines"]["bf16_matmul"]


def test_table_shows_host_time_and_its_multiple_of_the_first_baseline():
    table = report.format_table(hand_made_results())
    assert "host us (x cublas_blockwise)" in table
    assert "50.0 (1.25x)" in table
    doc = report.build_document(hand_made_results(), shapes="deepseek-v3", ops=["fp8_gemm"], command="c",
                                environment={})
    assert doc["results"][0]["kdsl"]["host_us"] == 50.0


def test_the_cublas_blockwise_baseline_is_refused_where_its_scale_rows_are_not_16_byte_aligned():
    """K = 128 gives 128x128 block scales one float per row, which torch._scaled_mm accepted and cuBLAS read past
    (an illegal address on an H200): that baseline is a row with the reason, not a fault."""
    a = torch.zeros(1, 128, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(1, 1)
    b = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    b_s = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"K / 128 a multiple of 4 .*K = 128"):
        timing.scaled_mm_baseline(a, a_s, b, b_s)()
