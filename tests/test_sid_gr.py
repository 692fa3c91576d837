"""models.sid_gr: the decoder trains compiled with rec_ascend as eager does; beam search over the item trie
yields only items, equals exhaustive scoring at beam = corpus size, and each decode step compiles once."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from models.semantic_ids import rq_kmeans
from models.sid_gr import SIDGR, CodeTrie, SIDGRConfig, beam_search

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

NUM_ITEMS = 40


def _model(levels=3, codebook=3, seed=0, layers=2):
    torch.manual_seed(seed)
    sid = rq_kmeans(torch.randn(NUM_ITEMS, 8), levels, codebook, seed=seed)
    cfg = SIDGRConfig(num_items=NUM_ITEMS, dim=16, num_layers=layers, num_heads=2, max_history=6, dropout=0.0)
    return SIDGR(cfg, CodeTrie(sid.codes, sid.codebook_sizes)), sid


def _histories(batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (batch,), generator=g)
    history = torch.randint(1, NUM_ITEMS + 1, (batch, 6), generator=g)
    history[torch.arange(6) >= lengths.view(-1, 1)] = 0
    return history, lengths


def test_every_generated_item_is_a_valid_item_with_its_own_score():
    model, sid = _model()
    model.eval()
    history, lengths = _histories()
    result = beam_search(model, history, lengths, beams=8, k=8)
    assert ((result.items >= 1) & (result.items <= NUM_ITEMS)).all()
    assert all(len(set(row)) == len(row) for row in result.items.tolist())
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()
    exhaustive = model.exhaustive_scores(history, lengths)
    torch.testing.assert_close(result.scores, exhaustive.gather(1, result.items - 1), rtol=1e-5, atol=1e-5)


def test_beam_of_corpus_size_equals_exhaustive_scoring():
    model, _ = _model(levels=2, codebook=4, seed=2)
    model.eval()
    history, lengths = _histories(seed=3)
    result = beam_search(model, history, lengths, beams=NUM_ITEMS, k=NUM_ITEMS)
    want = model.exhaustive_scores(history, lengths).sort(1, descending=True)
    torch.testing.assert_close(result.scores, want.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(result.items.sort(1).values, torch.arange(1, NUM_ITEMS + 1).expand(3, -1))


def test_a_trie_with_fewer_items_than_beams_marks_the_rest():
    model, _ = _model(levels=2, codebook=4)
    model.eval()
    result = beam_search(model, *_histories(), beams=NUM_ITEMS + 5, k=NUM_ITEMS + 5)
    assert (result.items[:, NUM_ITEMS:] == -1).all() and (result.items[:, :NUM_ITEMS] >= 1).all()


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_kernels_agree(impl):
    model, _ = _model()
    model.eval()
    history, lengths = _histories()
    want = beam_search(model, history, lengths, beams=6, k=6, impl="cpu")
    got = beam_search(model, history, lengths, beams=6, k=6, impl=impl)
    assert torch.equal(got.items, want.items)
    torch.testing.assert_close(got.scores, want.scores)


def test_decode_step_is_captured_once_for_every_step():
    model, _ = _model(levels=4, codebook=2)  # 4 or 5 levels: 3+ decode steps through one graph
    model.eval()
    counter = CompileCounter()  # what Dynamo captures decides recompiles; rec_ascend runs it in models.bench_sid
    step = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    history, lengths = _histories()
    got = beam_search(model, history, lengths, beams=8, k=5, step=step)
    again = beam_search(model, *_histories(seed=5), beams=8, k=5, step=step)
    assert model.levels - 1 >= 3 and counter.frame_count == 1
    want = beam_search(model, history, lengths, beams=8, k=5)
    assert torch.equal(got.items, want.items) and (again.items >= 1).all()
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_training_compiled_with_rec_ascend_matches_eager():
    model, sid = _model(layers=1)
    history, lengths = _histories(batch=5)
    codes = sid.codes[torch.randint(0, NUM_ITEMS, (5,))]
    compiled = torch.compile(model, backend="rec_ascend")
    want = model(history, lengths, codes)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = compiled(history, lengths, codes)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_trie_refuses_shared_code_tuples():
    with pytest.raises(ValueError, match="CodeTrie: two items share"):
        CodeTrie(torch.tensor([[0, 1], [0, 1]]), [1, 2])


def test_settings_are_chosen_on_the_validation_item_only(monkeypatch):
    """``--tune``: every (features, codebook) of the grid is trained and ranked on the validation item, the best
    NDCG@10 is chosen, and the test item is never looked at; "hstu" features are a trained HSTU's item table."""
    import argparse

    from models import data as D
    from models import sid_gr
    from models.train import parser as train_parser

    split = D.leave_one_out(D.load_ratings())
    asked = []
    real = D.LeaveOneOut.held_out
    monkeypatch.setattr(D.LeaveOneOut, "held_out", lambda self, which: asked.append(which) or real(self, which))
    settings = train_parser().parse_args(["--data", "ml-100k", "--backend", "eager", "--max-steps", "2", "--quiet",
                                          "--dim", "16", "--num-layers", "1", "--num-heads", "1", "--batch-size", "64"])
    args = argparse.Namespace(seeds=[0], levels=2, codebook=32, features="svd", beams=4,
                              grid_features=["svd", "hstu"], grid_codebook=[4])
    features = sid_gr.FeatureTables(split, 8, settings, hstu_epochs=1)
    trials, chosen = sid_gr.tune(args, settings, split, features)
    assert [(t["features"], t["codebook"]) for t in trials] == [("svd", 4), ("hstu", 4)]
    best = max(trials, key=lambda t: (t["metrics"]["NDCG@10"], t["metrics"]["HR@10"]))
    assert chosen == {"features": best["features"], "codebook": best["codebook"]}
    assert set(asked) == {"valid"}, asked
    hstu = features("hstu", 0)
    assert hstu.shape == (split.num_items, 16)  # the HSTU's item table (dim 16), not the rank-8 SVD
    torch.testing.assert_close(hstu.norm(dim=1), torch.ones(split.num_items))
