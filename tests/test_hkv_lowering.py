"""The dynamic_embedding pass: hkv lookups under torch.compile(backend="rec_ascend")."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import hkv
import recompile

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

DIM = 4
POOL = torch.tensor([1, 5, 2**40 + 7, 2**62 + 1, 33, 77, 1000, 123456789012])


class Model(nn.Module):
    """Two sparse features sharing one table, one feature with its own table, one unpooled sequence."""

    def __init__(self, optimizer, **options):
        super().__init__()
        opts = dict(dim=DIM, max_capacity=512, init_capacity=64, bucket_capacity=16, **options)
        # Eager applies one optimizer step per call, the lowered graph one per table per batch: the two
        # agree for SGD only, so the shared table uses SGD.
        self.shared = hkv.DynamicEmbeddingBag(hkv.DynamicEmbTableOptions(**opts), "sum", hkv.SGD(0.05))
        self.own = hkv.DynamicEmbeddingBag(hkv.DynamicEmbTableOptions(**opts), "mean", optimizer)
        self.seq = hkv.DynamicEmbedding(hkv.DynamicEmbTableOptions(**opts), optimizer)
        self.top = nn.Linear(3 * DIM, 1)

    def forward(self, a, a_off, b, b_off, c, c_off, s):
        seq = self.seq(s).sum(0, keepdim=True).expand(a_off.shape[0], -1)
        x = torch.cat([self.shared(a, a_off) + self.shared(b, b_off), self.own(c, c_off), seq], 1)
        return self.top(x).squeeze(1)

    def tables(self):
        return [self.shared, self.own, self.seq]


def make_model(optimizer, **options):
    torch.manual_seed(0)
    model = Model(optimizer, **options)
    for emb in model.tables():
        emb.table.find_or_insert(POOL, init=emb.runtime._init_rows)
    return model


def batch(bags, gen):
    out = []
    for _ in range(3):
        lengths = torch.randint(0, 4, (bags,), generator=gen)
        ids = POOL[torch.randint(0, len(POOL), (int(lengths.sum()),), generator=gen)]
        out += [ids, torch.cumsum(lengths, 0) - lengths]
    return (*out, POOL[torch.randint(0, len(POOL), (5,), generator=gen)])


def rows(model):
    return [emb.table.find(POOL)[0] for emb in model.tables()]


@pytest.mark.parametrize("offload", ["partial", "full"])
def test_compiled_training_matches_eager(offload):
    eager, compiled_model = make_model(hkv.Adagrad(0.1)), make_model(hkv.Adagrad(0.1))
    compiled = torch.compile(compiled_model, backend="rec_ascend", options={"offload": offload})
    gen = torch.Generator().manual_seed(1)
    opt_e = torch.optim.SGD(eager.top.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_model.top.parameters(), lr=0.1)
    for step, bags in enumerate((6, 9, 13)):
        args = batch(bags, gen)
        out_e, out_c = eager(*args), compiled(*args)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
        for out, opt in ((out_e, opt_e), (out_c, opt_c)):
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
        for r_c, r_e in zip(rows(compiled_model), rows(eager)):
            torch.testing.assert_close(r_c, r_e, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_regions_dedup_once_per_table_and_compile_count():
    model = make_model(hkv.SGD(0.1))
    gen = torch.Generator().manual_seed(2)
    report = recompile.explain(model, *batch(4, gen)).to_dict()
    regions = [r for r in report["regions"] if r["kind"] == "dynamic_embedding"]
    assert len(regions) == 4 and all(r["op"] == "hkv::lookup" for r in regions)
    final = [s for s in report["stages"] if s["name"] == "dynamic_embedding"][0]["code"]
    assert final.count("hkv.unique") == 3 and final.count("hkv.lookup") == 3 and "embedding_lookup" not in final
    assert "torch.cat([l_a_, l_b_])" in final  # the two features of the shared table are deduplicated together
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for bags in (3, 5, 8, 13, 21):
        compiled(*batch(bags, gen)).sum().backward()
    assert counter.frame_count <= 2


def test_compiled_eval_never_inserts():
    model = make_model(hkv.SGD(0.1)).eval()
    compiled = torch.compile(model, backend="rec_ascend")
    sizes = [emb.table.size() for emb in model.tables()]
    gen = torch.Generator().manual_seed(3)
    args = list(batch(4, gen))
    args[0] = args[0] + 10**15  # unseen ids: eval gives them zeros and stores nothing
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args))
    assert [emb.table.size() for emb in model.tables()] == sizes


def test_pass_disabled_keeps_opaque_op():
    model = make_model(hkv.SGD(0.1))
    gen = torch.Generator().manual_seed(4)
    report = recompile.explain(model, *batch(4, gen), options={"passes": {"dynamic_embedding": False}}).to_dict()
    assert not [r for r in report["regions"] if r["kind"] == "dynamic_embedding"]


def test_plans_pick_kernel_per_target():
    model = make_model(hkv.SGD(0.1))
    args = batch(4, torch.Generator().manual_seed(5))
    for target, impl in (("npu", "triton"), ("cpu", "cpu")):
        regions = recompile.explain(model, *args, options={"target": target}).to_dict()["regions"]
        assert {r["impl"] for r in regions if r["kind"] == "dynamic_embedding"} == {impl}, target


@pytest.mark.parametrize("offload", ["partial", "full"])
def test_partial_offload_buckets_ids_on_the_host(offload, monkeypatch):
    """partial: hkv.unique groups each table's unique ids by bucket on the host and the lookup takes
    them grouped (the bucket count reaches find_or_insert); full: nothing is grouped."""
    model = make_model(hkv.SGD(0.1))
    seen = []
    find_or_insert = hkv.HashTable.find_or_insert

    def spy(table, keys, init=None, scores=None, grouping=0):
        seen.append((table.num_buckets(), grouping, keys.clone()))
        return find_or_insert(table, keys, init, scores, grouping)

    monkeypatch.setattr(hkv.HashTable, "find_or_insert", spy)
    compiled = torch.compile(model, backend="rec_ascend", options={"offload": offload})
    args = batch(6, torch.Generator().manual_seed(6))
    compiled(*args).sum().backward()
    assert len(seen) == 3
    for num_buckets, grouping, keys in seen:
        assert grouping == (num_buckets if offload == "partial" else 0)
        if offload == "partial":
            buckets = hkv.table.mix64(keys) & (num_buckets - 1)
            assert bool((buckets[1:] >= buckets[:-1]).all())


@pytest.mark.parametrize("offload", [pytest.param("partial", marks=pytest.mark.slow), "full"])
def test_prefetch_with_compiled_model_trains_identically(offload):
    """hkv.Prefetcher inserts the next batch's new ids while the compiled model trains on the current
    one; training with and without it gives the same outputs and tables (constant initialiser: the
    rows new ids start from do not depend on when they are inserted)."""
    const = hkv.DynamicEmbInitializerArgs(mode=hkv.DynamicEmbInitializerMode.CONSTANT, value=0.1)
    gen = torch.Generator().manual_seed(8)
    data = []
    for step in range(4):  # a few never-seen ids in every batch
        a, a_off, b, b_off, c, c_off, s = batch(5 + step, gen)
        data.append((a + 10**12 * (step % 2), a_off, b, b_off, c + 10**13 * step, c_off, s + 10**14))
    results = []
    for prefetch in (False, True):
        model = make_model(hkv.SGD(0.1), initializer_args=const)
        compiled = torch.compile(model, backend="rec_ascend", options={"offload": offload})
        opt = torch.optim.SGD(model.top.parameters(), lr=0.1)

        def ids_of(args):
            return [(model.shared, args[0]), (model.shared, args[2]), (model.own, args[4]), (model.seq, args[6])]

        outs = []
        for args in hkv.Prefetcher(data, ids_of) if prefetch else data:
            if prefetch:
                assert all(bool(emb.table.contains(ids).all()) for emb, ids in ids_of(args))
            opt.zero_grad()
            out = compiled(*args)
            out.pow(2).mean().backward()
            opt.step()
            outs.append(out.detach())
        keys = torch.cat([args[i] for args in data for i in (0, 2, 4, 6)])
        results.append((outs, [emb.table.find(keys)[0] for emb in model.tables()]))
    for got, want in zip(results[1], results[0]):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
