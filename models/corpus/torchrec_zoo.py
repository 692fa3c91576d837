"""TorchRec's models and cross-net modules, unmodified, fed an ``EmbeddingBagCollection`` + ``KeyedJaggedTensor``.

``torchrec.models.dlrm.DLRM`` / ``DLRM_DCN`` and ``torchrec.models.deepfm.SimpleDeepFMNN`` are used as they are.
The ``torchrec.modules.crossnet`` modules are layers, not models: each sits in ``CrossRanker``, the smallest model
around it the way DLRM-DCN uses its cross net (pooled lookups and a dense projection, concatenated, crossed, then
one linear layer).
"""
from __future__ import annotations

import torch
import torch.nn as nn

FEATURES = {"user": 40, "item": 60, "city": 12, "device": 7}  # feature -> table rows
DIM = 8  # embedding dim (DLRM: also the dense arch's output)
DENSE = 6  # dense features
CROSSNETS = ("CrossNet", "LowRankCrossNet", "VectorCrossNet", "LowRankMixtureCrossNet")
MODELS = ("DLRM", "DLRM_DCN", "DeepFM", *CROSSNETS)


def torchrec():
    import torchrec as tr

    return tr


def collection() -> nn.Module:
    tr = torchrec()
    tables = [tr.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
              for f, rows in FEATURES.items()]
    return tr.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def crossnet(name: str, in_features: int) -> nn.Module:
    from torchrec.modules import crossnet as cn

    return {
        "CrossNet": lambda: cn.CrossNet(in_features, num_layers=2),
        "LowRankCrossNet": lambda: cn.LowRankCrossNet(in_features, num_layers=2, low_rank=4),
        "VectorCrossNet": lambda: cn.VectorCrossNet(in_features, num_layers=2),
        "LowRankMixtureCrossNet": lambda: cn.LowRankMixtureCrossNet(in_features, num_layers=2, num_experts=2, low_rank=4),
    }[name]()


class CrossRanker(nn.Module):
    """Pooled lookups and a projected dense vector, concatenated, through a TorchRec cross net, to one logit."""

    def __init__(self, cross: str):
        super().__init__()
        self.ebc = collection()
        self.dense = nn.Linear(DENSE, DIM)
        width = DIM * (len(FEATURES) + 1)
        self.cross = crossnet(cross, width)
        self.head = nn.Linear(width, 1)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        x = torch.cat([self.dense(dense), self.ebc(sparse).values()], dim=1)
        return self.head(self.cross(x))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in CROSSNETS:
        return CrossRanker(name)
    from torchrec.models import deepfm, dlrm

    if name == "DLRM":
        return dlrm.DLRM(collection(), DENSE, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    if name == "DLRM_DCN":
        return dlrm.DLRM_DCN(collection(), DENSE, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                             dcn_num_layers=2, dcn_low_rank_dim=4)
    if name == "DeepFM":
        return deepfm.SimpleDeepFMNN(DENSE, collection(), hidden_layer_size=16, deep_fm_dimension=DIM)
    raise KeyError(f"no TorchRec corpus model {name!r}; known: {', '.join(MODELS)}")


def batch(size: int, seed: int = 0) -> tuple:
    """(dense features, KeyedJaggedTensor of 0-3 ids per bag (empty bags included), 0/1 labels)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES), size), generator=gen)
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=gen)
                        for rows, n in zip(FEATURES.values(), lengths.sum(1))])
    kjt = torchrec().KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths.view(-1))
    dense = torch.randn(size, DENSE, generator=gen)
    labels = torch.randint(0, 2, (size,), generator=gen).float()
    return dense, kjt, labels
