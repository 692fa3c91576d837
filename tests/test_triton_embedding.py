"""The grouped lookup's Triton kernels (runtime/triton_kernels/embedding.py, TRITON_INTERPRET=1 here): one launch
for every table, forward and the tables' gradients equal to the reference, ids and offsets checked in the kernel
and reported after the launch (never before it) naming the feature."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.runtime.embedding import MEAN, NONE, SUM
from recompile.runtime.triton_kernels import embedding as kernels

ops = torch.ops.recompile


def _table(gen, rows, dim, batch, form, index_dtype, pooling, weighted, padding):
    weight = torch.randn(rows, dim, generator=gen).requires_grad_()
    if form == "2d":
        ids, offsets = torch.randint(0, rows, (batch, 3), generator=gen), None
    else:
        lengths = torch.randint(0, 4, (batch,), generator=gen)  # empty bags among them
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        offsets = torch.cumsum(lengths, 0) - lengths
        if form == "last_offset":
            offsets = torch.cat([offsets, lengths.sum().view(1)])
        offsets = offsets.to(index_dtype)
    psw = torch.rand(ids.shape, generator=gen) if weighted and pooling == SUM else torch.empty(0)
    return weight, ids.to(index_dtype), offsets, psw, pooling, padding, form == "last_offset"


def lookup(tables, layout, impl, bounds_check="fatal"):
    columns = list(zip(*tables))
    return ops.grouped_embedding_bag(*columns, [False] * len(tables), layout,
                                     ",".join(f"f{t}" for t in range(len(tables))), bounds_check, impl)


def assert_matches_reference(tables, layout):
    got, want = lookup(tables, layout, "triton"), lookup(tables, layout, "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    weights = [t[0] for t in tables]
    for g, w in zip(torch.autograd.grad(got, weights, grad), torch.autograd.grad(want, weights, grad)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 9), st.sampled_from(["offsets", "last_offset", "2d"]),
                                st.sampled_from([SUM, MEAN]), st.booleans(), st.sampled_from([-1, 0, 2])),
                      min_size=1, max_size=3),
       batch=st.integers(0, 5), layout=st.sampled_from(["concat", "stack"]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 99))
def test_grouped_lookup_matches_reference(specs, batch, layout, index_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    dims = [d if layout == "concat" else 4 for d, *_ in specs]
    tables = [_table(gen, 7, dim, batch, form, index_dtype, pooling, weighted, padding)
              for dim, (_, form, pooling, weighted, padding) in zip(dims, specs)]
    assert_matches_reference(tables, layout)


def test_sequence_layout_and_a_single_row():
    gen = torch.Generator().manual_seed(2)
    tables = [(torch.randn(5, 3, generator=gen).requires_grad_(), torch.randint(0, 5, (n,), generator=gen), None,
               torch.empty(0), NONE, -1, False) for n in (4, 0, 1)]
    assert_matches_reference(tables, "sequence")
    single = [(torch.randn(1, 2, generator=gen).requires_grad_(), torch.zeros(1, dtype=torch.int64),
               torch.zeros(1, dtype=torch.int64), torch.empty(0), SUM, -1, False)]
    assert_matches_reference(single, "concat")


def test_every_table_in_one_launch(monkeypatch):
    launches = []
    kernel = kernels._grouped_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(kernels, "_grouped_kernel", Counting())
    gen = torch.Generator().manual_seed(3)
    tables = [_table(gen, 6, d, 4, "offsets", torch.int64, SUM, False, -1) for d in (2, 3, 5)]
    out = lookup(tables, "concat", "triton")
    assert len(launches) == 1
    out.sum().backward()
    assert len(launches) == 2 and all(t[0].grad is not None for t in tables)


def _bad_tables():
    gen = torch.Generator().manual_seed(4)
    good = _table(gen, 6, 3, 4, "offsets", torch.int64, SUM, False, -1)
    weight, ids, offsets, *rest = _table(gen, 6, 3, 4, "2d", torch.int64, MEAN, False, -1)
    ids = ids.clone()
    ids[1, 2] = 6  # one past the table
    return [good, (weight, ids, offsets, *rest)]


def test_bad_id_fatal_names_the_table_warning_reads_row_zero():
    tables = _bad_tables()
    with pytest.raises(IndexError, match="feature 'f1': id 6 is out of range for its table of 6 rows"):
        lookup(tables, "concat", "triton")
    with pytest.warns(UserWarning, match="feature 'f1'"):
        got = lookup(tables, "concat", "triton", "warning")
    torch.testing.assert_close(got, lookup(tables, "concat", "reference", "ignore"))


def test_bad_offsets_are_rejected():
    gen = torch.Generator().manual_seed(5)
    weight, ids, offsets, *rest = _table(gen, 6, 3, 4, "last_offset", torch.int64, SUM, False, -1)
    bad = offsets.clone()
    bad[-1] += 1  # past the ids
    with pytest.raises(ValueError, match="feature 'f0': offsets must end at len"):
        lookup([(weight, ids, bad, *rest)], "concat", "triton", "ignore")


class _Event:
    """A device event that has not passed until ``done``."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_errors_are_read_once_the_device_has_passed_them(monkeypatch):
    """No wait on the hot path: a lookup whose flags the device has not written yet returns, and its error is
    raised by a later lookup (once the flags are there) or by check_lookup_errors."""
    events = []

    def pending(err):
        events.append(_Event())
        return err, events[-1]

    monkeypatch.setattr(kernels, "_host_flags", pending)
    tables = _bad_tables()
    lookup(tables, "concat", "triton")  # fatal, not raised yet
    lookup(tables[:1], "concat", "triton")
    events[0].done = True
    with pytest.raises(IndexError, match="feature 'f1'"):
        lookup(tables[:1], "concat", "triton")
    lookup(tables, "concat", "triton")
    with pytest.raises(IndexError, match="feature 'f1'"):
        kernels.check_lookup_errors()
    kernels.check_lookup_errors()  # every error reported once
