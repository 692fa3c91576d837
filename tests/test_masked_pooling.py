"""Masked pooling over a padded nn.Embedding lookup (RecBole's embed_token_seq_fields and the usual spellings)
rewritten by the embedding pass into a SUM grouped_embedding_bag with padding_idx: outputs and table gradients
equal eager's, all-padding rows included; what is not such a pooling is left alone."""
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recompile
from checks import train_step
from models.corpus.harness import rec_passes_aot_eager

OP = "recompile::grouped_embedding_bag"
NO_AUTOTUNE = {"autotune": False}  # the rewritten graph is what runs


def recbole_mean(emb, ids):
    """ContextRecommender.embed_token_seq_fields, mode="mean", as RecBole 1.2.1 writes it."""
    mask = ids != 0
    mask = mask.float()
    value_cnt = torch.sum(mask, dim=1, keepdim=True)
    mask = mask.unsqueeze(2).expand_as(emb)
    result = torch.sum(emb * mask.float(), dim=1)
    eps = torch.FloatTensor([1e-8]).to(emb.device)
    return torch.div(result, value_cnt + eps).unsqueeze(1)


def recbole_sum(emb, ids):
    """The same, mode="sum" (keepdim)."""
    mask = (ids != 0).float().unsqueeze(2).expand_as(emb)
    return torch.sum(emb * mask.float(), dim=1, keepdim=True)


def clamp_mean(emb, ids):
    mask = ids != 0
    return (emb * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)


def masked_fill_sum(emb, ids):
    return emb.masked_fill((ids == 0).unsqueeze(-1), 0.0).sum(dim=-2)


def negated_mask_sum(emb, ids):
    keep = ~(ids == 0)
    return torch.sum(emb * keep[..., None].type_as(emb), 1)


def where_mean(emb, ids):
    keep = ids.ne(0)
    return torch.where(keep.unsqueeze(2), emb, 0.0).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)


SPELLINGS = [recbole_mean, recbole_sum, clamp_mean, masked_fill_sum, negated_mask_sum, where_mean]


class Pooled(nn.Module):
    def __init__(self, pool, rows=40, dim=8, dtype=torch.float32, padding_idx=None):
        super().__init__()
        self.pool = pool
        self.table = nn.Embedding(rows, dim, padding_idx=padding_idx, dtype=dtype)

    def forward(self, ids):
        return self.pool(self.table(ids), ids)


def padded_ids(batch, length, rows=40, dtype=torch.int64, seed=0):
    """Random ids with about a third padding (0), the first row all padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, rows, (batch, length), generator=g)
    ids = ids.masked_fill(torch.rand(batch, length, generator=g) < 0.35, 0)
    ids[0] = 0
    return ids.to(dtype)


def regions(model, *args):
    report = recompile.explain(model, *args, options=NO_AUTOTUNE).to_dict()
    return [r for r in report["regions"] if r["kind"] == "embedding"], report


def assert_matches_eager(model, args, backend=rec_passes_aot_eager, rtol=1e-5, atol=1e-6):
    """Forward and every gradient of the compiled model against eager (1e-5 outputs, 1e-4 gradients)."""
    compiled = torch.compile(model, backend=lambda gm, inputs: backend(gm, inputs, options=NO_AUTOTUNE))
    out_c, grads_c = train_step(compiled, args)
    out_e, grads_e = train_step(model, args)
    torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=max(rtol, 1e-4), atol=atol, msg=name)


@pytest.mark.parametrize("pool", SPELLINGS, ids=lambda f: f.__name__)
def test_spelling_becomes_one_bag_equal_to_eager(pool):
    model, ids = Pooled(pool), padded_ids(9, 6)
    (region,), report = regions(model, ids)
    assert region["op"] == OP and len(region["replaced"]) == 3  # the sum, the masked product, the lookup
    code = next(s["code"] for s in report["stages"] if s["name"] == "embedding")
    assert "functional.embedding(" not in code and "[0], [0], [False]" in code  # SUM, padding_idx 0, 2-D ids
    assert_matches_eager(model, (ids,))


@pytest.mark.parametrize("shape", [(1, 5), (6, 1), (4, 3)], ids=["single-row", "length-1", "all-padding"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_edge_batches_and_id_dtypes(shape, dtype):
    ids = padded_ids(*shape, dtype=dtype, seed=shape[0])
    if shape == (4, 3):
        ids.zero_()  # every row padding: RecBole's 0 / (0 + 1e-8) and clamp's 0 / 1 are 0, gradients 0
    for pool in (recbole_mean, clamp_mean):
        model = Pooled(pool)
        assert len(regions(model, ids)[0]) == 1
        assert_matches_eager(model, (ids,))


def test_table_padding_idx_equal_to_the_mask_id():
    model, ids = Pooled(clamp_mean, padding_idx=0), padded_ids(7, 5)
    assert len(regions(model, ids)[0]) == 1
    assert_matches_eager(model, (ids,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tables_against_the_reference(dtype):
    """fp16/bf16 tables (a mask cast to the table's dtype): the compiled pooling against the op's reference."""
    from recompile.runtime.embedding import SUM, grouped_embedding_bag_reference

    model, ids = Pooled(negated_mask_sum, dtype=dtype), padded_ids(8, 7)
    assert len(regions(model, ids)[0]) == 1
    compiled = torch.compile(model, backend=lambda gm, inputs: rec_passes_aot_eager(gm, inputs, options=NO_AUTOTUNE))
    w = model.table.weight
    want = grouped_embedding_bag_reference([w], [ids], [None], [None], [SUM], [0], [False], "concat", ["table"])
    tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(compiled(ids), want, rtol=tol, atol=tol)
    torch.testing.assert_close(want, model(ids), rtol=tol, atol=tol)
    compiled(ids).float().sum().backward()
    expected = torch.zeros(w.shape).index_add_(0, ids[ids != 0], torch.ones(int((ids != 0).sum()), w.shape[1]))
    torch.testing.assert_close(w.grad.float(), expected)


def test_promoting_mask_is_left_alone():
    """A float32 mask on an fp16 table sums in float32: a bag would round the sum to fp16."""
    model, ids = Pooled(recbole_sum, dtype=torch.float16), padded_ids(5, 4)
    found, report = regions(model, ids)
    assert not found and "promotes the table's dtype" in str(report["fallbacks"])


def test_grouped_with_a_neighbouring_bag():
    class WithBag(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.table = nn.EmbeddingBag(30, 4, mode="sum"), nn.Embedding(40, 8)

        def forward(self, ids2d, seq):
            return torch.cat([self.bag(ids2d), masked_fill_sum(self.table(seq), seq)], dim=1)

    model, args = WithBag(), (torch.randint(0, 30, (6, 3)), padded_ids(6, 5))
    (region,), _ = regions(model, *args)
    assert len(region["replaced"]) == 5  # the bag, the masked sum, its product and lookup, and the cat
    assert_matches_eager(model, args)


class TwoPoolings(nn.Module):
    """RecBole's FM: the genre list pooled by the FM's table (mean) and by the first-order table (sum, keepdim);
    a third list of another batch size cannot share their call."""

    def __init__(self):
        super().__init__()
        self.table, self.first_order, self.other = nn.Embedding(40, 8), nn.Embedding(40, 1), nn.Embedding(40, 8)

    def forward(self, ids, other_ids):
        fm = recbole_mean(self.table(ids), ids)
        linear = recbole_sum(self.first_order(ids), ids)
        return torch.cat([(fm + linear).flatten(), clamp_mean(self.other(other_ids), other_ids).flatten()])


def test_poolings_of_one_batch_share_a_call():
    model, args = TwoPoolings(), (padded_ids(6, 4), padded_ids(9, 3, seed=1))
    found, report = regions(model, *args)
    assert sorted(len(r["replaced"]) for r in found) == [3, 6]  # (sum, product, lookup) per pooling
    assert "torch.narrow(" in next(s["code"] for s in report["stages"] if s["name"] == "embedding")
    assert_matches_eager(model, args)


def recording_backend():
    """rec_ascend's passes then AOT eager, recording each compiled graph's regions (kind, op)."""
    from recompile.backend import resolve_target
    from recompile.options import RecompileOptions
    from recompile.pipeline import PassContext, run_pipeline
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def backend(gm, inputs):
        options = RecompileOptions.coerce(NO_AUTOTUNE)
        ctx = PassContext(options, resolve_target(options), inputs)
        rewritten = run_pipeline(gm, ctx)
        graphs.append([(r.kind, r.op) for r in ctx.regions])
        return aot_eager(rewritten, inputs)

    return backend, graphs


def test_compiles_at_most_twice_over_batches_and_lengths():
    """The second batch compiles one dynamic graph (B and L symbolic) that keeps the rewrite and serves the rest."""
    model = Pooled(recbole_mean)
    backend, graphs = recording_backend()
    compiled = torch.compile(model, backend=backend)
    for batch, length in ((8, 5), (13, 7), (21, 3), (5, 9)):
        ids = padded_ids(batch, length, seed=batch)
        out = compiled(ids)
        torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-6)
        out.sum().backward()
    assert len(graphs) <= 2 and all(regions == [("embedding", OP)] for regions in graphs), graphs


@pytest.mark.slow
def test_through_inductor_forward_and_backward():
    model, ids = Pooled(recbole_mean), padded_ids(16, 6)
    from recompile.backend import rec_ascend

    assert_matches_eager(model, (ids,), backend=rec_ascend)


class Other(nn.Module):
    """Poolings that are not ``ids != padding`` over the same ids' lookup."""

    def __init__(self, form):
        super().__init__()
        self.form, self.table = form, nn.Embedding(40, 8, padding_idx=3)

    def forward(self, ids, other, dense):
        emb = self.table(ids)
        if self.form == "other-ids":
            return (emb * (other != 0).unsqueeze(-1)).sum(1)
        if self.form == "greater":
            return (emb * (ids > 0).unsqueeze(-1)).sum(1)
        if self.form == "keeps-padding":
            return (emb * (ids == 0).unsqueeze(-1)).sum(1)
        if self.form == "not-embedding":
            return (dense * (ids != 0).unsqueeze(-1)).sum(1) + emb[:, 0]
        if self.form == "table-padding":  # the table's padding_idx 3 is not the mask's 0
            return (emb * (ids != 0).unsqueeze(-1)).sum(1)
        if self.form == "recbole-max":
            mask = (ids != 0).float().unsqueeze(2).expand_as(emb)
            return torch.max(emb - (1 - mask) * 1e9, dim=1, keepdim=True)[0]
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["other-ids", "greater", "keeps-padding", "not-embedding", "table-padding", "recbole-max"])
def test_not_a_masked_pooling_is_left_alone(form):
    model = Other(form)
    args = (padded_ids(6, 5), padded_ids(6, 5, seed=1), torch.randn(6, 5, 8))
    found, _ = regions(model, *args)
    assert not found
    assert_matches_eager(model, args)


@pytest.fixture(scope="module")
def compiled_recbole_mean():
    model = Pooled(recbole_mean)
    backend, graphs = recording_backend()
    yield model, torch.compile(model, backend=backend, dynamic=True)
    assert graphs and all(regions == [("embedding", OP)] for regions in graphs), graphs


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 12), length=st.integers(1, 9), padding=st.floats(0.0, 1.0),
       dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16))
def test_property_any_padding_equals_eager(compiled_recbole_mean, batch, length, padding, dtype, seed):
    """Any batch, length and share of padding (whole rows of it included), either id dtype: RecBole's masked mean
    compiled equals eager, forward and the table's gradient."""
    model, compiled = compiled_recbole_mean
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (batch, length), generator=g)
    ids = ids.masked_fill(torch.rand(batch, length, generator=g) < padding, 0).to(dtype)
    out_c, grads_c = train_step(compiled, (ids,))
    out_e, grads_e = train_step(model, (ids,))
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_c["table.weight"], grads_e["table.weight"], rtol=1e-4, atol=1e-6)
