"""recompile.grouped_embedding_bag against eager F.embedding_bag / F.embedding, forward and backward."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recompile.runtime.embedding import MEAN, NONE, SUM, grouped_embedding_bag_reference

IMPLS = ["reference", "cpu", "native"]
CHECKING_IMPLS = ["cpu", "native"]  # the checks run before the lookup, or the native kernel marks what they find
MODES = {SUM: "sum", MEAN: "mean"}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _feature(rows, dim, batch, max_len, dtype, index_dtype, form, pooling, weighted, padding, gen):
    """One table and its ids in ``form`` ("offsets", "last_offset", "2d"), with random (some empty) bags."""
    weight = torch.randn(rows, dim, generator=gen).to(dtype).requires_grad_()
    if form == "2d":
        ids = torch.randint(0, rows, (batch, max(max_len, 1)), generator=gen)  # eager rejects [B, 0]
        offsets = None
    else:
        lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        offsets = torch.cumsum(lengths, 0) - lengths
        if form == "last_offset":
            offsets = torch.cat([offsets, lengths.sum().view(1)])
        offsets = offsets.to(index_dtype)
    psw = torch.rand(ids.shape, generator=gen).to(dtype).requires_grad_() if weighted else None
    pad = padding % rows if padding is not None else None
    return dict(weight=weight, ids=ids.to(index_dtype), offsets=offsets, psw=psw, pooling=pooling,
                padding=pad, last=form == "last_offset")


def _eager(f):
    if f["pooling"] == NONE:
        return F.embedding(f["ids"], f["weight"], padding_idx=f["padding"]).reshape(-1, f["weight"].shape[1])
    return F.embedding_bag(f["ids"], f["weight"], f["offsets"], mode=MODES[f["pooling"]], per_sample_weights=f["psw"],
                           include_last_offset=f["last"], padding_idx=f["padding"])


def _grouped(features, layout, impl, bounds_check="fatal", names=None):
    names = names or ",".join(f"f{t}" for t in range(len(features)))
    return torch.ops.recompile.grouped_embedding_bag(
        [f["weight"] for f in features], [f["ids"] for f in features], [f["offsets"] for f in features],
        [f["psw"] if f["psw"] is not None else torch.empty(0) for f in features], [f["pooling"] for f in features],
        [f["padding"] if f["padding"] is not None else -1 for f in features], [f["last"] for f in features],
        [False] * len(features), layout, names, bounds_check, impl,
    )


def _layout_of(outs, layout):
    return {"stack": lambda: torch.stack(outs, 1), "concat": lambda: torch.cat(outs, 1),
            "sequence": lambda: torch.cat(outs, 0)}[layout]()


def _leaves(features):
    return [t for f in features for t in (f["weight"], f["psw"]) if t is not None]


def _assert_same(features, layout, impl, dtype=torch.float32):
    want = _layout_of([_eager(f) for f in features], layout)
    got = _grouped(features, layout, impl)
    torch.testing.assert_close(got, want, **TOL[dtype])
    grad = torch.randn(want.shape).to(dtype)
    leaves = _leaves(features)
    want_grads = torch.autograd.grad(want, leaves, grad, allow_unused=True)
    got_grads = torch.autograd.grad(got, leaves, grad, allow_unused=True)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_every_input_form_matches_eager(impl, layout):
    gen = torch.Generator().manual_seed(1)
    features = [
        _feature(10, 4, 5, 3, torch.float32, torch.int64, "offsets", MEAN, False, 3, gen),
        _feature(7, 4, 5, 2, torch.float32, torch.int32, "2d", SUM, False, None, gen),
        _feature(5, 4, 5, 4, torch.float32, torch.int64, "last_offset", SUM, True, None, gen),
        _feature(1, 4, 5, 2, torch.float32, torch.int32, "offsets", SUM, False, -1, gen),
    ]
    _assert_same(features, layout, impl)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables=st.lists(
        st.tuples(st.integers(1, 20), st.sampled_from([1, 3, 8, 40]), st.sampled_from(["offsets", "last_offset", "2d"]),
                  st.sampled_from([SUM, MEAN]), st.booleans(), st.one_of(st.none(), st.integers(-3, 20))),
        min_size=1, max_size=4,
    ),
    batch=st.integers(0, 6),
    max_len=st.integers(0, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    impl=st.sampled_from(IMPLS),
    seed=st.integers(0, 2**16),
)
def test_property_matches_eager(tables, batch, max_len, dtype, index_dtype, impl, seed):
    """Mixed dims, empty bags (MEAN of an empty bag is 0), one-row tables, int32/int64, fp16/bf16."""
    gen = torch.Generator().manual_seed(seed)
    features = [
        _feature(rows, dim, batch, max_len, dtype, index_dtype, form, pooling, weighted and pooling == SUM, pad, gen)
        for rows, dim, form, pooling, weighted, pad in tables
    ]
    _assert_same(features, "concat", impl, dtype)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables=st.lists(st.tuples(st.integers(1, 20), st.sampled_from([1, 8, 70]), st.sampled_from([SUM, MEAN]),
                              st.booleans(), st.one_of(st.none(), st.integers(0, 20))), min_size=1, max_size=3),
    batch=st.integers(0, 40),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_bags_of_one_id_match_eager(tables, batch, dtype, index_dtype, seed):
    """[N, 1] ids (the field lookups' form, the native kernel's row copy): a row, times its sample weight, 0 for
    padding (MEAN too), forward and backward, int32/int64, fp16/bf16, one-row and width-1 tables, no rows. Against
    eager in fp32 (the kernels sum in fp32 and round once, where eager's fp16/bf16 backward rounds every add)."""
    gen = torch.Generator().manual_seed(seed)
    features = [_feature(rows, dim, batch, 1, dtype, index_dtype, "2d", pooling, weighted and pooling == SUM, pad, gen)
                for rows, dim, pooling, weighted, pad in tables]
    wide = [{**f, "weight": f["weight"].detach().float().requires_grad_(),
             "psw": None if f["psw"] is None else f["psw"].detach().float().requires_grad_()} for f in features]
    want = torch.cat([_eager(f) for f in wide], 1)
    got = _grouped(features, "concat", "native")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    grad = torch.randn(want.shape, generator=gen).to(dtype)
    want_grads = torch.autograd.grad(want, _leaves(wide), grad.float())
    for g, w in zip(torch.autograd.grad(got, _leaves(features), grad), want_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_len", [1, 3], ids=["one_id", "bags"])
def test_half_dense_gradient_rounds_once(dtype, max_len):
    """A half-precision table's dense gradient is summed in fp32 and rounded once: one row that 40 bags touch (70
    columns, the tail included) is the fp32 sum of their gradients, to within one rounding (it rounded every add:
    a few percent off)."""
    gen = torch.Generator().manual_seed(0)
    f = _feature(1, 70, 40, max_len, dtype, torch.int64, "2d", SUM, False, None, gen)
    got = _grouped([f], "concat", "native")
    grad = torch.randn(got.shape, generator=gen).to(dtype)
    (g,) = torch.autograd.grad(got, [f["weight"]], grad)
    want = grad.float().sum(0, keepdim=True) * max_len
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]  # the two sums' fp32 orders may round apart
    torch.testing.assert_close(g.float(), want, rtol=ulp, atol=ulp)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_pooling_sequence_layout(impl):
    gen = torch.Generator().manual_seed(2)
    features = [_feature(rows, 4, 3, 2, torch.float32, torch.int64, "2d", NONE, False, pad, gen)
                for rows, pad in ((9, 2), (4, None))]
    _assert_same(features, "sequence", impl)


def test_empty_bag_mean_is_zero():
    weight = torch.randn(4, 3)
    out = _grouped([dict(weight=weight, ids=torch.tensor([1, 2]), offsets=torch.tensor([0, 0, 2]), psw=None,
                         pooling=MEAN, padding=None, last=False)], "concat", "cpu")
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0
    torch.testing.assert_close(out[1], weight[1:3].mean(0))


@pytest.mark.parametrize("impl", IMPLS)
def test_sparse_gradients_match_eager(impl):
    gen = torch.Generator().manual_seed(3)
    f = _feature(12, 4, 4, 3, torch.float32, torch.int64, "offsets", SUM, False, None, gen)
    ws = f["weight"]
    out = torch.ops.recompile.grouped_embedding_bag([ws], [f["ids"]], [f["offsets"]], [torch.empty(0)], [SUM], [-1],
                                                    [False], [True], "concat", "f0", "fatal", impl)
    grad = torch.randn(out.shape)
    (got,) = torch.autograd.grad(out, [ws], grad)
    want = F.embedding_bag(f["ids"], ws, f["offsets"], mode="sum", sparse=True)
    (expected,) = torch.autograd.grad(want, [ws], grad)
    assert got.is_sparse and expected.is_sparse
    torch.testing.assert_close(got.to_dense(), expected.to_dense())


def _bad_id_features():
    weight = torch.randn(5, 2, requires_grad=True)
    good = dict(weight=torch.randn(3, 2), ids=torch.tensor([0, 1]), offsets=torch.tensor([0, 1]), psw=None,
                pooling=SUM, padding=None, last=False)
    bad = dict(weight=weight, ids=torch.tensor([1, 7, 2]), offsets=torch.tensor([0, 2]), psw=None, pooling=SUM,
               padding=None, last=False)
    return good, bad


@pytest.mark.parametrize("impl", CHECKING_IMPLS)
def test_bounds_fatal_names_feature_and_id(impl):
    good, bad = _bad_id_features()
    with pytest.raises(IndexError, match=r"feature 'user_city': id 7 is out of range for its table of 5 rows"):
        _grouped([good, bad], "concat", impl, "fatal", "user_id,user_city")


@pytest.mark.parametrize("impl", CHECKING_IMPLS)
@pytest.mark.parametrize("mode", ["warning", "ignore"])
def test_bounds_warning_and_ignore_replace_by_zero(mode, impl):
    good, bad = _bad_id_features()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _grouped([good, bad], "concat", impl, mode, "user_id,user_city")
    said = [str(w.message) for w in caught if "user_city" in str(w.message)]
    assert bool(said) == (mode == "warning")
    fixed = dict(bad, ids=torch.tensor([1, 0, 2]))
    torch.testing.assert_close(out, torch.cat([_eager(good), _eager(fixed)], 1))
    out.sum().backward()
    torch.testing.assert_close(bad["weight"].grad[0], torch.ones(2))


@pytest.mark.parametrize(
    "offsets, last, message",
    [
        ([1, 2], False, "must start at 0 and not decrease \\(offsets\\[0\\] = 1"),
        ([0, 3, 2], False, r"offsets\[2\] < offsets\[1\]"),
        ([0, 5], False, "must not exceed len\\(indices\\) = 4"),
        ([0, 2, 3], True, "must end at len\\(indices\\) = 4"),
    ],
)
@pytest.mark.parametrize("impl", CHECKING_IMPLS)
def test_malformed_offsets_rejected(offsets, last, message, impl):
    f = dict(weight=torch.randn(5, 2), ids=torch.tensor([0, 1, 2, 3]), offsets=torch.tensor(offsets), psw=None,
             pooling=SUM, padding=None, last=last)
    with pytest.raises(ValueError, match=f"feature 'clicks': offsets .*{message}"):
        _grouped([f], "concat", impl, names="clicks")


def test_reference_function_and_opcheck():
    gen = torch.Generator().manual_seed(4)
    features = [_feature(6, 3, 4, 3, torch.float32, torch.int64, "offsets", SUM, True, None, gen),
                _feature(8, 3, 4, 2, torch.float32, torch.int32, "2d", MEAN, False, 1, gen)]
    args = ([f["weight"] for f in features], [f["ids"] for f in features], [f["offsets"] for f in features],
            [f["psw"] if f["psw"] is not None else torch.empty(0) for f in features], [SUM, MEAN], [-1, 1],
            [False, False])
    ref = grouped_embedding_bag_reference(*args[:3], [features[0]["psw"], None], *args[4:], "stack", ["a", "b"])
    torch.testing.assert_close(ref, _grouped(features, "stack", "cpu"))
    for impl in CHECKING_IMPLS:
        torch.library.opcheck(torch.ops.recompile.grouped_embedding_bag.default,
                              (*args, [False, False], "stack", "a,b", "fatal", impl))


@pytest.mark.parametrize("layout", ["concat", "stack"])
def test_triton_kernel_matches_eager_under_interpreter(layout):
    gen = torch.Generator().manual_seed(5)
    features = [
        _feature(6, 4, 3, 3, torch.float32, torch.int64, "offsets", MEAN, False, 2, gen),
        _feature(5, 4, 3, 2, torch.float32, torch.int32, "2d", SUM, False, None, gen),
        _feature(4, 4, 3, 2, torch.float32, torch.int64, "last_offset", SUM, True, None, gen),
    ]
    _assert_same(features, layout, "triton")


def test_triton_sequence_layout_under_interpreter():
    gen = torch.Generator().manual_seed(6)
    features = [_feature(7, 3, 2, 2, torch.float32, torch.int64, "2d", NONE, False, None, gen) for _ in range(2)]
    _assert_same(features, "sequence", "triton")
