"""The interaction pass: every pattern form is found, replaced by one op, and equal to eager (forward and grads)."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

SMALL = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])


class Interaction(nn.Module):
    """``stack([x] + embs)`` -> T T^T -> pairs picked by one of the spellings practitioners use -> cat."""

    def __init__(self, form: str, num_features: int = 4, dim: int = 6):
        super().__init__()
        self.form, self.num_features = form, num_features
        self.bottom = nn.Linear(5, dim)
        self.embs = nn.Parameter(torch.randn(num_features - 1, 11, dim))
        with_self = num_features * (num_features + 1) // 2
        self.top = nn.Linear(dim + {"self_lower": with_self, "pair_loop_stack": with_self}.get(
            form, num_features * (num_features - 1) // 2), 1)

    def pairs(self, dots: torch.Tensor) -> torch.Tensor:
        n = self.num_features
        if self.form == "triu_indices":
            rows, cols = torch.triu_indices(n, n, offset=1)
            return dots[:, rows, cols]
        if self.form == "tril_indices":
            rows, cols = torch.tril_indices(n, n, offset=-1)
            return dots[:, rows, cols]
        if self.form == "self_lower":  # the original DLRM's loops, with the self-interaction
            li = torch.tensor([i for i in range(n) for j in range(i + 1)])
            lj = torch.tensor([j for i in range(n) for j in range(i + 1)])
            return dots[:, li, lj]
        if self.form == "triu_masked_select":
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
            return torch.masked_select(dots, mask).view(dots.shape[0], -1)
        if self.form == "tril_mask_reshape":
            mask = torch.ones(n, n).tril(-1).bool()
            return dots.masked_select(mask).reshape(-1, n * (n - 1) // 2)
        if self.form == "triu_mask_index":
            return dots[:, torch.triu(torch.ones(n, n, dtype=torch.bool), 1)]
        raise ValueError(self.form)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bottom(dense))
        embs = [table[ids[:, t]] for t, table in enumerate(self.embs)]
        if self.form == "pair_loop":  # products of a feature list, pair by pair, then the final cat
            feats = [x] + embs
            n = len(feats)
            pairs = [(feats[i] * feats[j]).sum(1, keepdim=True) for i in range(n) for j in range(i + 1, n)]
            return self.top(torch.cat([x] + pairs, dim=1))
        if self.form == "pair_loop_stack":  # lower order with the diagonal, stacked
            feats = [x] + embs
            n = len(feats)
            pairs = torch.stack([(feats[i] * feats[j]).sum(-1) for i in range(n) for j in range(i + 1)], dim=1)
            return self.top(torch.cat([x, pairs], dim=1))
        if self.form == "grouped_cat":  # a grouped lookup's [B, T, D] output joined with the dense part
            features = torch.cat([x.unsqueeze(1), torch.stack(embs, 1)], 1)
            rows, cols = torch.triu_indices(self.num_features, self.num_features, 1)
            pairs = torch.bmm(features, features.transpose(1, 2))[:, rows, cols]
        else:
            features = torch.stack([x] + embs, dim=1)
            pairs = self.pairs(torch.bmm(features, features.transpose(1, 2)))
        return self.top(torch.cat([x, pairs], dim=1))


# Boolean-mask spellings have a data-dependent size in general: Dynamo captures them in one graph only with
# capture_dynamic_output_shape_ops (else it breaks the graph before the selection and there is nothing to fuse).
MASKED_FORMS = ["triu_masked_select", "tril_mask_reshape", "triu_mask_index"]
FORMS = ["triu_indices", "tril_indices", "self_lower", *MASKED_FORMS,
         "grouped_cat", "pair_loop", "pair_loop_stack"]


def _inputs(batch=7):
    return torch.randn(batch, 5), torch.randint(0, 11, (batch, 3))


def _run(model, args):
    model.zero_grad()
    out = model(*args)
    out.pow(2).mean().backward()
    return out.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def pipeline_only(gm, example_inputs):
    """The rewritten graph run eagerly (custom ops with their autograd), without Inductor: fast to test."""
    ctx = PassContext(RecompileOptions(verify=True), detect_target("cpu"), example_inputs)
    return run_pipeline(gm, ctx).forward


def _assert_same_training(model, args, backend=pipeline_only):
    out_c, grads_c = _run(torch.compile(model, backend=backend), args)
    out_e, grads_e = _run(model, args)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _regions(model, *args):
    return recompile.explain(model, *args).to_dict()["regions"]


@pytest.mark.parametrize("form", FORMS)
def test_dot_interaction_forms_found_and_equal_eager(form):
    model, args = Interaction(form), _inputs()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=form in MASKED_FORMS):
        [region] = _regions(model, *args)
        assert region["op"] == "recompile::dot_interaction" and region["kind"] == "interaction"
        if form not in ("pair_loop_stack", *MASKED_FORMS):  # (their size checks read the selection: cat stays)
            assert region["replaced"][-1].startswith("cat")  # the final cat([dense, pairs]) is written by the op
        _assert_same_training(model, args)


# Slow: make test keeps the same DLRM's regions (test_interaction_race.py::test_regions_are_those_of_the_graph_that_runs)
# and the zoo DLRM's forward and gradients through rec_ascend (test_models.py zoo[dlrm]).
@pytest.mark.slow
def test_dlrm_of_the_zoo():
    model, args = DLRM(SMALL), synthetic_batch(SMALL, 9)
    ops = [r["op"] for r in _regions(model, *args)]
    assert ops == ["recompile::grouped_embedding_bag", "recompile::dot_interaction"]
    _assert_same_training(model, args, backend=torch._dynamo.lookup_backend("rec_ascend"))


def test_other_pairs_are_left_alone():
    class Diagonal(nn.Module):
        def forward(self, t):
            dots = torch.bmm(t, t.transpose(1, 2))
            idx = torch.arange(t.shape[1])
            return dots[:, idx, idx]  # the diagonal: not an interaction order

    assert _regions(Diagonal(), torch.randn(2, 3, 4)) == []


def test_pairs_selected_over_the_whole_batch_are_each_samples_pairs_reshaped():
    """A triu mask broadcast over [B, F, F] selects every sample's pairs in order: normalize's pairs form is the
    [B, P] dot interaction followed by the user's reshape, and the numbers are eager's."""
    class Flattened(nn.Module):
        def forward(self, t):
            dots = torch.bmm(t, t.transpose(1, 2))
            return torch.masked_select(dots, torch.ones(3, 3, dtype=torch.bool).triu(1)).view(1, -1)

    t = torch.randn(5, 3, 4)
    assert [r["op"] for r in _regions(Flattened(), t)] == ["recompile::dot_interaction"]
    outs, grads = [], []
    for model in (Flattened(), torch.compile(Flattened(), backend="rec_ascend")):
        x = t.clone().requires_grad_()
        outs.append(model(x))
        grads.append(torch.autograd.grad(outs[-1].pow(2).sum(), x)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


class CrossNet(nn.Module):
    """DCN-v2: full-rank and low-rank cross layers, written with nn.Linear, in several spellings."""

    def __init__(self, d=12, rank=3):
        super().__init__()
        self.full = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.v, self.u = nn.Linear(d, rank, bias=False), nn.Linear(rank, d)

    def forward(self, x0):
        x = x0 * self.full[0](x0) + x0
        x = x + self.full[1](x) * x0
        x = x0 * self.u(self.v(x)) + x
        return torch.relu(x).sum(1)


class FM(nn.Module):
    def forward(self, v, flat):
        per_dim = 0.5 * (torch.sum(v, dim=1) ** 2 - torch.sum(v * v, dim=1))
        reduced = (0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1))).sum(1, keepdim=True)
        # torchrec.modules.deepfm.FactorizationMachine
        sum_of_input = torch.sum(flat, dim=1, keepdim=True)
        sum_of_square = torch.sum(flat * flat, dim=1, keepdim=True)
        cross = torch.sum(sum_of_input * sum_of_input - sum_of_square, dim=1, keepdim=True) * 0.5
        return per_dim.sum(1) + reduced.squeeze(1) + cross.squeeze(1)


def test_cross_layers_found_and_equal_eager():
    model, x0 = CrossNet(), torch.randn(9, 12, requires_grad=True)
    regions = _regions(model, x0)
    # the two full-rank layers over one x0 are one stack; the low-rank one differs in form
    assert sorted((r["op"], len(r["replaced"])) for r in regions) == [
        ("recompile::cross_layer", 4), ("recompile::cross_stack", 6)]  # linear(s), mul, add per layer
    _assert_same_training(model, (x0,))
    _assert_same_training(model, (x0,), backend=torch._dynamo.lookup_backend("rec_ascend"))


def test_fm_forms_found_and_equal_eager():
    v, flat = torch.randn(5, 4, 6, requires_grad=True), torch.randn(5, 10, requires_grad=True)
    regions = _regions(FM(), v, flat)
    assert sorted(len(r["replaced"]) for r in regions) == [6, 7, 7] and len(regions) == 3
    assert all(r["op"] == "recompile::fm_second_order" for r in regions)
    compiled = torch.compile(FM(), backend=pipeline_only)
    torch.testing.assert_close(compiled(v, flat), FM()(v, flat), rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(compiled(v, flat).sum(), (v, flat))
    want = torch.autograd.grad(FM()(v, flat).sum(), (v, flat))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepfm_of_the_zoo():
    """DeepFM's ``0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(1, keepdim=True)`` becomes one op."""
    from models.ctr import CTRConfig, DeepFM

    cfg = CTRConfig(table_rows=[30, 40, 50], dim=4, deep=[8])
    model, args = DeepFM(cfg), synthetic_batch(cfg, 6)
    fm = [r for r in _regions(model, *args) if r["op"] == "recompile::fm_second_order"]
    assert len(fm) == 1 and len(fm[0]["replaced"]) == 7  # sum, pow, pow, sum, sub, sum, mul
    _assert_same_training(model, args)


def test_disabled_pass_leaves_interactions():
    model, args = Interaction("triu_indices"), _inputs()
    report = recompile.explain(model, *args, options={"passes": {"interaction": False}})
    assert report.to_dict()["regions"] == []


def test_batch_size_changes_compile_at_most_twice():
    model = Interaction("tril_indices")
    counter = CompileCounterWithBackend(pipeline_only)
    compiled = torch.compile(model, backend=counter)
    for batch in (1, 8, 13, 21, 34):
        args = _inputs(batch)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


def test_native_kernels_train_through_inductor():
    """With autotune off the lowering's first CPU choice (the native kernels, when a C compiler is present)
    goes through aot_autograd and Inductor: every backward is an opaque op, never traced into."""
    import functools

    from recompile.backend import rec_ascend

    backend = functools.partial(rec_ascend, options={"autotune": False})
    _assert_same_training(Interaction("triu_indices"), _inputs(), backend=backend)
    _assert_same_training(CrossNet(), (torch.randn(9, 12, requires_grad=True),), backend=backend)
    v, flat = torch.randn(5, 4, 6, requires_grad=True), torch.randn(5, 10, requires_grad=True)
    got = torch.autograd.grad(torch.compile(FM(), backend=backend)(v, flat).sum(), (v, flat))
    torch.testing.assert_close(got, torch.autograd.grad(FM()(v, flat).sum(), (v, flat)), rtol=1e-5, atol=1e-5)
