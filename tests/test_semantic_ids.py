"""models.semantic_ids: RQ-KMeans semantic IDs are deterministic, unique per item, and refine with levels."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.semantic_ids import collision_level, rq_kmeans


def _embeddings(n=300, d=16, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def test_deterministic_with_a_seed():
    x = _embeddings()
    a, b = rq_kmeans(x, 3, 8, seed=5), rq_kmeans(x, 3, 8, seed=5)
    assert torch.equal(a.codes, b.codes)
    assert all(torch.equal(p, q) for p, q in zip(a.centroids, b.centroids))


def test_every_item_gets_a_unique_code_tuple_through_the_collision_level():
    sid = rq_kmeans(_embeddings(), 2, 4, seed=0)  # 16 tuples for 300 items: collisions certain
    assert sid.collision_rate > 0 and sid.num_levels == 3
    assert len(torch.unique(sid.codes, dim=0)) == len(sid.codes)
    assert all(int(sid.codes[:, l].max()) < size for l, size in enumerate(sid.codebook_sizes))
    assert sid.codes.min() >= 0


def test_no_collision_level_when_the_codes_are_unique_already():
    x = torch.eye(8) * 10
    sid = rq_kmeans(x, 1, 8, seed=0)
    assert sid.num_levels == 1 and sid.collision_rate == 0.0
    assert sid.utilisation() == [1.0]


def test_reconstruction_error_decreases_with_levels():
    x = _embeddings()
    sid = rq_kmeans(x, 4, 16, seed=1)
    errors = [float(x.square().sum(1).mean())] + sid.reconstruction_errors
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    recon = sum(c[sid.codes[:, l]] for l, c in enumerate(sid.centroids))
    torch.testing.assert_close(float((x - recon).square().sum(1).mean()), sid.reconstruction_errors[-1],
                               rtol=1e-4, atol=1e-5)
    report = sid.report()
    assert len(report["utilisation"]) == sid.num_levels and 0 < min(report["utilisation"]) <= 1


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_collision_level_numbers_items_within_their_group(groups):
    codes = torch.tensor(groups).unsqueeze(1)
    index = collision_level(codes)
    seen = {}
    for g, i in zip(groups, index.tolist()):
        assert i == seen.get(g, 0)
        seen[g] = i + 1


def test_bad_input_names_the_argument():
    import pytest
    with pytest.raises(ValueError, match="embeddings"):
        rq_kmeans(torch.randn(0, 4), 2, 4)
    with pytest.raises(ValueError, match="codebook_size"):
        rq_kmeans(torch.randn(5, 4), 2, 0)
