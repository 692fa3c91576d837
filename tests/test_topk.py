"""Blocked top-k retrieval (models/retrieval_serving.py): equal to torch.topk on the full score matrix (values;
indices up to ties at the k-th value), with heavy ties, blocks that do not divide the corpus, k = corpus; the
dot and MoL heads through ItemIndex; the MoL shortlist's recall measured, and exact with a full shortlist."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.retrieval import TwoTower, TwoTowerConfig
from models.retrieval_serving import ItemIndex, blocked_topk, matmul_scores, recall


def check_equals_full_topk(scores, values, indices, k):
    want = scores.topk(k, dim=1)
    torch.testing.assert_close(values, want.values, rtol=0, atol=0)
    assert torch.equal(scores.gather(1, indices), values)  # each index carries its value
    assert all(row.unique().numel() == k for row in indices)
    untied = values > want.values[:, -1:]  # above the k-th value the items are determined
    assert torch.equal(torch.where(untied, indices, 0).sort(1).values,
                       torch.where(want.values > want.values[:, -1:], want.indices, 0).sort(1).values)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 4), n=st.integers(1, 300), dim=st.integers(1, 8), block=st.integers(1, 64),
       ties=st.booleans(), data=st.data())
def test_blocked_topk_equals_full_topk(batch, n, dim, block, ties, data):
    k = data.draw(st.integers(1, n))
    g = torch.Generator().manual_seed(n * 31 + dim)
    queries, items = torch.randn(batch, dim, generator=g), torch.randn(n, dim, generator=g)
    if ties:  # small integers: many exactly equal scores
        queries, items = queries.round().clamp(-1, 1), items.round().clamp(-1, 1)
    scores = queries @ items.t()
    values, indices = blocked_topk(lambda start, stop: scores[:, start:stop], n, k, block)
    check_equals_full_topk(scores, values, indices, k)
    # sorted by score, then by index
    same = values[:, 1:] == values[:, :-1]
    assert bool((indices[:, 1:] > indices[:, :-1])[same].all()) and bool((values[:, 1:] <= values[:, :-1]).all())


def test_matmul_blocks_equal_the_full_matmul_to_rounding():
    """A block's matmul may round differently from the full one (another kernel for another shape)."""
    g = torch.Generator().manual_seed(0)
    queries, items = torch.randn(3, 16, generator=g), torch.randn(1000, 16, generator=g)
    values, indices = blocked_topk(matmul_scores(queries, items, 2.0), 1000, 50, block=96)
    want = (2.0 * queries @ items.t()).topk(50, dim=1)
    torch.testing.assert_close(values, want.values, rtol=1e-5, atol=1e-5)
    assert recall(indices, want.indices) == 1.0


def test_bad_k_is_named():
    with pytest.raises(ValueError, match="k must be in"):
        blocked_topk(matmul_scores(torch.randn(1, 2), torch.randn(5, 2)), 5, 6)


def two_tower(head):
    torch.manual_seed(0)
    return TwoTower(TwoTowerConfig(num_users=20, num_items=500, dim=16, tower=[32, 16], head=head)).eval()


def user_inputs():
    users = torch.tensor([1, 5, 7])
    history, offsets = torch.tensor([3, 4, 9, 10, 11, 2]), torch.tensor([0, 2, 5])
    return users, history, offsets


@pytest.mark.parametrize("head", ["dot", "mol"])
def test_item_index_equals_the_model_on_every_item(head):
    model = two_tower(head)
    index = ItemIndex(model, block=64)
    with torch.no_grad():
        full = model(*user_inputs(), torch.arange(1, 501))
    values, ids = index.topk(*user_inputs(), k=20)
    torch.testing.assert_close(values, full.topk(20, dim=1).values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.gather(1, ids - 1), values, rtol=1e-5, atol=1e-5)


def test_mol_shortlist_recall():
    model = two_tower("mol")
    index = ItemIndex(model, block=64)
    _, exact = index.topk(*user_inputs(), k=20)
    _, everything = index.topk(*user_inputs(), k=20, shortlist=500)
    assert recall(everything, exact) == 1.0  # a shortlist of the whole corpus loses nothing
    _, short = index.topk(*user_inputs(), k=20, shortlist=100)
    assert 0.0 <= recall(short, exact) <= 1.0
    assert recall(exact[:, :10], exact) == 0.5
