"""TorchRec EmbeddingBagCollection fed a KeyedJaggedTensor, traced by Dynamo and grouped by the embedding pass."""
import pytest
import torch

import recompile

torchrec = pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

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
    assert len(region["replaced"]) == 2 * len(FEATURES)  # each lookup and its .float()
    compiled = torch.compile(model, backend="rec_ascend")
    out_c, grads_c = _step(compiled, kjt)
    out_e, grads_e = _step(model, kjt)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=name)
