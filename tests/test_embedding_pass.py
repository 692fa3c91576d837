"""The embedding pass: lookups grouped into one grouped_embedding_bag, numbers equal to eager."""
import copy
import functools

import numpy as np

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from checks import assert_compiled_equals_eager
from models.dlrm import DLRM, DLRMConfig, synthetic_batch

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

SMALL = DLRMConfig(table_rows=[50, 80, 120, 30], dim=8, bottom=[16, 8], top=[16, 1])


def _embedding_stage(report):
    return next(s["code"] for s in report["stages"] if s["name"] == "embedding")


def test_dlrm_lookups_become_one_stacked_call_and_cat():
    model, args = DLRM(SMALL), synthetic_batch(SMALL, 16)
    report = recompile.explain(model, *args).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert region["op"] == "recompile::grouped_embedding_bag" and len(region["replaced"]) == 5  # 4 lookups, the stack
    code = _embedding_stage(report)
    assert code.count("torch.ops.recompile.grouped_embedding_bag.default(") == 1 and "'stack'" in code
    assert "torch.stack" not in code and "functional.embedding_bag(" not in code
    assert "torch.cat([unsqueeze, grouped_embedding_bag" in code
    assert_compiled_equals_eager(model, args)


class Forms(nn.Module):
    """Every grouped input form feeding one cat (concat layout), mixed dims."""

    def __init__(self):
        super().__init__()
        self.bag_2d = nn.EmbeddingBag(20, 4, mode="mean")
        self.bag_last = nn.EmbeddingBag(15, 6, mode="sum", include_last_offset=True, padding_idx=0)
        self.bag_weighted = nn.EmbeddingBag(10, 3, mode="sum")
        self.table = nn.Embedding(12, 5)
        self.table_mean = nn.Embedding(9, 2)

    def forward(self, ids2d, ids, offsets, psw):
        return torch.cat(
            [
                self.bag_2d(ids2d),
                self.bag_last(ids, offsets),
                self.bag_weighted(ids % 10, offsets[:-1], per_sample_weights=psw),
                self.table(ids2d % 12).sum(1),
                self.table_mean(ids2d % 9).mean(dim=1),
            ],
            dim=1,
        )


def _forms_args(batch):
    lengths = torch.randint(0, 4, (batch,))
    ids = torch.randint(0, 15, (int(lengths.sum()),))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.randint(0, 20, (batch, 3)), ids, offsets, torch.rand(ids.shape)


def test_every_form_grouped_into_concat_layout():
    model, args = Forms(), _forms_args(6)
    report = recompile.explain(model, *args).to_dict()
    (region,) = report["regions"]
    assert len(region["replaced"]) == 8  # five lookups, two of them embedding + reduction, and the cat
    code = _embedding_stage(report)
    assert "'concat'" in code and "torch.cat" not in code
    assert_compiled_equals_eager(model, args)


class LeftAlone(nn.Module):
    def __init__(self):
        super().__init__()
        self.maxed = nn.EmbeddingBag(10, 4, mode="max")
        self.normed = nn.EmbeddingBag(10, 4, max_norm=1.0)
        self.a = nn.EmbeddingBag(10, 4)
        self.b = nn.EmbeddingBag(10, 4)

    def forward(self, ids):
        grouped = torch.stack([self.a(ids), self.b(ids)], 1)
        return self.maxed(ids) + self.normed(ids), self.a.weight.sum() + grouped.sum()


def test_unprovable_lookups_stay_and_are_reported():
    model, ids = LeftAlone(), torch.randint(0, 10, (5, 3))
    report = recompile.explain(model, ids).to_dict()
    reasons = " ".join(f["reason"] for f in report["fallbacks"])
    assert "mode 'max'" in reasons and "max_norm" in reasons
    assert len(report["regions"]) == 1
    with torch.no_grad():
        got = torch.compile(copy.deepcopy(model), backend="rec_ascend")  # max_norm renormalises rows in place
        for g, w in zip(got(ids), model(ids)):
            torch.testing.assert_close(g, w)


def test_out_of_range_id_names_the_table():
    model, (dense, indices, offsets) = DLRM(SMALL), synthetic_batch(SMALL, 8)
    indices[2] = indices[2].clone()
    indices[2][1] = 500
    with pytest.raises(Exception, match=r"feature 'embeddings.2': id 500 is out of range for its table of 120 rows"):
        torch.compile(model, backend="rec_ascend")(dense, indices, offsets)


@pytest.mark.slow  # tests/test_foundation.py::test_batch_size_changes_compile_at_most_twice in make test
def test_batch_size_changes_compile_at_most_twice():
    model = DLRM(SMALL)
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for batch in (8, 13, 21, 34):
        args = synthetic_batch(SMALL, batch)
        out = compiled(*args)
        torch.testing.assert_close(out, model(*args), rtol=1e-5, atol=1e-6)
        out.sum().backward()
    assert counter.frame_count <= 2


@pytest.mark.parametrize("target, kind", [("cpu", "cpu_kernel"), ("npu", "triton"), ("cuda", "triton")])
def test_lowering_plan_per_target(target, kind):
    report = recompile.explain(DLRM(SMALL), *synthetic_batch(SMALL, 4), options={"target": target}).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert region["kernel_kind"] == kind and region["target"] == target


def test_sparse_tables_get_sparse_gradients_equal_to_eager():
    model = DLRM(SMALL)
    for emb in model.embeddings:
        emb.sparse = True
    eager, args = copy.deepcopy(model), synthetic_batch(SMALL, 8)
    torch.compile(model, backend="rec_ascend")(*args).sum().backward()
    eager(*args).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad.is_sparse == q.grad.is_sparse, name
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), msg=name)


class FieldLookups(nn.Module):
    """RecBole's ContextRecommender written small: ``FMEmbedding`` (every field's id plus its field's offset, a NumPy
    array, looked up in one table) feeding an FM, then ``FMFirstOrderLinear`` (the same ids and offsets, another
    array, in a width-1 table, summed over the fields with keepdim, plus a bias). The second-order lookup is used
    before the first-order ids are made, as in RecBole's graph."""

    def __init__(self, field_dims=(7, 5, 11), dim=4, sparse=False, padding_idx=None):
        super().__init__()
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        self.first_offsets = self.offsets.copy()
        self.embedding = nn.Embedding(sum(field_dims), dim, sparse=sparse, padding_idx=padding_idx)
        self.first = nn.Embedding(sum(field_dims), 1, sparse=sparse)
        self.bias = nn.Parameter(torch.randn(1))

    def forward(self, *fields):
        ids = torch.cat([f.unsqueeze(1) for f in fields], dim=1)
        v = self.embedding(ids + ids.new_tensor(self.offsets).unsqueeze(0))  # [B, F, D]
        fm = 0.5 * (v.sum(1) ** 2 - (v ** 2).sum(1)).sum(1, keepdim=True)
        first_ids = torch.cat([f.unsqueeze(1) for f in fields], dim=1)
        first = self.first(first_ids + first_ids.new_tensor(self.first_offsets).unsqueeze(0))
        return torch.sigmoid((torch.sum(first, dim=1, keepdim=True).sum(1) + self.bias + fm).squeeze(-1))


def _fields(batch, dims=(7, 5, 11), dtype=torch.int64):
    return tuple(torch.randint(0, n, (batch,), dtype=dtype) for n in dims)


NO_RACE = {"autotune": False}  # the rewrite is what runs, so it is what is compared


def test_field_lookups_become_one_concat_call_reading_both_tables():
    report = recompile.explain(FieldLookups(), *_fields(6)).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert region["op"] == "recompile::grouped_embedding_bag" and len(region["replaced"]) == 2  # both F.embedding
    code = _embedding_stage(report)
    assert code.count("torch.ops.recompile.grouped_embedding_bag.default(") == 1 and "'concat'" in code
    assert "functional.embedding(" not in code


def test_field_lookups_numbers_and_gradients_equal_eager():
    assert_compiled_equals_eager(FieldLookups(), _fields(9), options=NO_RACE)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_field_lookups_with_int32_ids_equal_eager_exactly(table_dtype):
    """A bag of one id is its row: equal to eager's bit for bit, gradients too (through AOT autograd run eagerly,
    no Inductor compile)."""
    from models.corpus.harness import rec_passes_aot_eager

    model = FieldLookups().to(table_dtype)
    eager, args = copy.deepcopy(model), _fields(7, dtype=torch.int32)
    lookups_only = functools.partial(rec_passes_aot_eager, options={"passes": {"interaction": False}})  # FM as written
    compiled = torch.compile(model, backend=lookups_only)
    got, want = compiled(*args), eager(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_sparse_field_tables_get_sparse_gradients_equal_to_eager():
    """Through AOT autograd run eagerly (Inductor does not compile a graph producing sparse gradients: the race
    rejects it, and the rewrite runs eagerly)."""
    from models.corpus.harness import rec_passes_aot_eager

    model = FieldLookups(sparse=True)
    eager, args = copy.deepcopy(model), _fields(8)
    torch.compile(model, backend=rec_passes_aot_eager)(*args).sum().backward()
    eager(*args).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad.is_sparse == q.grad.is_sparse, name
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), msg=name)


def test_field_lookups_compile_at_most_twice_over_batch_sizes():
    model = FieldLookups()
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for batch in (8, 13, 21):
        args = _fields(batch)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2


def test_field_table_with_padding_idx_is_left_alone_and_reported():
    model, args = FieldLookups(padding_idx=0), _fields(5)
    report = recompile.explain(model, *args).to_dict()
    assert not [r for r in report["regions"] if r["kind"] == "embedding"]
    assert any("padding_idx row is read forward" in f["reason"] for f in report["fallbacks"])
    assert_compiled_equals_eager(model, args, options=NO_RACE)


class IdsFromALookup(nn.Module):
    """The second lookup's ids are made from the first lookup's values, after its first use: no group."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(10, 4), nn.Embedding(10, 2)

    def forward(self, ids):
        v = self.a(ids)
        used = v.sum()
        return used + self.b((v.argmax(-1) + ids) % 10).sum()


def test_field_lookup_whose_ids_come_from_another_is_left_alone():
    model, ids = IdsFromALookup(), torch.randint(0, 10, (5, 3))
    report = recompile.explain(model, ids).to_dict()
    assert not [r for r in report["regions"] if r["kind"] == "embedding"]
    assert any("from a lookup" in f["reason"] for f in report["fallbacks"])


def test_field_lookups_of_an_empty_batch_equal_eager():
    from models.corpus.harness import rec_passes_aot_eager

    model = FieldLookups()
    args = _fields(0)
    torch.testing.assert_close(torch.compile(model, backend=rec_passes_aot_eager)(*args), model(*args))
