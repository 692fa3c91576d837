"""The sharding planner, its cost model, and sharded tables in one process (no process group)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from models.dlrm import DLRM, DLRMConfig
from recompile.distributed import Hardware, Sharding, ShardedEmbeddingBag, TableSpec, backend_for, plan, table_specs
from recompile.distributed.planner import placement
from recompile.distributed.sharding import hash_owner
from recompile.launch import torchrun_args


def test_backend_follows_the_device_type():
    assert [backend_for(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="no collective backend for device type 'meta'"):
        backend_for("meta")


def test_planner_balances_table_wise_and_row_wise_shards_what_fits_nowhere():
    specs = [TableSpec(f"t{i}", 1000, 16) for i in range(4)] + [TableSpec("huge", 100_000, 16)]
    budget = Hardware(memory_bytes=5e6)  # one table of 1000 x 16 fp32 is 64 KB, "huge" is 6.4 MB
    p = plan(specs, world_size=2, batch=256, hardware=budget)
    assert p["huge"].kind == "row_wise"
    assert max(load.memory for load in p.loads()) <= budget.memory_bytes
    text = str(p)
    assert "huge" in text and "row_wise" in text and "all-to-all MB/step" in text
    with pytest.raises(ValueError, match="table 'huge'.*fits no rank"):
        plan(specs, world_size=2, batch=256, hardware=Hardware(memory_bytes=2e6))


def test_planner_spreads_small_tables_table_wise_over_ranks():
    p = plan([TableSpec(f"t{i}", 100, 8) for i in range(4)], world_size=2, batch=4096, kinds=("table_wise",))
    owners = sorted(p[f"t{i}"].rank for i in range(4))
    assert owners == [0, 0, 1, 1]


def test_dynamic_tables_are_planned_hash_row_wise():
    p = plan([TableSpec("keys", 10**6, 32, dynamic=True), TableSpec("t", 10, 32)], 4, 128)
    assert p["keys"].kind == "hash_row_wise"


def test_cost_model_dedup_never_costs_more_and_table_wise_loads_the_owner():
    spec = TableSpec("t", 1000, 64, pooling=4.0)
    for kind in (Sharding("row_wise"), Sharding("table_wise", 1)):
        with_dedup = placement(spec, kind, 4, 1024, dedup=True).per_rank
        without = placement(spec, kind, 4, 1024, dedup=False).per_rank
        assert all(a.comm_bytes <= b.comm_bytes for a, b in zip(with_dedup, without))
    tw = placement(spec, Sharding("table_wise", 1), 4, 1024, dedup=False).per_rank
    assert tw[1].comm_bytes == 3 * tw[0].comm_bytes and tw[0].memory == 0


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 10_000), world_size=st.integers(1, 16))
def test_row_wise_ownership_covers_every_row_once(rows, world_size):
    sharding = Sharding("row_wise")
    ranges = [sharding.row_range(r, rows, world_size) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    ids = torch.arange(rows)
    owners = sharding.owner_of(ids, rows, world_size)
    for r, (lo, hi) in enumerate(ranges):
        assert bool((owners[lo:hi] == r).all())


def test_hash_owner_spreads_keys_and_is_deterministic():
    keys = torch.randint(-(1 << 62), 1 << 62, (40_000,))
    owners = hash_owner(keys, 8)
    assert torch.equal(owners, hash_owner(keys.clone(), 8))
    counts = torch.bincount(owners, minlength=8).float()
    assert bool((counts / counts.mean() - 1).abs().max() < 0.1)
    assert torch.bincount(hash_owner(torch.arange(8000), 8), minlength=8).min() > 800  # sequential keys too


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dedup", [True, False])
def test_sharded_table_in_one_process_equals_embedding_bag(mode, dedup):
    ref = nn.EmbeddingBag(50, 6, mode=mode)
    table = ShardedEmbeddingBag.from_module("t", ref, Sharding("row_wise"), dedup=dedup)
    ids = torch.randint(0, 50, (40,))
    offsets = torch.tensor([0, 3, 3, 10, 25])  # with an empty bag
    psw = torch.rand(40) if mode == "sum" else None
    got, want = table(ids, offsets, psw), ref(ids, offsets, per_sample_weights=psw)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(table.weight.grad, ref.weight.grad)


def test_sharded_embedding_and_2d_input_equal_torch():
    emb, bag = nn.Embedding(30, 4), nn.EmbeddingBag(30, 4, mode="mean")
    ids = torch.randint(0, 30, (5, 3), dtype=torch.int32)
    torch.testing.assert_close(ShardedEmbeddingBag.from_module("e", emb, Sharding("row_wise"))(ids), emb(ids))
    torch.testing.assert_close(ShardedEmbeddingBag.from_module("b", bag, Sharding("table_wise"))(ids), bag(ids))


def test_bad_ids_and_unsupported_tables_name_the_table():
    table = ShardedEmbeddingBag.from_module("clicks", nn.EmbeddingBag(10, 4), Sharding("row_wise"))
    with pytest.raises(IndexError, match="table 'clicks': id 10 is outside"):
        table(torch.tensor([1, 10]), torch.tensor([0]))
    with pytest.raises(ValueError, match="table 'pad'.*padding_idx"):
        ShardedEmbeddingBag.from_module("pad", nn.Embedding(10, 4, padding_idx=0), Sharding("row_wise"))
    with pytest.raises(ValueError, match="table 'm'.*'max'"):
        ShardedEmbeddingBag.from_module("m", nn.EmbeddingBag(10, 4, mode="max"), Sharding("row_wise"))


def test_table_specs_of_a_dlrm():
    specs = table_specs(DLRM(DLRMConfig(table_rows=[10, 20])), pooling=2.0)
    assert [(s.name, s.rows, s.dim, s.pooling) for s in specs] == [("embeddings.0", 10, 16, 2.0),
                                                                    ("embeddings.1", 20, 16, 2.0)]


def test_launch_adds_a_standalone_rendezvous_unless_given_one():
    assert torchrun_args(["--nproc-per-node=2", "-m", "models.train"])[0] == "--standalone"
    argv = ["--nnodes=2", "--rdzv-endpoint=host:29400", "train.py"]
    assert torchrun_args(argv) == argv
