"""recompile.hstu_paged_attention (runtime/paged_attention.py): every kernel (reference, cpu, triton under the
interpreter) equals hstu_attention on the whole sequences (prefix + new rows) for the new rows, over random
cached and new lengths (zero included), candidates, page sizes, shuffled pages, relative position and time
bias, int32/int64 tables and bf16; the fake passes opcheck; bad arguments name themselves."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.lowering.registry import bind
from recompile.runtime.kernels import KERNELS, UnsupportedInputs, why_not

ops = torch.ops.recompile
IMPLS = sorted(KERNELS["hstu_paged_attention"])
MAX_LEN, HEADS, DIM, DIM_V, BUCKETS = 40, 2, 8, 4, 16


def make_case(cached, new, targets, page_size, rel=True, time=True, dtype=torch.float32, table_dtype=torch.int64,
              seed=0, max_len=MAX_LEN):
    """Whole sequences, their prefixes written into shuffled pages, and the op's arguments for the new rows."""
    g = torch.Generator().manual_seed(seed)
    full = [c + n for c, n in zip(cached, new)]
    total = sum(full)
    q, k = (torch.randn(total, HEADS, DIM, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(total, HEADS, DIM_V, generator=g, dtype=dtype)
    ts = torch.randint(0, 10**6, (total,), generator=g)
    pages_per_user = [-(-c // page_size) for c in cached]
    num_pages = sum(pages_per_user) + 2
    order = torch.randperm(num_pages, generator=g)
    k_cache = torch.randn(num_pages, page_size, HEADS, DIM, generator=g, dtype=dtype)  # garbage outside prefixes
    v_cache = torch.randn(num_pages, page_size, HEADS, DIM_V, generator=g, dtype=dtype)
    ts_cache = torch.randint(0, 10**6, (num_pages, page_size), generator=g)
    table = torch.zeros(len(cached), max(pages_per_user + [1]) + 1, dtype=table_dtype)
    new_rows, used, start = [], 0, 0
    for b, (c, n) in enumerate(zip(cached, new)):
        pages = order[used : used + pages_per_user[b]]
        used += pages_per_user[b]
        table[b, : len(pages)] = pages.to(table_dtype)
        for pool, src in ((k_cache, k), (v_cache, v), (ts_cache, ts)):
            flat = pool.view(num_pages * page_size, *pool.shape[2:])
            if c:
                flat[(pages.view(-1, 1) * page_size + torch.arange(page_size)).flatten()[:c]] = src[start : start + c]
        new_rows.append(torch.arange(start + c, start + c + n))
        start += c + n
    new_rows = torch.cat(new_rows)
    rel_bias = torch.randn(2 * max_len - 1, generator=g) if rel else None
    time_bias = torch.randn(BUCKETS + 1, generator=g) if time else None
    num_targets = torch.tensor(targets)
    full_offsets = torch.tensor([0] + full).cumsum(0)
    expected = ops.hstu_attention(q, k, v, full_offsets, max_len, 0.5, True, num_targets, 0, rel_bias,
                                  ts if time else None, time_bias)[new_rows]
    args = (q[new_rows], k[new_rows], v[new_rows], torch.tensor([0] + new).cumsum(0), k_cache, v_cache, table,
            torch.tensor(cached), max_len, 0.5, num_targets, rel_bias, ts[new_rows] if time else None,
            ts_cache if time else None, time_bias)
    return args, expected


lengths = st.lists(st.tuples(st.integers(0, 14), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(users=lengths, page_size=st.integers(1, 5), rel=st.booleans(), time=st.booleans(),
       table_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16))
def test_kernels_equal_attention_over_the_whole_sequence(users, page_size, rel, time, table_dtype, seed):
    cached, new, targets = [u[0] for u in users], [u[1] for u in users], [min(u[2], u[1]) for u in users]
    args, expected = make_case(cached, new, targets, page_size, rel, time, table_dtype=table_dtype, seed=seed)
    for impl in IMPLS:
        if why_not("hstu_paged_attention", impl, **bind("recompile::hstu_paged_attention", args, {})) is not None:
            with pytest.raises(UnsupportedInputs):  # (triton with a time bias): the lowering chooses another
                ops.hstu_paged_attention(*args, impl=impl)
            continue
        got = ops.hstu_paged_attention(*args, impl=impl)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"impl {impl}")


@pytest.mark.parametrize("impl, dtype", [(impl, torch.bfloat16) for impl in IMPLS if impl != "triton"]
                         + [(impl, torch.float16) for impl in IMPLS])  # numpy, so the interpreter, has no bf16
def test_low_precision(impl, dtype):
    args, _ = make_case([9, 0], [3, 4], [1, 2], 4, dtype=dtype, time=False)
    expected = ops.hstu_paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                          for a in args])
    got = ops.hstu_paged_attention(*args, impl=impl)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_candidates_see_history_and_themselves_only():
    args, _ = make_case([6], [4], [3], 4, time=False)
    base = ops.hstu_paged_attention(*args, impl="cpu")
    k = args[1].clone()
    k[2] += 100.0  # the second candidate's key: no other row may see it
    moved = ops.hstu_paged_attention(args[0], k, *args[2:], impl="cpu")
    torch.testing.assert_close(moved[[0, 1, 3]], base[[0, 1, 3]])
    assert not torch.allclose(moved[2], base[2])


def test_opcheck():
    args, _ = make_case([5, 2], [3, 2], [1, 1], 2)
    torch.library.opcheck(ops.hstu_paged_attention.default, args, {"impl": "cpu"},
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("bad, match", [
    (lambda a: a[:6] + (a[6][:1],) + a[7:], "page_table"),
    (lambda a: a[:7] + (a[7] + 100,) + a[8:], "beyond its page table"),
    (lambda a: a[:4] + (a[4][..., :3],) + a[5:], "k_cache"),
    (lambda a: a[:12] + (None,) + a[13:], "timestamps, ts_cache and time_bias"),
    (lambda a: a[:8] + (4,) + a[9:11] + (a[11][:7],) + a[12:], "longer than max_seq_len=4"),
])
@pytest.mark.parametrize("impl", [impl for impl in ("cpu", "native") if impl in IMPLS])
def test_bad_arguments_are_named(bad, match, impl):
    args, _ = make_case([5, 2], [3, 2], [1, 1], 2)
    with pytest.raises(ValueError, match=match):
        ops.hstu_paged_attention(*bad(args), impl=impl)
