"""TorchRec EmbeddingBagCollection fed a KeyedJaggedTensor, traced by Dynamo and grouped by the embedding pass."""
import pytest
import torch

import recompile

torchrec = pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

FEATURES = {"user": 30, "item": 50, "city": 12}


class Ranker(torch.nn.Module):
    def __init__(self, pooling=torchrec.PoolingType.SUM):
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=rows, feature_names=[f], pooling=pooling)
                  for f, rows in FEATURES.items()]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.head = torch.nn.Linear(4 * len(FEATURES), 1)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)


def _kjt(batch, gen):
    lengths = torch.randint(0, 4, (len(FEATURES) * batch,), generator=gen)
    counts = lengths.view(len(FEATURES), batch).sum(1).tolist()
    values = torch.cat([torch.randint(0, rows, (n,), generator=gen) for rows, n in zip(FEATURES.values(), counts)])
    return KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths)


def _step(model, kjt):
    model.zero_grad()
    out = model(kjt)
    out.pow(2).sum().backward()
    return out.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pooling", [torchrec.PoolingType.SUM, torchrec.PoolingType.MEAN])
def test_ebc_lookups_grouped_and_equal_to_eager(pooling):
    gen = torch.Generator().manual_seed(0)
    model, kjt = Ranker(pooling), _kjt(6, gen)
    report = recompile.explain(model, kjt).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert len(region["replaced"]) == 2 * len(FEATURES) + 1  # each lookup and its .float(), and the cat
    compiled = torch.compile(model, backend="rec_ascend")
    out_c, grads_c = _step(compiled, kjt)
    out_e, grads_e = _step(model, kjt)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=name)


class SequenceModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        tables = [torchrec.EmbeddingConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=rows, feature_names=[f])
                  for f, rows in FEATURES.items()]
        self.ec = torchrec.EmbeddingCollection(tables=tables, device=torch.device("cpu"))

    def forward(self, kjt):
        out = self.ec(kjt)
        return [out[f].values().sum(1) * (i + 1) for i, f in enumerate(FEATURES)]


def test_embedding_collection_grouped_as_sequence_and_equal_to_eager():
    gen = torch.Generator().manual_seed(1)
    model, kjt = SequenceModel(), _kjt(5, gen)
    report = recompile.explain(model, kjt).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert len(region["replaced"]) == 2 * len(FEATURES)
    assert "'sequence'" in next(s["code"] for s in report["stages"] if s["name"] == "embedding")
    compiled = torch.compile(model, backend="rec_ascend")
    got, want = compiled(kjt), model(kjt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    sum(x.pow(2).sum() for x in got).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(x.pow(2).sum() for x in want).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
