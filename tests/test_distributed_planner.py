"""The sharding planner, its cost model, and sharded tables in one process (no process group)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import recompile
from models.bench_distributed import ctr_features
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.distributed import (
    Hardware, Sharding, ShardedEmbeddingBag, TableSpec, backend_for, compile_lookups, distribute, plan, table_specs,
)
from recompile.distributed.planner import placement
from recompile.distributed.sharded_embedding import _dedup, pool_local
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


def test_planner_keeps_small_tables_whole_and_splits_a_table_no_rank_holds():
    specs = [TableSpec(f"t{i}", 1000, 16, pooling=2.0) for i in range(6)] + [TableSpec("big", 400_000, 16)]
    hbm = Hardware(memory_bytes=15e6, memory_gbps=1500.0)  # "big" is 25.6 MB; lookups cost little beside traffic
    p = plan(specs, world_size=4, batch=512, hardware=hbm)
    assert all(p[f"t{i}"].kind == "table_wise" for i in range(6))  # row-wise would move more pooled bytes
    assert p["big"].kind == "row_wise" and p["big"].span(4) in (2, 4)
    assert len({p[f"t{i}"].rank for i in range(6)}) == 4  # spread over every rank
    # Where lookups cost as much as traffic (100 GB/s), spreading the small tables' lookups row-wise wins.
    slow_memory = plan(specs, world_size=4, batch=512, hardware=Hardware(memory_bytes=15e6, memory_gbps=100.0))
    assert any(slow_memory[f"t{i}"].kind == "row_wise" for i in range(6))


def test_a_forced_sharding_is_kept_and_unknown_tables_are_refused():
    specs = [TableSpec(f"t{i}", 1000, 16) for i in range(3)]
    forced = Sharding("row_wise", 2, 2)
    p = plan(specs, world_size=4, batch=64, fixed={"t1": forced})
    assert p["t1"] == forced and p["t0"].kind == "table_wise"
    assert [load.memory > 0 for load in placement(specs[1], forced, 4, 64, True).per_rank] == [False, False, True, True]
    with pytest.raises(ValueError, match=r"fixed shardings for tables \['nope'\]"):
        plan(specs, world_size=4, batch=64, fixed={"nope": forced})


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


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 10_000), world_size=st.integers(1, 16), data=st.data())
def test_row_wise_ownership_covers_every_row_once(rows, world_size, data):
    span = data.draw(st.integers(1, world_size))
    first = data.draw(st.integers(0, world_size - span))
    sharding = Sharding("row_wise", first, span) if span < world_size else Sharding("row_wise")
    ranges = [sharding.row_range(r, rows, world_size) for r in range(world_size)]
    held = [r for r in ranges[first:first + span]]
    assert held[0][0] == 0 and held[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(held, held[1:]))
    assert all(start == end for r, (start, end) in enumerate(ranges) if not first <= r < first + span)
    assert sharding.holders(rows, world_size) == [r for r, (start, end) in enumerate(ranges) if end > start]
    owners = sharding.owner_of(torch.arange(rows), rows, world_size)
    for r, (lo, hi) in enumerate(ranges):
        assert bool((owners[lo:hi] == r).all())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), rows=st.integers(1, 60), world_size=st.integers(1, 5), hashed=st.booleans())
def test_dedup_sends_each_owner_its_distinct_ids_and_every_id_its_position(n, rows, world_size, hashed):
    ids = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(n * 61 + rows))
    sharding = Sharding("hash_row_wise") if hashed else Sharding("row_wise")
    if hashed:
        ids = ids * 7919 - (1 << 40)  # raw keys, negative too
    owners = sharding.owner_of(ids, rows, world_size)
    order = torch.argsort(owners, stable=True)
    ids, owners = ids[order], owners[order]
    sent = torch.bincount(owners, minlength=world_size)
    keys, positions, key_counts = _dedup(ids, owners, sent, True, None if hashed else rows)
    if positions is None:  # not fewer bytes: the ids go as they are
        assert 2 * ids.unique().numel() >= n and torch.equal(keys, ids) and torch.equal(key_counts, sent)
        return
    key_owners = sharding.owner_of(keys, rows, world_size)
    assert torch.equal(torch.bincount(key_owners, minlength=world_size), key_counts)
    assert bool((key_owners[:-1] <= key_owners[1:]).all()) and keys.unique().numel() == keys.numel()
    starts = torch.cumsum(key_counts, 0) - key_counts
    assert bool((positions >= 0).all()) and bool((positions < key_counts[owners]).all())
    assert torch.equal(keys[positions + starts[owners]], ids)


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
    with pytest.raises(ValueError, match="table 'far': sharding table_wise@3 needs ranks up to 3, the process group"):
        ShardedEmbeddingBag.from_module("far", nn.EmbeddingBag(10, 4), Sharding("table_wise", 3))
    with pytest.raises(ValueError, match="table 'clicks': per_sample_weights need mode 'sum'.*no gradient"):
        table(torch.tensor([1, 2]), torch.tensor([0]), torch.rand(2, requires_grad=True))
    mean = ShardedEmbeddingBag.from_module("avg", nn.EmbeddingBag(10, 4, mode="mean"), Sharding("row_wise"))
    with pytest.raises(ValueError, match="table 'avg': per_sample_weights need mode 'sum' \\(the table's is 'mean'\\)"):
        mean(torch.tensor([1, 2]), torch.tensor([0]), torch.rand(2))


def test_table_specs_of_a_dlrm():
    specs = table_specs(DLRM(DLRMConfig(table_rows=[10, 20])), pooling=2.0)
    assert [(s.name, s.rows, s.dim, s.pooling) for s in specs] == [("embeddings.0", 10, 16, 2.0),
                                                                    ("embeddings.1", 20, 16, 2.0)]


def test_launch_adds_a_standalone_rendezvous_unless_given_one():
    assert torchrun_args(["--nproc-per-node=2", "-m", "models.train"])[0] == "--standalone"
    argv = ["--nnodes=2", "--rdzv-endpoint=host:29400", "train.py"]
    assert torchrun_args(argv) == argv


def test_owner_pooling_is_one_grouped_lookup_under_rec_ascend():
    """The owner side of a round (all local tables) is captured as one grouped op by the embedding pass, and the
    model with its lookups compiled by rec_ascend trains like the plain model."""
    cfg = DLRMConfig(num_dense=4, table_rows=[30, 20, 50], dim=4, bottom=[8, 4], top=[8, 1])
    torch.manual_seed(0)
    ref = DLRM(cfg)
    torch.manual_seed(0)
    model = DLRM(cfg)
    model = distribute(model, features=ctr_features(model))
    rounds = []
    for table in model.embeddings:
        table.lookup_fn = lambda *args: rounds.append(args) or pool_local(*args)
    batch = synthetic_batch(cfg, 8)
    model(*batch)
    assert len(rounds) == 1 and len(rounds[0][1]) == 3
    report = recompile.explain(pool_local, *rounds[0]).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert region["op"] == "recompile::grouped_embedding_bag" and len(region["replaced"]) == 4  # 3 lookups, the cat
    compile_lookups(model)
    out, want = model(*batch), ref(*batch)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    for got, expected in zip(model.embeddings, ref.embeddings):
        torch.testing.assert_close(got.weight.grad, expected.weight.grad)
