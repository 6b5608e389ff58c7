"""Tensor parallel (kdsl.parallel): shards cut in the packed layouts, and column/row-parallel linears on
torch.distributed (gloo, spawned CPU processes) agree with the one-rank layer.

Every case runs on the ops' torch fallbacks in the workers (TRITON_INTERPRET unset there), and every scheme
and parallel style again on the generated kernels through Triton's interpreter.
"""
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reference as fp8_ref
import reference_gptq as gptq_ref
from kdsl.nn import FP8Linear, W4A16Linear
from kdsl.parallel import (ColumnParallelLinear, RowParallelLinear, ShardError, gptq_row_index, shard_awq,
                           shard_fp8, shard_gptq)
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ
from test_awq import pack_awq

M = 3


# --- checkpoints, the same on every rank (seeded) ---------------------------------------------------------

def fp8_layer(n, k, seed):
    torch.manual_seed(seed)
    q, s = fp8_ref.weight_quant_ref(torch.randn(n, k) * 0.05)
    return {"weight": q, "weight_scale_inv": s, "bias": (torch.randn(n) * 0.1).bfloat16()}


def gptq_layer(n, k, seed, group_size=128, checkpoint_format="gptq", act_order=True, g_idx=None):
    gen = torch.Generator().manual_seed(seed)
    made = gptq_ref.make_checkpoint(k, n, group_size=group_size, checkpoint_format=checkpoint_format, scale=0.002,
                                    g_idx=g_idx or ("perm" if act_order else "default"), generator=gen)
    bias = (torch.rand(n, generator=gen) * 0.2 - 0.1).half()
    return {**{r: made[r] for r in ("qweight", "qzeros", "scales", "g_idx")}, "bias": bias}


def awq_layer(n, k, seed, group_size=128):
    gen = torch.Generator().manual_seed(seed)
    q, zeros = torch.randint(0, 16, (k, n), generator=gen), torch.randint(0, 16, (k // group_size, n), generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.002 + 0.0005).half()
    return {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales,
            "bias": (torch.rand(n, generator=gen) * 0.2 - 0.1).half()}


# (name, kind, n, k, build kwargs, scheme); every case runs column and row parallel unless restricted
def cases(world):
    return [
        ("fp8 N=576", "fp8", 576, 256, {}, BlockFP8(), ("column",)),
        ("fp8 N=2112", "fp8", 2112, 256, {}, BlockFP8(), ("column",)),
        ("fp8", "fp8", 256, 128 * world, {}, BlockFP8(), ("column", "row")),
        ("gptq v1 act-order g128", "gptq", 64 * world, 256 * world, {}, GPTQ(desc_act=True), ("column", "row")),
        ("gptq v1 act-order g32", "gptq", 128, 512, {"group_size": 32}, GPTQ(group_size=32, desc_act=True),
         ("column", "row")),
        ("gptq v2", "gptq", 64 * world, 128 * world, {"checkpoint_format": "gptq_v2", "act_order": False},
         GPTQ(checkpoint_format="gptq_v2"), ("column", "row")),
        ("awq", "awq", 64 * world, 128 * world, {}, AWQ(), ("column", "row")),
        # Groups of unequal size (any group per row) and groups straddling ranks (K / T = 96 or 48 at group
        # 64): each rank gets the scale/zero rows of every group its rows touch.
        ("gptq random g_idx g32", "gptq", 64, 512, {"group_size": 32, "g_idx": "random"},
         GPTQ(group_size=32, desc_act=True), ("row",)),
        ("gptq random g_idx g128", "gptq", 64, 512, {"g_idx": "random"}, GPTQ(desc_act=True), ("row",)),
        ("gptq act-order g64 straddling", "gptq", 64, 192, {"group_size": 64}, GPTQ(group_size=64, desc_act=True),
         ("row",)),
    ]


def build(kind, n, k, kwargs, seed):
    return {"fp8": fp8_layer, "gptq": gptq_layer, "awq": awq_layer}[kind](n, k, seed, **kwargs)


def one_rank(kind, t, scheme):
    if kind == "fp8":
        return FP8Linear(t["weight"], t["weight_scale_inv"], t["bias"], scheme)
    if kind == "gptq":
        return W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], scheme)
    return W4A16Linear.from_awq(t["qweight"], t["qzeros"], t["scales"], t["bias"], scheme)


def parallel(kind, t, scheme, dim, **kw):
    cls = ColumnParallelLinear if dim == "column" else RowParallelLinear
    if kind == "fp8":
        return cls.from_fp8(t["weight"], t["weight_scale_inv"], t["bias"], scheme=scheme, **kw)
    if kind == "gptq":
        return cls.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], scheme=scheme, **kw)
    return cls.from_awq(t["qweight"], t["qzeros"], t["scales"], t["bias"], scheme=scheme, **kw)


def check_close(actual, expected, what):
    """Column parallel computes each output as one rank does; row parallel sums float32 partials (FP8) or
    fp16 partials (int4) in another order: a few units in the last place of the output dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=4e-3 * scale, msg=what)


# --- workers -----------------------------------------------------------------------------------------------

def _worker(rank, world, init_file, interpret, selected):
    if not interpret:
        os.environ.pop("TRITON_INTERPRET", None)  # the ops read it per call: torch fallbacks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for index, (name, kind, n, k, kwargs, scheme, dims) in enumerate(cases(world)):
            if selected is not None and name not in selected:
                continue
            t = build(kind, n, k, kwargs, seed=index)
            torch.manual_seed(1000 + index)
            dtype = torch.bfloat16 if kind == "fp8" else torch.float16
            x = torch.randn(M, k).to(dtype)
            with torch.no_grad():
                expected = one_rank(kind, t, scheme)(x)
                for dim in dims:
                    what = f"{name} {dim} TP={world} rank {rank}"
                    if dim == "column":
                        layer = parallel(kind, t, scheme, dim, gather_output=True)
                        check_close(layer(x), expected, what)
                        local = parallel(kind, t, scheme, dim, gather_output=False)(x)
                        size = n // world
                        check_close(local, expected[:, rank * size:(rank + 1) * size], what + " (sharded)")
                    else:
                        layer = parallel(kind, t, scheme, dim)
                        check_close(layer(x), expected, what)
                        # The same rank fed its own input shard (what a column-parallel layer leaves).
                        shard = parallel(kind, t, scheme, dim, input_is_parallel=True)
                        index_ = layer.in_index if layer.in_index is not None else layer.in_slice
                        mine = x.index_select(-1, index_) if isinstance(index_, torch.Tensor) else x[:, index_]
                        check_close(shard(mine), expected, what + " (input_is_parallel)")
        if selected is None:
            _act_order_mlp(rank, world)
        if world == 4 and selected is None:
            _subgroups(rank)
    finally:
        dist.destroy_process_group()


def _act_order_mlp(rank, world):
    """up (column, act-order) -> silu -> down (row, act-order, group 32) with no gather in between: up's
    shard computes exactly the columns down's shard reads (gptq_row_index), in down's sorted-by-group order."""
    scheme = GPTQ(group_size=32, desc_act=True)
    up, down = build("gptq", 512, 256, {"group_size": 32}, seed=60), build("gptq", 128, 512, {"group_size": 32}, seed=61)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(62)).half()
    index = gptq_row_index(down["g_idx"], 512, rank=rank, world_size=world, group_size=32)
    with torch.no_grad():
        expected = one_rank("gptq", down, scheme)(torch.nn.functional.silu(one_rank("gptq", up, scheme)(x)))
        h = parallel("gptq", up, scheme, "column", gather_output=False, out_index=index)(x)
        layer = parallel("gptq", down, scheme, "row", input_is_parallel=True)
        assert torch.equal(layer.in_index, index)
        check_close(layer(torch.nn.functional.silu(h)), expected, f"act-order MLP TP={world} rank {rank}")


def _subgroups(rank):
    """TP = 2 inside each half of 4 processes: the layers use the group's rank and size, not the world's."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    for index, (kind, n, k, kwargs, scheme, dim) in enumerate([
            ("fp8", 576, 256, {}, BlockFP8(), "column"), ("gptq", 64, 256, {"group_size": 32},
                                                          GPTQ(group_size=32, desc_act=True), "row")]):
        t = build(kind, n, k, kwargs, seed=50 + index)
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(rank // 2)).to(
            torch.bfloat16 if kind == "fp8" else torch.float16)  # the two halves see different inputs
        with torch.no_grad():
            layer = parallel(kind, t, scheme, dim, group=group)
            assert (layer.rank, layer.world_size) == (rank % 2, 2)
            check_close(layer(x), one_rank(kind, t, scheme)(x), f"{kind} {dim} in group {rank // 2} rank {rank}")


def spawn(world, interpret=False, selected=None):
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world, os.path.join(folder, "store"), interpret, selected), nprocs=world,
                 join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_one_rank(world):
    """FP8 (N = 576 and 2112 off the 128 grid, column), GPTQ v1 act-order (group 128 and 32, the vLLM
    #5596 case at TP = 4 row parallel), GPTQ v2, AWQ: column (gathered and sharded) and row parallel; GPTQ row
    parallel with a random g_idx (groups of unequal size) and with groups straddling two ranks."""
    spawn(world)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_through_the_interpreter(world):
    """Every scheme and parallel style on the generated kernels: FP8 column (576 columns, off the 128 grid) and
    row, GPTQ v1 act-order group 32, GPTQ v2 and AWQ column and row, GPTQ row with a random g_idx."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest on the CPU)")
    spawn(world, interpret=True, selected={"fp8 N=576", "fp8", "gptq v1 act-order g32", "gptq v2", "awq",
                                           "gptq random g_idx g32"})


# --- shards without processes ------------------------------------------------------------------------------

@pytest.mark.parametrize("n,world", [(576, 2), (576, 4), (2112, 2), (2112, 4), (576, 32)])
def test_fp8_off_grid_column_shards_reassemble_the_layer(n, world):
    """A scale block straddling ranks goes to both; the shard is realigned to it by zero rows in front."""
    t = fp8_layer(n, 256, seed=n)
    x = torch.randn(M, 256).bfloat16()
    expected = FP8Linear(t["weight"], t["weight_scale_inv"], t["bias"])(x)
    parts = []
    for rank in range(world):
        s = shard_fp8(t["weight"], t["weight_scale_inv"], t["bias"], rank=rank, world_size=world, dim="column")
        start = rank * n // world
        assert s.pad_front == start % 128
        assert s.weight_scale_inv.shape[0] == -(-(start + n // world) // 128) - start // 128
        assert torch.equal(s.weight_scale_inv, t["weight_scale_inv"][start // 128:start // 128 + s.weight_scale_inv.shape[0]])
        assert s.weight.shape[0] % 8 == 0
        assert torch.equal(s.weight[s.out_slice].view(torch.uint8), t["weight"][start:start + n // world].view(torch.uint8))
        parts.append(FP8Linear(s.weight, s.weight_scale_inv, s.bias)(x)[:, s.out_slice])
    check_close(torch.cat(parts, dim=-1), expected, f"N={n} TP={world}")


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_act_order_row_shards_sum_to_the_layer(fmt):
    t = gptq_layer(64, 512, seed=3, group_size=32, checkpoint_format=fmt, act_order=True)
    scheme = GPTQ(group_size=32, checkpoint_format=fmt)
    x = torch.randn(M, 512).half()
    expected = W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], None, scheme)(x)
    total = torch.zeros(M, 64)
    for rank in range(4):
        s = shard_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], rank=rank, world_size=4, dim="row",
                       group_size=32)
        assert s.g_idx is None and s.scales.shape == (4, 64) and s.qweight.shape == (16, 64)
        assert torch.equal(torch.sort(t["g_idx"][s.in_index]).values, t["g_idx"][s.in_index])  # groups whole
        total += W4A16Linear.from_gptq(s.qweight, s.qzeros, s.scales, None, None, scheme)(x[:, s.in_index]).float()
    check_close(total.half(), expected, "gptq row TP=4")


@pytest.mark.parametrize("g_idx,group_size,k,world", [("perm", 64, 192, 2), ("default", 128, 256, 4),
                                                       ("random", 32, 512, 4)])
def test_gptq_row_shards_with_groups_straddling_ranks_sum_to_the_layer(g_idx, group_size, k, world):
    """A group cut between two ranks goes to both (its scale/zero row on each, each using it for its own rows);
    groups of unequal size (a random g_idx) likewise. The shard's g_idx indexes its own scale/zero rows."""
    t = gptq_layer(64, k, seed=4, group_size=group_size, g_idx=g_idx)
    scheme = GPTQ(group_size=group_size, desc_act=True)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(5)).half()
    expected = W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], None, scheme)(x)
    total, touched = torch.zeros(M, 64), []
    for rank in range(world):
        s = shard_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], rank=rank, world_size=world, dim="row",
                       group_size=group_size)
        assert s.qweight.shape == (k // world // 8, 64) and s.g_idx is not None
        first = int(t["g_idx"][s.in_index].min())
        assert torch.equal(s.g_idx.long() + first, t["g_idx"][s.in_index].long())  # sorted rows, own groups
        assert torch.equal(s.scales, t["scales"][first:first + s.scales.shape[0]])
        touched.append((first, first + s.scales.shape[0]))
        index = gptq_row_index(t["g_idx"], k, rank=rank, world_size=world, group_size=group_size)
        assert torch.equal(index, torch.arange(k)[s.in_index])  # what a column layer before it would produce
        total += gptq_ref.gemm_ref(x[:, s.in_index], s.qweight, s.qzeros, s.scales, s.g_idx)
    assert any(a[1] > b[0] for a, b in zip(touched, touched[1:]))  # some group is on two ranks
    check_close(total.half(), expected, f"gptq row {g_idx} g{group_size} TP={world}")


@pytest.mark.parametrize("cut,message", [
    (lambda: shard_gptq(*[gptq_layer(64, 256, 0)[r] for r in ("qweight", "qzeros", "scales", "g_idx")],
                        rank=1, world_size=64, dim="row", group_size=128),
     r"qweight \(32, 64\): cannot cut rank 1 of 64: K = 256 / 64 = 4 .* multiple of 8 .*packs 8 rows"),
    (lambda: shard_fp8(*[fp8_layer(256, 384, 0)[r] for r in ("weight", "weight_scale_inv")], rank=0,
                       world_size=2, dim="row"),
     r"weight \(256, 384\): cannot cut rank 0 of 2: K = 384 / 2 = 192 .* multiple of 128"),
    (lambda: shard_fp8(*[fp8_layer(576, 128, 0)[r] for r in ("weight", "weight_scale_inv")], rank=2,
                       world_size=5, dim="column"),
     r"weight \(576, 128\): cannot cut rank 2 of 5: N = 576 / 5 = 115.2 must be a whole number"),
    (lambda: shard_awq(*[awq_layer(48, 256, 0)[r] for r in ("qweight", "qzeros", "scales")], rank=3,
                       world_size=4, dim="column"),
     r"qweight \(256, 6\): cannot cut rank 3 of 4: N = 48 / 4 = 12 must be a whole number and a multiple of 8"),
    (lambda: shard_gptq(*[gptq_layer(48, 256, 0)[r] for r in ("qweight", "qzeros", "scales", "g_idx")],
                        rank=0, world_size=4, dim="column"),
     r"qweight \(32, 48\): cannot cut rank 0 of 4: N = 48 / 4 = 12 must be a whole number and a multiple of 8"),
])
def test_a_shard_that_cannot_be_cut_is_refused_naming_tensor_rank_and_shape(cut, message):
    with pytest.raises(ShardError, match=message):
        cut()


# --- load_quantized(tp_plan=...) ---------------------------------------------------------------------------

LOAD_KINDS = ("fp8", "gptq", "gptq_v2", "awq")


def _load_worker(rank, world, init_file, folder):
    os.environ.pop("TRITON_INTERPRET", None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        import kdsl
        from kdsl import checkpoint
        from test_nn import DIM, HIDDEN, TinyMLP

        for kind in LOAD_KINDS:
            dtype = torch.bfloat16 if kind == "fp8" else torch.float16
            read_whole, load = [], checkpoint._Shards.load

            def spy(self, key, device, load=load, read_whole=read_whole):
                read_whole.append(key)
                return load(self, key, device)

            checkpoint._Shards.load = spy
            try:
                model = kdsl.load_quantized(TinyMLP(dtype), os.path.join(folder, kind), device="cpu",
                                            tp_plan={"up": "column", "do*": "row"})
            finally:
                checkpoint._Shards.load = load
            assert isinstance(model.up, ColumnParallelLinear) and isinstance(model.down, RowParallelLinear)
            assert model.up.local.out_features == HIDDEN // world and model.down.local.in_features == HIDDEN // world
            # Only g_idx and biases of the parallel layers are read whole; the rest through get_slice.
            assert [k for k in read_whole if k.startswith(("up.", "down."))] == [
                k for k in read_whole if k in ("up.bias", "up.g_idx", "down.g_idx")], (kind, read_whole)
            one = kdsl.load_quantized(TinyMLP(dtype), os.path.join(folder, kind), device="cpu")
            torch.manual_seed(7)
            x = torch.randn(5, DIM).to(dtype)
            with torch.no_grad():
                check_close(model(x), one(x), f"load_quantized {kind} TP={world} rank {rank}")
    finally:
        dist.destroy_process_group()


def test_load_quantized_with_a_tp_plan_matches_one_rank(tmp_path):
    from test_nn import write_checkpoint

    for kind in LOAD_KINDS:
        write_checkpoint(tmp_path / kind, kind)
    mp.spawn(_load_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


def test_load_quantized_refuses_a_bad_tp_plan_and_an_uninitialized_group(tmp_path):
    import kdsl
    from test_nn import TinyMLP, write_checkpoint

    write_checkpoint(tmp_path / "awq", "awq")
    model = TinyMLP()
    before = dict(model.named_children())
    with pytest.raises(ValueError, match=r"tp_plan\['up'\]: expected 'column', 'row' or 'mlp', got 'colwise'"):
        kdsl.load_quantized(model, tmp_path / "awq", device="cpu", tp_plan={"up": "colwise"})
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            kdsl.load_quantized(model, tmp_path / "awq", device="cpu", tp_plan={"down": "row"})
    assert dict(model.named_children()) == before
