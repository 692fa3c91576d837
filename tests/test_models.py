"""Every zoo model compiles with rec_ascend, matches eager forward and backward, and does not recompile per batch;
eager and rec_ascend training give the same loss curve."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from models import train
from models.metrics import ranking_metrics
from models.retrieval import TwoTowerConfig
from models.zoo import MODELS, two_tower

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")


def _loss_and_grads(model, workload, inputs):
    model.zero_grad()
    loss = workload.loss(model(*inputs))
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


# Four heavy compiles run with `make test-slow`: their paths are covered in `make test` by the SASRec layer
# (tests/test_jagged_pass.py) and the corpus's SASRec, TorchRec's DLRM (tests/test_embedding_torchrec.py, the
# corpus), the two-tower zoo model, and the zoo's dcn_v2 with test_interaction_cross.py's low-rank DCN-v2.
SLOW_ZOO = {"sasrec", "dlrm_torchrec", "two_tower_mol", "dcn_v2_lowrank_parallel"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ZOO else n for n in sorted(MODELS)])
def test_zoo_model_compiles_and_matches_eager(name):
    workload = MODELS[name]("small")
    model = workload.model.eval()  # dropout off: eager and compiled draw different random numbers
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    loss_c, grads_c = _loss_and_grads(compiled, workload, workload.mark_dynamic())
    loss_e, grads_e = _loss_and_grads(model, workload, workload.inputs)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for param in grads_e:
        torch.testing.assert_close(grads_c[param], grads_e[param], rtol=1e-4, atol=1e-5, msg=param)
    # other batch sizes (and jagged totals) run on the same graph; a KeyedJaggedTensor's batch size is a Python
    # int, so TorchRec's input compiles once more, dynamic in the batch (Dynamo's automatic dynamic shapes)
    for seed, batch in [(1, 5), (2, 7)]:
        other = MODELS[name]("small", seed=seed, batch=batch)
        torch.testing.assert_close(compiled(*other.mark_dynamic()), model(*other.inputs), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == (2 if name == "dlrm_torchrec" else 1), f"{name} compiled {counter.frame_count} times"


@pytest.mark.slow
def test_eager_and_rec_ascend_loss_curves_match():
    # dropout 0: Inductor's random numbers differ from eager's
    argv = ["--model", "hstu", "--dim", "16", "--max-len", "12", "--batch-size", "32", "--lr", "5e-4", "--dropout", "0",
            "--in-batch-negatives", "16", "--sampled-negatives", "16", "--max-steps", "30", "--quiet"]
    eager = train.run_training(train.parser().parse_args(argv + ["--backend", "eager"]))["losses"]
    compiled = train.run_training(train.parser().parse_args(argv + ["--backend", "rec_ascend"]))["losses"]
    assert len(eager) == len(compiled) == 30
    eager, compiled = torch.tensor(eager), torch.tensor(compiled)
    assert eager[-10:].mean() < eager[:10].mean() - 0.3  # it trains
    rel = ((compiled - eager).abs() / eager.abs()).max().item()
    assert rel < 1e-4, f"loss curves differ by {rel:.2e} (relative)"


@pytest.mark.parametrize("name", ["dlrm", "deepfm"])
def test_dynamic_embeddings_compile_and_train(name):
    """Sparse tables as hkv hash tables: compiled forward equals eager, and compiled training steps lower the loss."""
    workload = MODELS[name]("small", dynamic_embeddings=True)
    model = workload.model.train()
    assert "DynamicEmbeddingBag" in repr(model.embeddings[0])
    expected = model(*workload.inputs).detach()  # inserts the ids (initialised rows)
    compiled = torch.compile(model, backend="rec_ascend")
    torch.testing.assert_close(compiled(*workload.mark_dynamic()), expected, rtol=1e-5, atol=1e-5)
    losses = []
    for _ in range(5):
        loss = workload.loss(compiled(*workload.inputs))
        loss.backward()  # the hkv tables apply their fused SGD update to the looked-up rows
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_dynamic_embeddings_rejected_where_meaningless():
    with pytest.raises(ValueError, match="'hstu' has no dynamic-embedding variant; models with one: dlrm"):
        MODELS["hstu"]("small", dynamic_embeddings=True)


def test_two_tower_heads():
    """dot: cosine of the towers' outputs over the temperature; MoL: a gated (convex) mix of component cosines,
    so within +-1/temperature, and different from the dot head on the same embeddings."""
    torch.manual_seed(0)
    users, history, offsets = torch.tensor([0, 3]), torch.tensor([1, 2, 5]), torch.tensor([0, 2])
    items = torch.arange(1, 8)
    dot, mol = two_tower("two_tower", 4, 7, 8).eval(), two_tower("two_tower_mol", 4, 7, 8).eval()
    mol.load_state_dict(dot.state_dict(), strict=False)  # same embeddings and towers
    user, item = dot.user_embeddings(users, history, offsets), dot.item_embeddings(items)
    assert user.shape == (2, 3, 8) and item.shape == (7, 2, 8)
    cosine = torch.nn.functional.cosine_similarity(user[:, None, 0], item[None, :, 0], dim=-1)
    torch.testing.assert_close(dot(users, history, offsets, items), cosine / dot.cfg.temperature)
    logits = mol(users, history, offsets, items)
    assert logits.shape == (2, 7) and logits.abs().max() <= 1 / mol.cfg.temperature
    assert not torch.allclose(logits, cosine / mol.cfg.temperature)
    with pytest.raises(ValueError, match=r"tower must end in dim=8 \(got \[16, 4\]\)"):
        TwoTowerConfig(dim=8, tower=[16, 4])


@pytest.mark.slow
def test_ranks_and_curve_on_the_held_out_item():
    """Per-user ranks of the held-out item come with the metrics, and --eval-every-epoch records the curve."""
    argv = ["--model", "two_tower", "--epochs", "2", "--batch-size", "4096", "--max-len", "5", "--dim", "8",
            "--sampled-negatives", "16", "--eval-split", "valid", "--eval-every-epoch", "--backend", "eager", "--quiet"]
    result = train.run_training(train.parser().parse_args(argv))
    ranks = torch.tensor(result["ranks"])
    assert ranks.shape == (943,) and ranks.min() >= 0 and ranks.max() < 1682
    assert result["metrics"] == ranking_metrics(ranks)
    assert [c["epoch"] for c in result["curve"]] == [1, 2]
    assert result["curve"][-1]["metrics"] == result["metrics"]  # the last epoch's evaluation is the final one
    assert result["curve"][0]["mean_loss"] > result["curve"][1]["mean_loss"]
