"""The native CPU kernel of recompile.hstu_paged_attention (runtime/csrc/paged_attention.h) on every instruction
set this CPU runs: equal to the reference over tiles wider than one block (long prefixes across many pages,
partial last pages, candidate blocks past 32 rows, blocks of up to 128 rows, heads in groups, zero new
rows), strided q/k/v as a fused projection's views give them; the lowering registry picks it on CPU; bad pages are named. And the blocked top-k over int8-quantized
items (runtime/csrc/item_topk.h): exact against torch.topk of the full score matrix."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.retrieval_serving import QuantizedItems
from recompile.lowering import choose, detect_target
from recompile.runtime import jagged_attention_native, native
from tests.test_paged_attention import make_case

pytestmark = pytest.mark.skipif(not jagged_attention_native.available(), reason="the native kernels are not built")
ops = torch.ops.recompile


@pytest.fixture(params=native.available_isas() if jagged_attention_native.available() else ())
def isa(request):
    with native.use_isa(request.param):
        yield request.param


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(users=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=3),
       page_size=st.sampled_from([1, 3, 16, 32]), rel=st.booleans(), time=st.booleans(), seed=st.integers(0, 2**16))
def test_native_equals_reference(isa, users, page_size, rel, time, seed):
    cached, new, targets = [u[0] for u in users], [u[1] for u in users], [min(u[2], u[1]) for u in users]
    args, _ = make_case(cached, new, targets, page_size, rel, time, seed=seed, max_len=200)
    want = ops.hstu_paged_attention(*args, impl="reference")
    torch.testing.assert_close(ops.hstu_paged_attention(*args, impl="native"), want, rtol=1e-5, atol=1e-6)


def test_strided_rows_as_a_fused_projection_gives_them(isa):
    args, _ = make_case([37, 5], [9, 40], [3, 33], 4, max_len=100)
    q, k, v = args[:3]
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)  # [T, H * (2D + Dv)]
    hd = q.shape[1] * q.shape[2]
    views = (fused[:, :hd].view_as(q), fused[:, hd : 2 * hd].view_as(k), fused[:, 2 * hd :].view_as(v))
    assert not views[1].is_contiguous()
    want = ops.hstu_paged_attention(*args, impl="reference")
    torch.testing.assert_close(ops.hstu_paged_attention(*views, *args[3:], impl="native"), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads, cached, new, targets", [
    (1, [150, 3], [300, 140], [170, 7]),  # blocks of 128 rows, history and candidates past one block
    (2, [150, 3], [300, 140], [170, 7]),  # blocks halved for two threads
    (4, [40], [20], [5]),  # fewer blocks than two per thread: heads split into groups
])
def test_tall_blocks_and_head_groups_equal_the_reference(isa, threads, cached, new, targets):
    args, _ = make_case(cached, new, targets, 16, seed=threads, max_len=500)
    want = ops.hstu_paged_attention(*args, impl="reference")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.hstu_paged_attention(*args, impl="native")
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_registry_picks_native_on_cpu():
    assert choose("recompile::hstu_paged_attention", detect_target()).impl == "native"


def test_a_page_outside_the_pool_is_named():
    args, _ = make_case([5], [2], [1], 2)
    table = args[6].clone()
    table[0, 1] = 10_000
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] is not a page of the pool"):
        ops.hstu_paged_attention(*args[:6], table, *args[7:], impl="native")


@pytest.mark.parametrize("batch, items, dim, k", [(1, 5000, 64, 100), (8, 3001, 32, 7), (3, 17, 8, 17)])
def test_item_topk_is_exact(isa, batch, items, dim, k):
    g = torch.Generator().manual_seed(items)
    corpus, queries = torch.randn(items, dim, generator=g), torch.randn(batch, dim, generator=g)
    corpus[11] = corpus[3]  # a tie: equal values come by index
    values, indices = QuantizedItems(corpus).topk(queries, k)
    full = (queries @ corpus.t()).topk(k, dim=1)
    torch.testing.assert_close(values, full.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, (queries.unsqueeze(1) * corpus[indices]).sum(-1), rtol=1e-5, atol=1e-5)
    assert (values[:, :-1] >= values[:, 1:]).all()
    exact = torch.sort(full.indices, 1).values
    assert (torch.sort(indices, 1).values == exact).float().mean() > 0.99  # only near-ties may differ


def test_item_topk_rejects_a_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        QuantizedItems(torch.randn(10, 4)).topk(torch.randn(1, 4), 11)
