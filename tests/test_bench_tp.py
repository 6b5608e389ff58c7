"""`kdsl bench --tp N` on the CPU: its refusals (exit 2, no GPU), and its whole per-rank logic (checkpoints,
TP = 1 and TP = N modules, variants, the correctness check, floors, the document and table) on 2 gloo ranks
with tiny shapes and a host clock in place of CUDA graphs."""
import argparse
import json
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdsl.bench import add_parser, tp


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kdsl")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_tp_refuses_without_enough_gpus(capsys):
    args = parse("--tp", "2")
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--tp 2 needs 2 CUDA GPUs (one per rank), this machine has 0" in err


@pytest.mark.parametrize("argv,message", [
    (("--tp", "1"), "--tp 1: expected at least 2"),
    (("--tp", "2", "--op", "fp8_gemm"), "--op does not go with --tp"),
    (("--tp", "2", "--model", "llama-3-8b"), "--model does not go with --tp"),
    (("--tp", "2", "--m", "0", "16"), "--m 0 16: token counts must be positive"),
    (("--tp", "2", "--json", "/no/such/folder/tp.json"), "--json /no/such/folder/tp.json: directory does not exist"),
])
def test_tp_refuses_bad_arguments(argv, message, capsys):
    args = parse(*argv)
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_tp_under_torchrun_must_match_world_size(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse("--tp", "2")
    assert args.func(args) == 2
    assert "--tp 2 under torchrun with WORLD_SIZE=4: they must agree" in capsys.readouterr().err


def test_the_default_cases_are_the_issue_shapes():
    assert tp.M_VALUES == (1, 16, 64, 512, 2048)
    assert [(c.kind, c.scheme, c.n, c.k) for c in tp.CASES] == [
        ("column", "fp8", 2112, 7168), ("column", "fp8", 24576, 1536), ("row", "fp8", 7168, 2048),
        ("row", "fp8", 7168, 16384), ("mlp", "fp8", 7168, 18432), ("mlp", "gptq", 8192, 28672)]
    assert set(tp.variants(tp.CASES[0])) == {"tp", "tp_sharded"}
    assert set(tp.variants(tp.CASES[2])) == {"tp", "tp_fp32", "tp_symm"}
    assert set(tp.variants(tp.CASES[4])) == {"tp", "tp_symm", "tp_unfused"}
    assert set(tp.variants(tp.CASES[5])) == {"tp", "tp_unfused"}  # fp16: no one-shot kernel


SMALL = (tp.TPCase("fp8 column 576x256", "column", "fp8", 576, 256),  # off the 128 grid at TP = 2
         tp.TPCase("fp8 row 256x256", "row", "fp8", 256, 256),
         tp.TPCase("fp8 MLP H=256 I=256", "mlp", "fp8", 256, 256),
         tp.TPCase("w4a16 MLP H=256 I=256", "mlp", "gptq", 256, 256))


def _worker(rank, world, init_file, result):
    os.environ.pop("TRITON_INTERPRET", None)  # torch fallbacks: the logic, not the kernels
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        device = torch.device("cpu")
        options = {"ms": (1, 5), "cases": SMALL, "result": result, "max_copies": 2}
        doc = tp.bench(rank, world, device, options, tp.WallTimer(device))
        assert doc["failed"] == []
    finally:
        dist.destroy_process_group()


def test_the_bench_logic_runs_on_two_gloo_ranks():
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "result.json")
        mp.spawn(_worker, args=(2, os.path.join(folder, "store"), result), nprocs=2, join=True)
        doc = json.loads(open(result).read())
    assert doc["tp"] == 2 and doc["failed"] == [] and len(doc["rows"]) == len(SMALL) * 2
    by_case = {(r["case"], r["m"]): r for r in doc["rows"]}
    column = by_case[("fp8 column 576x256", 5)]
    assert set(column["variants"]) == {"tp", "tp_sharded"} and set(column["floors"]) == {"all_gather"}
    row = by_case[("fp8 row 256x256", 1)]
    assert set(row["variants"]) == {"tp", "tp_fp32", "tp_symm"} and set(row["floors"]) == {"all_reduce"}
    for r in doc["rows"]:
        assert r["copies"] == {"tp1": 2, "tp": 2}  # tiny weights: as many copies as allowed
        for v in r["variants"].values():
            assert v["ok"] and v["max_error"] < 2e-2 and len(v["us_ranks"]) == 2 and v["speedup"] > 0
    mlp = by_case[("fp8 MLP H=256 I=256", 5)]  # with and without silu_mul_quant, at TP = 1 and TP = 2
    assert set(mlp["variants"]) == {"tp", "tp_symm", "tp_unfused"} and set(mlp["tp1_variants"]) == {"tp1_unfused"}
    table = tp.format_table(doc)
    assert "fp8 MLP H=256 I=256" in table and "tp_symm" in table and "faster than TP1 in" in table
    assert "tp1_unfused" in table and "tp_unfused" in table
