"""The native CPU kernels of the grouped embedding ops (runtime/csrc/embedding.h) against the torch kernels.

Forward and dense backward against eager are covered by test_embedding_ops (its IMPLS include "native");
here: the backward's sparse and per-sample-weight forms, the fused optimizer step, its state accessor, and
that the kernel is the CPU lowering's first choice.
"""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recompile.runtime import embedding_native, embedding_optimizer
from recompile.runtime.embedding import MEAN, NONE, OP, SUM, raw_features, table_gradients
from recompile.runtime.embedding_optimizer import OPTIMIZERS, format_optimizer
from recompile.runtime.kernels import get_kernel

pytestmark = pytest.mark.skipif(not embedding_native.available(), reason="no C compiler: the native kernels are not built")

LAYOUT_OF = {SUM: "concat", MEAN: "stack", NONE: "sequence"}


def _group(seed, num, rows, dim, batch, max_len, pooling, weighted, padding, index_dtype):
    """Tables (distinct, one dim), ids with random (some empty) bags, a random output gradient."""
    gen = torch.Generator().manual_seed(seed)
    weights, indices, offsets, psws = [], [], [], []
    for t in range(num):
        n_rows = rows + t
        weights.append(torch.randn(n_rows, dim, generator=gen))
        lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
        ids = torch.randint(0, n_rows, (int(lengths.sum()),), generator=gen)
        indices.append(ids.to(index_dtype))
        offsets.append(None if pooling == NONE else (torch.cumsum(lengths, 0) - lengths).to(index_dtype))
        psws.append(torch.rand(ids.shape, generator=gen) if weighted and pooling == SUM else None)
    pads = [padding % w.shape[0] if padding is not None else -1 for w in weights]
    layout = LAYOUT_OF[pooling]
    rows_out = sum(i.numel() for i in indices) if layout == "sequence" else batch
    width = dim if layout == "sequence" else dim * num
    grad = torch.randn(rows_out, width, generator=gen)
    if layout == "stack":
        grad = grad.view(batch, num, dim)
    return weights, raw_features(indices, offsets, [False] * num), psws, [pooling] * num, pads, layout, grad


GROUPS = dict(
    seed=st.integers(0, 2**16), num=st.integers(1, 3), rows=st.integers(1, 12), dim=st.sampled_from([1, 5, 64, 70]),
    batch=st.integers(0, 5), max_len=st.integers(0, 4), pooling=st.sampled_from([SUM, MEAN, NONE]),
    weighted=st.booleans(), padding=st.one_of(st.none(), st.integers(0, 12)),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse=st.lists(st.booleans(), min_size=3, max_size=3), psw_grad=st.booleans(), **GROUPS)
def test_backward_matches_reference(sparse, psw_grad, **group):
    """Dense and per-id table gradients and per-sample weight gradients; empty bags, one-row tables, D not a
    multiple of the register block, int32/int64 ids, padding, MEAN and NONE pooling."""
    weights, features, psws, pooling, pads, layout, grad = _group(**group)
    num = len(weights)
    wants = [psw_grad and p is not None for p in psws]
    args = (grad, weights, features, psws, pooling, pads, layout, sparse[:num], wants)
    got, want = embedding_native.backward(*args), table_gradients(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


HALF_TOL = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(list(HALF_TOL)), sparse=st.lists(st.booleans(), min_size=3, max_size=3), **GROUPS)
def test_half_tables_run_natively(dtype, sparse, **group):
    """fp16/bf16 tables, sample weights and gradients: the native kernels (no fallback to the torch kernels) sum
    in fp32 and round once, as the reference does; dense and per-id gradients, per-sample weight gradients."""
    weights, features, psws, pooling, pads, layout, grad = _group(**group)
    weights, grad = [w.to(dtype) for w in weights], grad.to(dtype)
    psws = [None if p is None else p.to(dtype) for p in psws]
    num = len(weights)
    lookup = (weights, [f.ids for f in features], [f.offsets for f in features],
              [torch.empty(0) if p is None else p for p in psws], pooling, pads, [False] * num, layout,
              ",".join(f"f{t}" for t in range(num)), "fatal")
    got = embedding_native.forward(*lookup)  # the kernels raise on what they do not read: no fallback can run
    wants = [p is not None for p in psws]
    args = (grad, weights, features, psws, pooling, pads, layout, sparse[:num], wants)
    got_grads = embedding_native.backward(*args)
    want = get_kernel(OP, "reference")(weights, features, psws, pooling, pads, layout)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **HALF_TOL[dtype])
    for g, w in zip(got_grads, table_gradients(*args)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **HALF_TOL[dtype])


def _run_step(impl, kind, weights, features, psws, pooling, pads, layout, grad):
    weights = [w.clone() for w in weights]
    params = embedding_optimizer.parse_optimizer(format_optimizer(kind, lr=0.1, eps=1e-3))[1]
    for _ in range(2):  # the second step reads the state the first wrote
        get_kernel(embedding_optimizer.STEP_OP, impl)(grad, weights, features, psws, pooling, pads, layout, kind, params)
    states = [embedding_optimizer.table_state(w, kind) for w in weights]
    return weights, states


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(OPTIMIZERS), **GROUPS)
def test_optimizer_step_matches_reference(kind, **group):
    """Repeated ids summed before the update, untouched rows and state unchanged, padding ids touched with a
    zero gradient, Adam's step counted per table."""
    weights, features, psws, pooling, pads, layout, grad = _group(**group)
    got_w, got_s = _run_step("native", kind, weights, features, psws, pooling, pads, layout, grad)
    want_w, want_s = _run_step("reference", kind, weights, features, psws, pooling, pads, layout, grad)
    for g, w in zip(got_w, want_w):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_s, want_s):
        assert g.keys() == w.keys()
        for key in g:
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-6)


def test_sgd_step_is_exactly_the_torch_update():
    """SUM pooling without weights: no fused multiply-add changes the rounding of w + g * -lr."""
    weights, features, psws, pooling, pads, layout, grad = _group(7, 3, 50, 64, 32, 6, SUM, False, None, torch.int64)
    got, _ = _run_step("native", "exact_sgd", weights, features, psws, pooling, pads, layout, grad)
    want, _ = _run_step("reference", "exact_sgd", weights, features, psws, pooling, pads, layout, grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_optimizer_state_dict_round_trip():
    table = torch.nn.EmbeddingBag(30, 4, mode="sum")
    model = torch.nn.ModuleDict({"bag": table})
    features = raw_features([torch.tensor([1, 2, 2, 7])], [torch.tensor([0, 1])], [False])
    params = embedding_optimizer.parse_optimizer(format_optimizer("adam", lr=0.1))[1]
    step = get_kernel(embedding_optimizer.STEP_OP, "native")
    with torch.no_grad():
        step(torch.randn(2, 4), [table.weight], features, [None], [SUM], [-1], "concat", "adam", params)
    saved = embedding_optimizer.state_dict(model)
    assert saved["bag.weight"]["adam"]["step"] == 1 and saved["bag.weight"]["adam"]["exp_avg"][2].abs().sum() > 0
    restored = copy.deepcopy(model)
    embedding_optimizer.load_state_dict(restored, saved)
    again = embedding_optimizer.state_dict(restored)["bag.weight"]["adam"]
    assert again["step"] == 1 and torch.equal(again["exp_avg_sq"], saved["bag.weight"]["adam"]["exp_avg_sq"])
    with pytest.raises(ValueError, match="'bag.weight' \\(adam\\) 'exp_avg' has shape \\(3, 4\\), expected \\(30, 4\\)"):
        embedding_optimizer.load_state_dict(restored, {"bag.weight": {"adam": {**again, "exp_avg": torch.zeros(3, 4)}}})
    with pytest.raises(KeyError, match="no parameter"):
        embedding_optimizer.load_state_dict(restored, {"other.weight": {}})


def test_native_is_the_cpu_lowering_first_choice():
    from recompile.lowering import choose, detect_target

    target = detect_target("cpu")
    assert choose("recompile::grouped_embedding_bag", target).impl == "native"
    assert choose("recompile::embedding_optimizer_step", target).impl == "native"


@pytest.mark.parametrize("ids", [torch.tensor([0, 1]), torch.tensor([], dtype=torch.long)])
def test_empty_offsets_with_last_offset_rejected(ids):
    with pytest.raises(ValueError, match="feature 'clicks': offsets are empty but there are"):
        torch.ops.recompile.grouped_embedding_bag([torch.randn(3, 2)], [ids], [torch.tensor([], dtype=torch.long)],
                                                  [torch.empty(0)], [SUM], [-1], [True], [False], "concat", "clicks",
                                                  "fatal", "native")


@pytest.mark.parametrize("layout, dims", [("stack", (64, 64, 64)), ("concat", (64, 72, 128))])
def test_large_output_streamed_past_the_caches(layout, dims):
    """Outputs over STREAM_BYTES are written with non-temporal stores where a row is 64-byte aligned."""
    gen = torch.Generator().manual_seed(9)
    batch = embedding_native.STREAM_BYTES // (4 * sum(dims)) + 100
    weights = [torch.randn(300, d, generator=gen) for d in dims]
    lengths = [torch.randint(0, 4, (batch,), generator=gen) for _ in dims]
    ids = [torch.randint(0, 300, (int(n.sum()),), generator=gen) for n in lengths]
    offsets = [torch.cumsum(n, 0) - n for n in lengths]
    modes = [SUM, MEAN, SUM]
    got = torch.ops.recompile.grouped_embedding_bag(weights, ids, offsets, [torch.empty(0)] * 3, modes, [-1] * 3,
                                                    [False] * 3, [False] * 3, layout, "a,b,c", "fatal", "native")
    outs = [torch.nn.functional.embedding_bag(i, w, o, mode=("sum", "mean")[m])
            for w, i, o, m in zip(weights, ids, offsets, modes)]
    want = torch.stack(outs, 1) if layout == "stack" else torch.cat(outs, 1)
    assert got.numel() * 4 > embedding_native.STREAM_BYTES
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backward_and_step_skip_bad_offsets():
    """They get what the forward checked; called with bad offsets anyway, they read nothing out of bounds and raise."""
    features = raw_features([torch.tensor([0, 1, 2])], [torch.tensor([0, 5])], [False])
    args = (torch.randn(2, 4), [torch.randn(3, 4)], features, [None], [SUM], [-1], "concat")
    with pytest.raises(RuntimeError, match=r"rejected the offsets of tables \[0\] \(in the backward\)"):
        embedding_native.backward(*args, [False], [False])
    params = embedding_optimizer.parse_optimizer(format_optimizer("exact_sgd"))[1]
    with pytest.raises(RuntimeError, match=r"\(in the optimizer step\)"):
        embedding_native.optimizer_step(*args, "exact_sgd", params)


@pytest.mark.parametrize("layout", ["stack", "concat"])
def test_strided_output_gradient_read_in_place(layout):
    """The gradient of a slice of a larger output (DLRM's cat([x.unsqueeze(1), grouped], 1)) or an expanded one."""
    weights, features, psws, pooling, pads, _, _ = _group(3, 3, 9, 16, 6, 3, SUM, True, 2, torch.int64)
    wider = torch.randn(6, 4, 16) if layout == "stack" else torch.randn(6, 64)
    for grad in (wider[:, 1:] if layout == "stack" else wider[:, 8:56], torch.ones(()).expand(6, 3, 16) if
                 layout == "stack" else torch.ones(()).expand(6, 48)):
        args = (grad, weights, features, psws, pooling, pads, layout, [False, True, False], [True] * 3)
        for g, w in zip(embedding_native.backward(*args), table_gradients(*args)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # one patch for all
@given(sparse=st.lists(st.booleans(), min_size=3, max_size=3), impl=st.sampled_from(["native", "reference"]),
       bounds_check=st.sampled_from(["fatal", "ignore"]), **GROUPS)
def test_autograd_runs_in_cpp(monkeypatch, sparse, impl, bounds_check, **group):
    """On the CPU the op's autograd is the C++ kernel (runtime/csrc/ops.cpp), whatever the kernel: with the Python
    formula made to raise, eager forward and backward give the reference's table gradients (dense, or sparse COO
    where ``sparse``) and per-sample weight gradients, an empty weight tensor its empty gradient."""
    from recompile.runtime import embedding

    def python_formula(*_, **__):
        raise AssertionError("the Python autograd formula ran")

    monkeypatch.setattr(embedding.grouped_embedding_bag, "_backward_fn", python_formula)
    monkeypatch.setattr(embedding.grouped_embedding_bag, "_setup_context_fn", python_formula)
    weights, features, psws, pooling, pads, layout, grad = _group(**group)
    num = len(weights)
    tables = [w.clone().requires_grad_() for w in weights]
    given_psws = [(torch.empty(0) if p is None else p.clone()).requires_grad_() for p in psws]
    out = torch.ops.recompile.grouped_embedding_bag(
        tables, [f.ids for f in features], [f.offsets for f in features], given_psws, pooling, pads, [False] * num,
        sparse[:num], layout, ",".join(f"f{t}" for t in range(num)), bounds_check, impl)
    got = torch.autograd.grad(out, tables + given_psws, grad)
    want = table_gradients(grad, weights, features, psws, pooling, pads, layout, [False] * num,
                           [p is not None for p in psws])
    for t in range(num):
        assert got[t].is_sparse == sparse[t]
        torch.testing.assert_close(got[t].to_dense(), want[t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[num + t], want[num + t] if psws[t] is not None else torch.zeros(0))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # one patch for all
@given(dtype=st.sampled_from([torch.float32, *HALF_TOL]), sparse=st.lists(st.booleans(), min_size=3, max_size=3),
       psw_grad=st.booleans(), strided=st.booleans(), **GROUPS)
def test_backward_op_runs_in_cpp(monkeypatch, dtype, sparse, psw_grad, strided, **group):
    """The backward op with impl "native" is one C++ call (runtime/csrc/ops.cpp): with the op's Python kernels made
    to raise, it gives the reference's dense or per-id table gradients and per-sample weight gradients (empty where
    not asked) for fp32/fp16/bf16 tables, int32/int64 ids, empty bags and batches, one-row tables, a gradient read
    in place from a wider one or copied."""
    from recompile.runtime import embedding

    def python_kernel(*_, **__):
        raise AssertionError("the Python op ran")

    weights, features, psws, pooling, pads, layout, grad = _group(**group)
    weights, grad = [w.to(dtype) for w in weights], grad.to(dtype)
    psws = [None if p is None else p.to(dtype) for p in psws]
    if strided:  # a slice of a wider gradient (rows read in place), or a stack's gradient with strided rows (copied)
        grad = (torch.cat([grad, grad[..., :1]], -1)[..., :-1] if layout != "stack"
                else grad.transpose(1, 2).contiguous().transpose(1, 2))
    num = len(weights)
    wants = [psw_grad and p is not None for p in psws]
    monkeypatch.setattr(embedding, "get_kernel", python_kernel)
    got = torch.ops.recompile.grouped_embedding_bag_backward(
        grad, weights, [f.ids for f in features], [f.offsets for f in features],
        [torch.empty(0, dtype=dtype) if p is None else p for p in psws], pooling, pads, [False] * num, sparse[:num],
        wants, layout, ",".join(f"f{t}" for t in range(num)), "fatal", "native")
    monkeypatch.undo()
    want = table_gradients(grad, weights, features, psws, pooling, pads, layout, sparse[:num], wants)
    assert len(got) == 2 * num
    for t in range(num):
        assert got[t].dtype == dtype and got[t].shape == want[t].shape
        torch.testing.assert_close(got[t], want[t], **HALF_TOL.get(dtype, dict(rtol=1e-5, atol=1e-5)))
        assert got[num + t].shape == (want[num + t].shape if wants[t] else (0,))
        if wants[t]:
            torch.testing.assert_close(got[num + t], want[num + t], **HALF_TOL.get(dtype, dict(rtol=1e-5, atol=1e-5)))


def test_backward_op_bad_offsets_raise():
    """Offsets the C++ backward rejects go on to the Python op, which raises naming the tables."""
    args = (torch.randn(2, 4), [torch.randn(3, 4)], [torch.tensor([0, 1, 2])], [torch.tensor([0, 5])], [torch.empty(0)],
            [SUM], [-1], [False], [False], [False], "concat", "f0", "fatal", "native")
    with pytest.raises(RuntimeError, match=r"rejected the offsets of tables \[0\] \(in the backward\)"):
        torch.ops.recompile.grouped_embedding_bag_backward(*args)
