"""`kdsl bench --tp N`: kdsl.parallel's layers and MLPs at TP = N against TP = 1, on N GPUs of one host.

It spawns N processes itself (torch.multiprocessing, NCCL on MASTER_ADDR=127.0.0.1, one GPU a rank) or runs
under torchrun (WORLD_SIZE = N, LOCAL_RANK picks the GPU). Cases (N x K of a linear: outputs x inputs):

  fp8 column 2112x7168, 24576x1536   ColumnParallelLinear: gathered (tp) and sharded (tp_sharded)
  fp8 row 7168x2048, 7168x16384       RowParallelLinear fed its input shard (input_is_parallel, as after a
                                      column layer): reduced in bf16 (tp), in fp32 (tp_fp32), and through
                                      torch's symmetric-memory one-shot all-reduce (tp_symm, where it runs)
  fp8 MLP DeepSeek-V3 dense           ParallelMLP H=7168 I=18432: tp, tp_symm, and tp_unfused (fused_act off:
                                      torch's silu and mul, and for FP8 an act_quant of h, instead of
                                      silu_mul_quant / silu_mul)
  w4a16 MLP Llama-3-70B               ParallelMLP.from_gptq H=8192 I=28672, group 128, fp16: tp, tp_unfused

at M = 1 16 64 512 2048 (--m to change). TP = 1 is the same module on one GPU (FP8Linear; the MLP on a
one-rank group: one stacked gate_up GEMM, the fused activation, no collective), on every rank at once; for the
MLPs TP = 1 is also timed unfused (tp1_unfused), and unfused variants are checked against it. The collective of the same
size is timed alone (all_reduce, all_reduce_symm; all_gather for gathered columns): the floor of TP = N.

Every time is a CUDA graph of several calls per rank, replayed after a barrier; its calls cycle through copies
of the weights so that each reads them from DRAM (over 128 MB in all), as a model's layers do. Microseconds
per call: rank 0's median (the JSON has every rank's). Speedup = TP1 / TP=N. Every variant's output, eager and
from the graph's last replay, is checked against TP = 1's on every rank (an error over 2e-2 relative + 4e-3 *
max|TP1|: WRONG, exit 1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from kdsl import ops
from kdsl.nn import FP8Linear
from kdsl.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear, comm

M_VALUES = (1, 16, 64, 512, 2048)
RTOL, ATOL = 2e-2, 4e-3  # atol relative to max |TP1|: tests/test_parallel.py's check_close
# Reduced in bf16/fp16, each rank's partial sum is rounded once more before the all-reduce adds them: up to half
# an ulp (2^-9 of bf16) of a partial as large as the output per rank (an FP8 MLP at M = 16 on 2 H200s: 6.0e-3).
LOW_PRECISION_REDUCE_ATOL = 2.0**-8
COLD_BYTES = 128 << 20  # weight bytes a graph cycles through: over twice an H100's or H200's L2
MAX_COPIES = 32
MIN_CALLS = 20  # calls per captured graph: a barrier's skew between ranks spreads over them
TRIAL_SECONDS = 0.25  # replays per timing: about this long, 3 to 25 of them
SYMM_BYTES = 64 << 20  # the bench's one-shot variants take every size (the layers' default stops at 1 MiB)


@dataclass(frozen=True)
class TPCase:
    name: str
    kind: str     # "column", "row" or "mlp"
    scheme: str   # "fp8" or "gptq"
    n: int        # a linear's outputs; the MLP's hidden size
    k: int        # a linear's inputs; the MLP's intermediate size


CASES = (
    TPCase("fp8 column 2112x7168", "column", "fp8", 2112, 7168),
    TPCase("fp8 column 24576x1536", "column", "fp8", 24576, 1536),
    TPCase("fp8 row 7168x2048", "row", "fp8", 7168, 2048),
    TPCase("fp8 row 7168x16384", "row", "fp8", 7168, 16384),
    TPCase("fp8 MLP DeepSeek-V3 dense H=7168 I=18432", "mlp", "fp8", 7168, 18432),
    TPCase("w4a16 MLP Llama-3-70B H=8192 I=28672", "mlp", "gptq", 8192, 28672),
)


def variants(case: TPCase) -> dict[str, dict]:
    """The TP = N configurations timed for a case: attribute settings of the same modules."""
    if case.kind == "column":
        return {"tp": {"gather_output": True}, "tp_sharded": {"gather_output": False}}
    out = {"tp": {}}
    if case.kind == "row":
        out["tp_fp32"] = {"reduce_dtype": "float32"}
    if case.scheme == "fp8":  # the one-shot kernel takes bf16 and fp32, not fp16
        out["tp_symm"] = {"all_reduce": "symm_mem"}
    if case.kind == "mlp":  # torch's silu and mul (FP8: and act_quant of h) instead of silu_mul(_quant)
        out["tp_unfused"] = {"fused_act": False}
    return out


# --- arguments ----------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallel (--tp): kdsl.bench.tp")
    group.add_argument("--tp", type=int, metavar="N",
                       help="time kdsl.parallel's FP8 column/row layers and FP8/W4A16 MLPs at TP=N against TP=1 "
                            "(N GPUs: spawns N processes, or runs under torchrun); --m picks M, --json writes")


def _fail(message: str) -> int:
    print(f"kdsl bench: error: {message}", file=sys.stderr)
    return 2


def _torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def refusal(args: argparse.Namespace) -> str | None:
    """Why --tp cannot run with these arguments on this machine (exit 2), checked before any process starts."""
    if args.tp < 2:
        return f"--tp {args.tp}: expected at least 2 (TP = N is timed against TP = 1)"
    for flag in ("op", "plot", "model"):
        if getattr(args, flag, None):
            return f"--{flag} does not go with --tp (the tensor-parallel bench has its own cases)"
    ms = getattr(args, "m", None) or M_VALUES
    if any(m < 1 for m in ms):
        return f"--m {' '.join(map(str, ms))}: token counts must be positive"
    if args.json and not Path(args.json).resolve().parent.is_dir():
        return f"--json {args.json}: directory does not exist"
    if _torchrun() and int(os.environ["WORLD_SIZE"]) != args.tp:
        return f"--tp {args.tp} under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}: they must agree"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < (int(os.environ.get("LOCAL_RANK", 0)) + 1 if _torchrun() else args.tp):
        return (f"--tp {args.tp} needs {args.tp} CUDA GPUs (one per rank), this machine has {gpus} "
                f"(torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()})")
    return None


def run(args: argparse.Namespace) -> int:
    """`kdsl bench --tp N` -> exit status (0 correct, 1 WRONG or failed, 2 cannot run)."""
    why = refusal(args)
    if why:
        return _fail(why)
    ms = tuple(getattr(args, "m", None) or M_VALUES)
    json_path = str(Path(args.json).resolve()) if args.json else None
    from kdsl.bench.report import command_line

    options = {"ms": ms, "json": json_path, "command": command_line()}
    if _torchrun():
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        doc = _rank_main(rank, world, local, "env://", options)
        return _finish(doc, json_path) if rank == 0 else (1 if doc is None or doc["failed"] else 0)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        options["result"] = os.path.join(folder, "result.json")
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # this host's ranks only
        os.environ["MASTER_PORT"] = str(_free_port())
        try:
            mp.spawn(_spawned, args=(args.tp, options), nprocs=args.tp, join=True)
        except Exception as error:  # a rank raised: its traceback is in the message
            print(f"kdsl bench: a rank failed: {error}", file=sys.stderr)
            if os.path.exists(options["result"]):
                _finish(json.loads(Path(options["result"]).read_text()), json_path)
            return 1
        return _finish(json.loads(Path(options["result"]).read_text()), json_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, options: dict) -> None:
    _rank_main(rank, world, rank, "env://", options)


def _finish(doc: dict, json_path: str | None) -> int:
    print(format_table(doc))
    if json_path:
        print(f"kdsl bench: wrote {json_path}", file=sys.stderr)
    if doc["failed"]:
        print(f"kdsl bench: {len(doc['failed'])} results WRONG: " + "; ".join(doc["failed"]), file=sys.stderr)
        return 1
    print(f"kdsl bench: all {sum(len(r['variants']) for r in doc['rows'])} TP={doc['tp']} results agree with TP=1",
          file=sys.stderr)
    return 0


# --- one rank -----------------------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, local: int, init: str, options: dict) -> dict | None:
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    try:
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(minutes=5), device_id=device)
    except TypeError:  # a torch without device_id
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=5))
    timer = GraphTimer(device)
    doc = bench(rank, world, device, options, timer)  # an exception ends this process: the others are stopped
    torch.cuda.synchronize(device)
    timer.barrier()
    comm._buffers.clear()  # symmetric buffers go before the group whose store set them up
    dist.destroy_process_group()
    return doc


def environment(device) -> dict:
    env = {"torch": torch.__version__, "triton": triton.__version__}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        nccl = torch.cuda.nccl.version()
        env.update(gpu=torch.cuda.get_device_name(device), arch=f"sm_{major}{minor}", cuda=torch.version.cuda,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    env["symm_mem_ops"] = comm._symm_ops() is not None
    return env


def bench(rank: int, world: int, device, options: dict, timer) -> dict:
    """Every case (options["cases"], default CASES) on this rank, at options["ms"]: a collective, every rank runs
    it. Rank 0 returns the document and writes it to options["json"] and options["result"] after every case;
    the others return {"failed": [...]}, which every rank agrees on."""
    cases = options.get("cases", CASES)
    started = time.perf_counter()
    # TP = 1 runs on a one-rank group of each rank (new_group is collective: every rank creates every group).
    one = [dist.new_group([r]) for r in range(world)][rank]
    doc = {"bench": "tp", "schema": 1, "tp": world, "command": options.get("command"),
           "environment": environment(device), "m": list(options["ms"]), "method": __doc__.split("\n\n")[-1],
           "rows": [], "failed": []}
    for i, case in enumerate(cases, 1):
        if rank == 0:
            print(f"[{i}/{len(cases)}] {case.name} ...", file=sys.stderr, flush=True)
        rows = run_case(case, options["ms"], rank, world, device, one, timer, options.get("max_copies", MAX_COPIES))
        doc["rows"] += rows
        doc["failed"] += [f"{r['case']} M={r['m']} {name}" for r in rows for name, v in r["variants"].items()
                          if not v["ok"]]
        doc["seconds"] = round(time.perf_counter() - started, 1)
        doc["environment"]["symm_mem_buffers"] = {f"{k[0]} {k[1]} {k[2]}": b is not None  # set up, or NCCL instead
                                                  for k, b in comm._buffers.items()}
        if rank == 0:  # after every case: a later failure keeps what was measured
            for path in (options.get("json"), options.get("result")):
                if path:
                    Path(path).write_text(json.dumps(doc, indent=1))
    return doc if rank == 0 else {"failed": doc["failed"]}


# --- cases --------------------------------------------------------------------------------------------------

def checkpoint(case: TPCase, device, seed: int = 0) -> dict:
    """The case's whole checkpoint tensors, the same on every rank (seeded on the device)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def fp8(n, k):
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32).div_(math.sqrt(k))
        q, s = ops.weight_quant(w.to(torch.bfloat16))
        return {"weight": q, "weight_scale_inv": s}

    def gptq(k, n, group=128):  # random int4 codes and zeros, scales keeping outputs near 1
        def words(*shape):
            return torch.randint(-2**31, 2**31, shape, generator=gen, device=device, dtype=torch.int32)
        scales = (torch.rand(k // group, n, generator=gen, device=device) * 0.5 + 0.75) * (0.25 / math.sqrt(k))
        return {"qweight": words(k // 8, n), "qzeros": words(k // group, n // 8), "scales": scales.half()}

    if case.kind != "mlp":
        return {"layer": fp8(case.n, case.k)}
    h, i = case.n, case.k
    if case.scheme == "fp8":
        return {"gate": fp8(i, h), "up": fp8(i, h), "down": fp8(h, i)}
    return {"gate": gptq(h, i), "up": gptq(h, i), "down": gptq(i, h)}


def build(case: TPCase, t: dict, group, tp1: bool):
    """A new module of the case: TP = 1 (tp1) or this rank's TP = N shard."""
    if case.kind == "mlp":
        make = ParallelMLP.from_fp8 if case.scheme == "fp8" else ParallelMLP.from_gptq
        return make(t["gate"], t["up"], t["down"], group=group, symm_mem_max_bytes=SYMM_BYTES)
    w, s = t["layer"]["weight"], t["layer"]["weight_scale_inv"]
    if tp1:
        return FP8Linear(w.clone(), s.clone())
    if case.kind == "column":
        return ColumnParallelLinear.from_fp8(w, s, group=group)
    return RowParallelLinear.from_fp8(w, s, group=group, input_is_parallel=True, symm_mem_max_bytes=SYMM_BYTES)


def configure(module, case: TPCase, settings: dict) -> None:
    """Put a variant's settings on a TP = N module (the same weights serve every variant)."""
    if case.kind == "column":
        module.gather_output = settings["gather_output"]
        return
    row = module.down if case.kind == "mlp" else module
    row.reduce_dtype = torch.float32 if settings.get("reduce_dtype") == "float32" else None
    row.all_reduce = settings.get("all_reduce", "nccl")
    if case.kind == "mlp":
        module.fused_act = settings.get("fused_act", True) and module.fused_act_serves()


def weight_bytes(module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers() if b is not None)


def copies_for(module, most: int = MAX_COPIES) -> int:
    return max(1, min(most, math.ceil(COLD_BYTES / max(weight_bytes(module), 1))))


def run_case(case: TPCase, ms, rank: int, world: int, device, one, timer, most: int = MAX_COPIES) -> list[dict]:
    t = checkpoint(case, device)
    dtype = torch.float16 if case.scheme == "gptq" else torch.bfloat16
    first = build(case, t, one, tp1=True)
    tp1 = [first] + [build(case, t, one, tp1=True) for _ in range(copies_for(first, most) - 1)]
    first = build(case, t, None, tp1=False)
    tpn = [first] + [build(case, t, None, tp1=False) for _ in range(copies_for(first, most) - 1)]
    del t
    in_features = case.n if case.kind == "mlp" else case.k
    out_features = case.n
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for m in ms:
        x = torch.randn(m, in_features, generator=gen, device=device).to(dtype)
        x_tp = x
        if case.kind == "row":  # input_is_parallel: this rank's columns, as a column layer leaves them
            x_tp = x[:, tpn[0].in_slice].contiguous()
        with torch.inference_mode():
            expected = tp1[0](x)
            row = {"case": case.name, "kind": case.kind, "scheme": case.scheme, "n": case.n, "k": case.k, "m": m,
                   "tp": world, "copies": {"tp1": len(tp1), "tp": len(tpn)}, "variants": {}, "floors": {}}
            row["tp1_us"], row["tp1_us_ranks"], _ = timer.time([lambda mod=mod: mod(x) for mod in tp1])
            unfused = None
            if case.kind == "mlp":  # TP = 1 with torch's silu and mul: the unfused variants' reference
                for mod in tp1:
                    mod.fused_act = False
                unfused = tp1[0](x)
                us, ranks, _ = timer.time([lambda mod=mod: mod(x) for mod in tp1])
                row["tp1_variants"] = {"tp1_unfused": {"us": us, "us_ranks": ranks}}
                for mod in tp1:
                    mod.fused_act = mod.fused_act_serves()
            for name, settings in variants(case).items():
                for mod in tpn:
                    configure(mod, case, settings)
                y = tpn[0](x_tp)
                want = unfused if settings.get("fused_act") is False else expected
                if case.kind == "column" and not settings["gather_output"]:
                    size = case.n // world
                    want = expected[..., rank * size:(rank + 1) * size]
                # partials reduced in the activation dtype (row layers and MLPs unless reduce_dtype says float32)
                reduced = 1 if case.kind == "column" or settings.get("reduce_dtype") == "float32" else world
                error, ok = compare(y, want, reduced)
                us, ranks, replayed = timer.time([lambda mod=mod: mod(x_tp) for mod in tpn])
                graph_error, graph_ok = compare(replayed, want, reduced)  # what the graph computed, as well as eager
                error, ok = max(error, graph_error), timer.all_ok(ok and graph_ok)
                row["variants"][name] = {"us": us, "us_ranks": ranks, "speedup": row["tp1_us"] / us,
                                         "max_error": error, "ok": ok}
            for name, fn in floors(case, m, out_features, world, dtype, device).items():
                us, ranks, _ = timer.time([fn])
                row["floors"][name] = {"us": us, "us_ranks": ranks}
        for mod in tpn:
            configure(mod, case, variants(case)["tp"])
        rows.append(row)
        if rank == 0:
            tp = row["variants"]["tp"]
            print(f"    M={m}: TP1 {row['tp1_us']:.1f} us, TP{world} {tp['us']:.1f} us ({tp['speedup']:.2f}x)"
                  + "".join(f", {k} {v['us']:.1f}" for k, v in row["floors"].items()), file=sys.stderr, flush=True)
    timer.barrier()
    return rows


def floors(case: TPCase, m: int, out_features: int, world: int, dtype, device) -> dict:
    """The collective of a TP = N call timed alone: the all-reduce of [M, N] (NCCL; torch's one-shot where it
    runs), or for a gathered column layer the all_gather_into_tensor of [M, N / T]."""
    if case.kind == "column":
        mine = torch.zeros(m, out_features // world, dtype=dtype, device=device)
        out = torch.empty(world * m, out_features // world, dtype=dtype, device=device)
        return {"all_gather": lambda: dist.all_gather_into_tensor(out, mine)}
    buf = torch.zeros(m, out_features, dtype=dtype, device=device)
    out = {"all_reduce": lambda: dist.all_reduce(buf)}
    if "tp_symm" in variants(case) and comm.symm_mem_buffer(None, device, dtype, SYMM_BYTES) is not None:
        out["all_reduce_symm"] = lambda: comm.all_reduce_(buf, None, "symm_mem", SYMM_BYTES)
    return out


def compare(y, expected, world: int = 1) -> tuple[float, bool]:
    """(max |y - expected| / max |expected|, within tests' tolerance); world > 1: summed over that many ranks'
    partials in y's dtype (each rounded once more: LOW_PRECISION_REDUCE_ATOL per rank)."""
    scale = expected.float().abs().max().item() or 1.0
    diff = (y.float() - expected.float()).abs()
    atol = ATOL + (world * LOW_PRECISION_REDUCE_ATOL if world > 1 and y.dtype != torch.float32 else 0.0)
    ok = tuple(y.shape) == tuple(expected.shape) and bool(
        (diff <= atol * scale + RTOL * expected.float().abs()).all())
    return diff.max().item() / scale, ok


# --- timing -------------------------------------------------------------------------------------------------

class Timer:
    """What the bench asks of every rank besides timing: a barrier, agreement on a check, every rank's value."""

    def __init__(self, device):
        self.device = device

    def all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        dist.all_reduce(flag)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gather(self, value: float) -> list[float]:
        mine = torch.tensor([value], dtype=torch.float64, device=self.device)
        every = torch.empty(dist.get_world_size(), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(every, mine)
        return every.tolist()


class GraphTimer(Timer):
    """Microseconds per call of fns (called in turn), captured in one CUDA graph on every rank and replayed
    after a barrier; returns (rank 0's median, every rank's median, the last call's output after the replays)."""

    def time(self, fns) -> tuple[float, list[float], object]:
        calls = max(MIN_CALLS, len(fns))
        for fn in fns:  # eager: compiles kernels, sets up communicators and symmetric buffers
            fn()
        # A throwaway capture first: the paths a capture takes (FP8Linear's two kernels, no launch-plan replays)
        # compile there, not inside the timed graph.
        warm = torch.cuda.CUDAGraph()
        with torch.cuda.graph(warm, capture_error_mode="thread_local"):
            fns[0]()
        del warm
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for i in range(calls):
                last = fns[i % len(fns)]()  # every copy holds the same weights: the last output is checked
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.barrier()
        graph.replay()  # once, warm; its time sets the number of replays (the same on every rank)
        self.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        longest = max(self.gather(start.elapsed_time(end) / 1e3))
        trials = max(3, min(25, int(TRIAL_SECONDS / max(longest, 1e-6))))
        times = []
        for _ in range(trials):
            self.barrier()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        del graph
        ranks = self.gather(statistics.median(times))
        return ranks[0], ranks, last


class WallTimer(Timer):
    """A host clock around eager calls: drives the bench's logic on the CPU (gloo) in tests; not a measurement."""

    def time(self, fns) -> tuple[float, list[float], object]:
        self.barrier()
        started = time.perf_counter()
        for fn in fns:
            last = fn()
        ranks = self.gather((time.perf_counter() - started) * 1e6 / len(fns))
        return ranks[0], ranks, last


# --- report -------------------------------------------------------------------------------------------------

def format_table(doc: dict) -> str:
    """One block per case: M, TP1, each variant's time and speedup, the collectives alone (us per call)."""
    env = doc.get("environment", {})
    tp = doc["tp"]
    lines = [f"kdsl bench --tp {tp}: {env.get('gpu', '?')} x {tp}, torch {env.get('torch', '?')}, NCCL "
             f"{env.get('nccl', '?')}; us per call (CUDA graph, weights cold, rank 0's median); speedup = TP1 / TP{tp}"]
    cases = list(dict.fromkeys(r["case"] for r in doc["rows"]))
    for name in cases:
        rows = [r for r in doc["rows"] if r["case"] == name]
        names = list(rows[0]["variants"])
        floors_ = list(dict.fromkeys(f for r in rows for f in r["floors"]))
        tp1s = list(dict.fromkeys(f for r in rows for f in r.get("tp1_variants", {})))
        header = f"{'M':>6} {'TP1':>9} " + "".join(f"{v:>12} " for v in tp1s) + " ".join(
            f"{v:>12} {'x':>5}" for v in names) + " " + " ".join(f"{f:>15}" for f in floors_)
        lines += ["", name, header]
        for r in rows:
            cells = " ".join(f"{r['variants'][v]['us']:>12.1f} {r['variants'][v]['speedup']:>5.2f}"
                             + ("" if r["variants"][v]["ok"] else " WRONG") for v in names)
            baselines = "".join(f"{r.get('tp1_variants', {}).get(v, {}).get('us', float('nan')):>12.1f} "
                                for v in tp1s)
            lines.append(f"{r['m']:>6} {r['tp1_us']:>9.1f} {baselines}{cells} " + " ".join(
                f"{r['floors'][f]['us']:>15.1f}" if f in r["floors"] else f"{'-':>15}" for f in floors_))
    faster = sum(r["variants"]["tp"]["speedup"] > 1 for r in doc["rows"])
    lines += ["", f"TP{tp} (tp) faster than TP1 in {faster} of {len(doc['rows'])} cells; "
                  f"{doc.get('seconds', '?')} s"]
    return "\n".join(lines)
