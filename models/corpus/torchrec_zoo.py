"""TorchRec's models and cross-net modules, unmodified, fed an ``EmbeddingBagCollection`` + ``KeyedJaggedTensor``.

``torchrec.models.dlrm.DLRM`` / ``DLRM_DCN`` and ``torchrec.models.deepfm.SimpleDeepFMNN`` are used as they are.
The ``torchrec.modules.crossnet`` modules are layers, not models: each sits in ``CrossRanker``, the smallest model
around it the way DLRM-DCN uses its cross net (pooled lookups and a dense projection, concatenated, crossed, then
one linear layer).

Beyond the corpus (``WIDE``: checked, not benchmarked), the TorchRec modules its models do not use, each in the
smallest ranker around it: ``modules.deepfm.DeepFM`` and ``FactorizationMachine`` side by side over the pooled
lookups, ``modules.mlp.MLP`` with its ``swish_layernorm`` activation, ``EmbeddingCollection``'s sequence embeddings
(``JaggedTensor.to_padded_dense``, mean-pooled), position-weighted bags
(``FeatureProcessedEmbeddingBagCollection`` with a ``PositionWeightedModuleCollection``), and
``models.experimental.transformerdlrm.DLRM_Transformer`` as it is.
"""
from __future__ import annotations

import torch
import torch.nn as nn

FEATURES = {"user": 40, "item": 60, "city": 12, "device": 7}  # feature -> table rows
DIM = 8  # embedding dim (DLRM: also the dense arch's output)
DENSE = 6  # dense features
CROSSNETS = ("CrossNet", "LowRankCrossNet", "VectorCrossNet", "LowRankMixtureCrossNet")
MODELS = ("DLRM", "DLRM_DCN", "DeepFM", *CROSSNETS)
WIDE = ("DeepFMModules", "MLP", "EmbeddingCollection", "PositionWeighted", "TransformerDLRM")
MAX_IDS = 3  # ids per bag in ``batch``: the padded length of a sequence, the positions weighted


def torchrec():
    import torchrec as tr

    return tr


def collection(weighted: bool = False) -> nn.Module:
    tr = torchrec()
    tables = [tr.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
              for f, rows in FEATURES.items()]
    return tr.EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))


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


class DeepFMRanker(nn.Module):
    """``modules.deepfm.DeepFM`` (an MLP over the flattened embeddings) and ``FactorizationMachine`` on the pooled
    lookups, each feature's [B, 1, D], beside the projected dense vector, to one logit."""

    def __init__(self):
        super().__init__()
        from torchrec.modules.deepfm import DeepFM, FactorizationMachine
        from torchrec.modules.mlp import MLP

        self.ebc = collection()
        self.deep = DeepFM(dense_module=MLP(len(FEATURES) * DIM, [16, 8]))
        self.fm = FactorizationMachine()
        self.dense = nn.Linear(DENSE, DIM)
        self.head = nn.Linear(8 + 1 + DIM, 1)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        pooled = self.ebc(sparse)
        embeddings = [pooled[f].unsqueeze(1) for f in FEATURES]
        return self.head(torch.cat([self.deep(embeddings), self.fm(embeddings), self.dense(dense)], dim=1))


class MLPRanker(nn.Module):
    """Dense features and pooled lookups through ``modules.mlp.MLP`` (swish + layer norm) to one logit."""

    def __init__(self):
        super().__init__()
        from torchrec.modules.mlp import MLP

        self.ebc = collection()
        self.mlp = MLP(len(FEATURES) * DIM + DENSE, [16, 8, 1], activation="swish_layernorm")

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return self.mlp(torch.cat([dense, self.ebc(sparse).values()], dim=1))


class SequenceRanker(nn.Module):
    """``EmbeddingCollection``'s per-id embeddings of each feature, padded to ``MAX_IDS`` and mean-pooled over the
    ids present, with the projected dense vector, to one logit."""

    def __init__(self):
        super().__init__()
        tr = torchrec()
        tables = [tr.EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
                  for f, rows in FEATURES.items()]
        self.ec = tr.EmbeddingCollection(tables=tables, device=torch.device("cpu"))
        self.dense = nn.Linear(DENSE, DIM)
        self.head = nn.Linear(DIM * (len(FEATURES) + 1), 1)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        sequences = self.ec(sparse)
        pooled = [sequences[f].to_padded_dense(MAX_IDS).sum(1) / sequences[f].lengths().clamp(min=1).unsqueeze(1)
                  for f in FEATURES]
        return self.head(torch.cat([self.dense(dense), *pooled], dim=1))


class PositionWeightedRanker(nn.Module):
    """Bags weighted by each id's position (``FeatureProcessedEmbeddingBagCollection``, weights drawn away from
    their initial ones), with the dense features, to one logit."""

    def __init__(self):
        super().__init__()
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        positions = PositionWeightedModuleCollection(dict.fromkeys(FEATURES, MAX_IDS))
        with torch.no_grad():
            for weight in positions.position_weights.values():
                weight.uniform_(0.5, 1.5)
        self.fp = FeatureProcessedEmbeddingBagCollection(collection(weighted=True), positions)
        self.head = nn.Linear(DIM * len(FEATURES) + DENSE, 1)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return self.head(torch.cat([dense, self.fp(sparse).values()], dim=1))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in CROSSNETS:
        return CrossRanker(name)
    rankers = {"DeepFMModules": DeepFMRanker, "MLP": MLPRanker, "EmbeddingCollection": SequenceRanker,
               "PositionWeighted": PositionWeightedRanker}
    if name in rankers:
        return rankers[name]()
    from torchrec.models import deepfm, dlrm

    if name == "DLRM":
        return dlrm.DLRM(collection(), DENSE, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    if name == "DLRM_DCN":
        return dlrm.DLRM_DCN(collection(), DENSE, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                             dcn_num_layers=2, dcn_low_rank_dim=4)
    if name == "DeepFM":
        return deepfm.SimpleDeepFMNN(DENSE, collection(), hidden_layer_size=16, deep_fm_dimension=DIM)
    if name == "TransformerDLRM":
        from torchrec.models.experimental.transformerdlrm import DLRM_Transformer

        return DLRM_Transformer(collection(), DENSE, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                                nhead=2, ntransformer_layers=1).eval()  # eval: dropout off
    raise KeyError(f"no TorchRec corpus model {name!r}; known: {', '.join(MODELS + WIDE)}")


def batch(size: int, seed: int = 0) -> tuple:
    """(dense features, KeyedJaggedTensor of 0-3 ids per bag (empty bags included), 0/1 labels)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, MAX_IDS + 1, (len(FEATURES), size), generator=gen)
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=gen)
                        for rows, n in zip(FEATURES.values(), lengths.sum(1))])
    kjt = torchrec().KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths.view(-1))
    dense = torch.randn(size, DENSE, generator=gen)
    labels = torch.randint(0, 2, (size,), generator=gen).float()
    return dense, kjt, labels
