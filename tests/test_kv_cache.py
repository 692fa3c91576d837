"""HSTU ranking with the paged user KV cache (recompile/serving/kv_cache.py, models/serving.py): scores with
the cache equal the no-cache ranker on the same histories over random request streams (appends, new users,
rewritten histories, evictions, host and disk tiers); the no-cache ranker equals models.sequential.HSTU; the
cache's LRU order, statistics and its refusal of a batch that cannot fit; the cached step exports; the rankers
choose their kernel on the attention op's arguments."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

import recompile
from models import serving
from models.sequential import HSTU, HSTUConfig
from models.serving import (CachedHSTURanker, HSTURanker, RankingServer, Request, compile_step, make_cache,
                            no_cache_inputs, rank_without_cache)
from recompile.lowering import Target
from recompile.serving import PagedKVCache
from recompile.runtime.kernels import SUPPORTS

CFG = HSTUConfig(num_items=50, dim=16, num_layers=2, num_heads=2, max_len=64, dropout=0.0, attn_dim=8, linear_dim=8,
                 num_time_buckets=16)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return HSTU(CFG).eval()


def history(g, n, start=0):
    return torch.randint(1, CFG.num_items + 1, (n,), generator=g), start + torch.randint(0, 5000, (n,), generator=g).cumsum(0)


def test_no_cache_ranker_is_the_hstu_encoder(encoder):
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 1, 9])
    ids, ts = history(g, int(lengths.sum()))
    with torch.no_grad():
        hidden = encoder(ids, ts, lengths)
        requests = []
        for b, (s, e) in enumerate(zip([0, 5, 6], [5, 6, 15])):
            requests.append(Request(b, ids[s:e], ts[s:e], ids[:0], ts[:0]))
        got = HSTURanker(encoder)(*no_cache_inputs(requests))
    torch.testing.assert_close(got, (hidden * encoder.item_emb(ids)).sum(-1), rtol=1e-5, atol=1e-6)


MAX_HISTORY = 24
# A request stream: (user, how: "append" k new items | "new" history of k items, candidates).
steps = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["append", "append", "new"]), st.integers(0, 9),
                           st.integers(0, 5)), min_size=1, max_size=8)


def serve_stream(encoder, stream, batch, spare_pages, page_size, tier, impl, seed):
    """Serve ``stream`` in batches with the cache and without; every score equal. Histories up to MAX_HISTORY
    tokens; the pools hold a full batch of them and ``spare_pages`` more, so streams of more users evict."""
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(encoder, -(-MAX_HISTORY // page_size) * batch + spare_pages, page_size, tier)
    server, ranker = RankingServer(CachedHSTURanker(encoder, impl), cache), HSTURanker(encoder)
    histories, served = {}, 0
    for first in range(0, len(stream), batch):
        requests = []
        for user, how, k, c in stream[first : first + batch]:
            if user in (r.user for r in requests):
                continue  # one request per user in a batch
            old_ids, old_ts = histories.get(user, history(g, 0))
            if how == "new" or old_ids.numel() + k > MAX_HISTORY:
                old_ids, old_ts = history(g, 0)
            ids, ts = history(g, k, int(old_ts[-1]) if old_ts.numel() else 0)
            histories[user] = torch.cat([old_ids, ids]), torch.cat([old_ts, ts])
            cand, cand_ts = history(g, c, int(histories[user][1][-1]) if histories[user][1].numel() else 0)
            requests.append(Request(user, *histories[user], cand, cand_ts))
        got, want = server.rank(requests), rank_without_cache(ranker, requests)
        served += len(requests)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert cache.pages_in_use == sum(len(e.pages) for e in cache.users.values())
        assert all(cache.pages_for(e.length) == len(e.pages) for e in cache.users.values())
    stats = cache.stats
    assert stats.hits + stats.misses == served
    assert stats.reloads <= stats.offloads <= stats.evictions
    assert tier is not None or stats.offloads == 0
    return stats


@settings(max_examples=20, deadline=None)
@given(stream=steps, batch=st.integers(1, 3), spare_pages=st.integers(0, 8), page_size=st.integers(1, 4),
       tier=st.sampled_from([None, "host", "disk"]), impl=st.sampled_from(["cpu", "reference"]),
       seed=st.integers(0, 2**16))
def test_cached_scores_equal_recomputing(encoder, tmp_path_factory, stream, batch, spare_pages, page_size, tier, impl,
                                         seed):
    tier = str(tmp_path_factory.mktemp("tier")) if tier == "disk" else tier
    serve_stream(encoder, stream, batch, spare_pages, page_size, tier, impl, seed)


@pytest.mark.parametrize("tier", [None, "host", "disk"])
def test_evicted_users_come_back_exactly(encoder, tmp_path, tier):
    """Three users of 3 pages in 6: each request evicts the user asked next, which the tier then reloads."""
    stream = [(u, "append", 9, 3) for u in (0, 1, 2)] + [(u, "append", 1, 4) for u in (0, 1, 2, 0)]
    stats = serve_stream(encoder, stream, 1, 0, 4, str(tmp_path) if tier == "disk" else tier, "cpu", 0)
    assert stats.evictions == 5 and stats.reloads == (4 if tier else 0) and stats.hits == (4 if tier else 0)


def filled(cache, users, length):
    for user in users:
        ids = torch.arange(1, length + 1)
        cache.lookup([user], [ids])
        cache.reserve([user], [length])
        slots = cache.slots([user], [length])
        for layer in range(cache.num_layers):
            cache.write(layer, slots, torch.randn(length, cache.heads, cache.head_dim),
                        torch.randn(length, cache.heads, cache.value_dim))
        cache.commit([user], [ids], slots, torch.arange(length) * (user + 1))


def user_rows(cache, user):
    entry = cache.users[user]
    rows = cache._rows(entry, 0, entry.length)
    return cache.k.flatten(1, 2)[:, rows], cache.v.flatten(1, 2)[:, rows], cache.ts.view(-1)[rows]


@pytest.mark.parametrize("tier", [None, "host", "disk"])
def test_lru_eviction_and_reload(tmp_path, tier):
    cache = PagedKVCache(2, 5, 4, 2, 3, 5, tier=str(tmp_path) if tier == "disk" else tier)
    filled(cache, [0, 1], 8)  # 2 pages each, 1 free
    before = user_rows(cache, 0)
    cache.lookup([0], [torch.arange(1, 9)])  # user 0 is now the most recent: user 1 goes first
    filled(cache, [2], 8)
    assert list(cache.users) == [0, 2] and cache.stats.evictions == 1
    filled(cache, [3], 4)  # the last free page
    filled(cache, [4], 8)  # user 0 evicted now
    assert list(cache.users) == [2, 3, 4] and cache.pages_in_use == 5 and cache.stats.evictions == 2
    assert cache.lookup([0], [torch.arange(1, 10)]) == ([8] if tier else [0])
    if tier:
        assert cache.stats.reloads == 1 and cache.stats.offloads == cache.stats.evictions
        for a, b in zip(user_rows(cache, 0), before):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rewritten_history_is_not_served_from_the_cache():
    cache = PagedKVCache(1, 4, 4, 1, 2, 2)
    filled(cache, [0], 6)
    assert cache.lookup([0], [torch.arange(2, 10)]) == [0]
    assert cache.stats.invalidations == 1 and cache.pages_in_use == 0


def test_truncate_frees_the_pages_past_the_kept_tokens():
    cache = PagedKVCache(1, 4, 4, 1, 2, 2)
    filled(cache, [0], 10)
    cache.truncate(0, 5)
    assert cache.pages_in_use == 2 and cache.lookup([0], [torch.arange(1, 12)]) == [5]


def test_a_batch_that_cannot_fit_is_refused():
    cache = PagedKVCache(1, 3, 2, 1, 2, 2)
    filled(cache, [0], 4)
    with pytest.raises(MemoryError, match="3 pages needed, 1 free of 3"):
        cache.reserve([0, 1], [4, 6])


def test_cached_step_exports_with_dynamic_rows_and_batch(encoder):
    g = torch.Generator().manual_seed(3)
    cache = make_cache(encoder, 16, 4)
    server = RankingServer(CachedHSTURanker(encoder, "cpu"), cache)
    requests = [Request(u, *history(g, 5 + u), *history(g, 3)) for u in range(2)]
    server.rank(requests)
    more = [history(g, 2), history(g, 3)]
    args = server.prepare([Request(r.user, torch.cat([r.history, m[0]]), torch.cat([r.history_ts, m[1]]),
                                   *history(g, 2)) for r, m in zip(requests, more)]).args
    rows, batch = Dim("rows"), Dim("batch")
    dims = ({0: rows}, {0: rows}, {0: rows}, {0: batch + 1}, {0: batch}, {0: batch, 1: Dim("pages")}, {0: batch},
            None, None, None)
    program = recompile.export(server.model, args, dynamic_shapes=dims)
    assert any("hstu_paged_attention" in str(n.target) for n in program.graph.nodes)
    for got, want in zip(program.module()(*args), server.model(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_compiled_step_serves_new_batch_sizes_without_recompiling(encoder):
    """The cached step under rec_ascend: batches of 2 and 3 users, other row counts and page-table widths, one
    compiled graph (dynamic dims), the scores equal eager's."""
    g = torch.Generator().manual_seed(5)
    counter = torch._dynamo.testing.CompileCounterWithBackend("rec_ascend")
    model = CachedHSTURanker(encoder, "cpu")
    eager, compiled = RankingServer(model, make_cache(encoder, 64, 4)), RankingServer(
        model, make_cache(encoder, 64, 4), compile_step(model, counter))
    compiles = []
    for users in ([0, 1], [0, 1, 2], [1, 2], [2, 3, 0]):
        requests = [Request(u, *history(torch.Generator().manual_seed(u), 3 + 4 * u), *history(g, 2 + len(users)))
                    for u in users]
        for got, want in zip(compiled.rank(requests), eager.rank(requests)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        compiles.append(counter.frame_count)
    assert compiles[0] >= 1 and compiles[-1] == compiles[0]  # (Dynamo may restart the first trace once)


def cuda_with_triton() -> Target:
    """A CUDA target with Triton (planned only): its first paged-attention kernel, Triton, takes no time bias."""
    return Target("cuda", False, "planned", 132, frozenset(), "triton")


def test_kernel_is_chosen_on_the_call_arguments(encoder, monkeypatch):
    """On a target whose preferred kernel rejects the call (Triton: no time bias), the cached ranker chooses the
    next kernel that takes the call's arguments, and runs it: the scores equal the CPU's. The target alone would
    choose Triton, whose kernel raises UnsupportedInputs on these inputs."""
    g = torch.Generator().manual_seed(6)
    requests = [Request(u, *history(g, 6 + u), *history(g, 3)) for u in range(2)]
    want = rank_without_cache(HSTURanker(encoder, "cpu"), requests)
    monkeypatch.setattr(serving, "detect_target", cuda_with_triton)
    assert serving.fastest("hstu_paged_attention") == "triton"
    server = RankingServer(CachedHSTURanker(encoder), make_cache(encoder, 16, 4))
    assert server.model.choose_kernel(*server.prepare(requests).args) == "reference"  # on fake inputs: nothing ran
    assert server.cache.stats.tokens_appended == 0
    for got, w in zip(server.rank(requests), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_kernel_choice_reads_the_supports_of_each_kernel(encoder, monkeypatch):
    """On the CPU, a preferred kernel whose supports rejects the arguments is passed over for the next."""
    g = torch.Generator().manual_seed(7)
    requests = [Request(0, *history(g, 5), *history(g, 2))]
    first = serving.fastest("hstu_attention")
    monkeypatch.setitem(SUPPORTS["recompile::hstu_attention"], first, lambda time_bias=None, **_: time_bias is None
                        or "rejects time biases (test)")
    ranker = HSTURanker(encoder)
    ranker.choose_kernel(*no_cache_inputs(requests))
    assert ranker.impl not in (None, first)
    assert serving.fastest("hstu_attention") == first  # without the arguments nothing rejects it
