"""The dynamic_embedding pass: hkv lookups under torch.compile(backend="rec_ascend")."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import hkv
import recompile

DIM = 4
POOL = torch.tensor([1, 5, 2**40 + 7, 2**62 + 1, 33, 77, 1000, 123456789012])


class Model(nn.Module):
    """Two sparse features sharing one table, one feature with its own table, one unpooled sequence."""

    def __init__(self, optimizer):
        super().__init__()
        opts = dict(dim=DIM, max_capacity=512, init_capacity=64, bucket_capacity=16)
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


def make_model(optimizer):
    torch.manual_seed(0)
    model = Model(optimizer)
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
