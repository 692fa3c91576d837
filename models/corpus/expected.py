"""What rec_ascend should find in each corpus model, and why: the table the corpus tests and benchmark check.

``EXPECTED[model]`` lists the rec regions the model's code contains (each FM, cross net, dot interaction,
grouped lookup, jagged attention and GRU), as (region kind, the ops that may implement it, at least how many, why).
``GRAPH_BREAKS[model or case]`` is how many graph breaks Dynamo must log in it (``recompile.explain``'s breaks), and
why; every other model must compile as one graph. An entry's ``track`` names the work that builds its recognition where main does not find it yet: its
test is ``xfail(strict=True)``, so it fails loudly once that work lands and the mark should go.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import gr_hstu, recbole_zoo, torchrec_zoo


CROSS_OPS = ("recompile::cross_layer", "recompile::cross_stack", "recompile::cross_mixture")


@dataclass(frozen=True)
class Expect:
    kind: str  # the region kind (recompile.pipeline.REGION_KINDS)
    ops: tuple[str, ...] | None  # the ops that may implement it; None: any op of the kind
    count: int  # at least this many such regions
    why: str  # where in the model's code the region is
    track: str | None = None  # not found by main yet: who builds it

    def found(self, regions) -> int:
        """How many of ``regions`` ((kind, op) -> count) meet this expectation."""
        return sum(n for (kind, op), n in regions.items() if kind == self.kind and (self.ops is None or op in self.ops))

    @property
    def label(self) -> str:
        return f"{self.count}x {self.kind}" + (f" {'|'.join(o.split('::')[1] for o in self.ops)}" if self.ops else "")


def fm(why: str) -> Expect:
    return Expect("interaction", ("recompile::fm_second_order",), 1, why)


def cross(why: str, track: str | None = None) -> Expect:
    return Expect("interaction", CROSS_OPS, 1, why, track)


def vector_cross(why: str) -> Expect:
    return Expect("interaction", ("recompile::vector_cross",), 1, why)


def gru(why: str) -> Expect:
    return Expect("recurrent", ("recompile::gru",), 1, why)


LOOKUPS = Expect("embedding", ("recompile::grouped_embedding_bag",), 1,
                 "EmbeddingBagCollection: one pooled lookup per table, grouped into one call")
MEAN_BAG = Expect("embedding", ("recompile::grouped_embedding_bag",), 1,
                  "ContextRecommender.embed_token_seq_fields: the genre list ('class', token_seq) is an nn.Embedding "
                  "lookup then a mean over the non-zero ids (mask = seq != 0, sum / count): an embedding bag (SUM "
                  "with padding_idx 0, RecBole's own division after it)")

# Counted with MEAN_BAG (one op, so at least two regions of it): the genre bag's call and this one.
FIELDS = Expect("embedding", ("recompile::grouped_embedding_bag",), 2,
                "FMEmbedding (token fields' ids plus their offsets in one table) and FMFirstOrderLinear's width-1 "
                "table read with the same [B, F] ids: one grouped call of both, beside the genre bag's")

EXPECTED: dict[str, tuple[Expect, ...]] = {
    # RecBole context-aware models: every one embeds the genre list through embed_token_seq_fields.
    "recbole/FM": (fm("BaseFactorizationMachine: 0.5 * (sum(v, 1)^2 - sum(v^2, 1)) summed over the embedding"), MEAN_BAG,
                   FIELDS),
    "recbole/DeepFM": (fm("BaseFactorizationMachine, the FM half of DeepFM"), MEAN_BAG, FIELDS),
    "recbole/NFM": (fm("BaseFactorizationMachine(reduce_sum=False): the bi-interaction pooling under NFM's MLP"),
                    MEAN_BAG, FIELDS),
    "recbole/DCN": (vector_cross("DCN.cross_network: x_l+1 = x0 * tensordot(x_l, w_l) + b_l + x_l, raw Parameters "
                                 "(a vector cross layer), cross_layer_num layers in one op"), MEAN_BAG),
    "recbole/DCNV2": (cross("DCNV2.cross_network: x_l+1 = x0 * (matmul(W_l, x_l.unsqueeze(2)) + b_l) + x_l, raw "
                            "Parameters, cross_layer_num layers"), MEAN_BAG),
    "recbole/PNN": (Expect("interaction", ("recompile::dot_interaction",), 1,
                           "InnerProductLayer: (feat_emb[:, row] * feat_emb[:, col]).sum(-1) over the upper-triangle "
                           "pairs built by Python loops: a dot interaction"), MEAN_BAG),
    "recbole/WideDeep": (MEAN_BAG, FIELDS),
    "recbole/xDeepFM": (MEAN_BAG, FIELDS),  # CIN: outer products through conv1d, no region of ours
    "recbole/AutoInt": (Expect("attention", ("recompile::padded_softmax_attention",), 1,
                               "AutoInt.self_attns: nn.MultiheadAttention over the F fields, no mask, weights unused "
                               "(eval: its attention dropout is off), one per layer: the dense path of the padded "
                               "attention op between the in- and out-projections"), MEAN_BAG, FIELDS),
    "recbole/AFM": (MEAN_BAG, FIELDS),  # pairwise element-wise products weighted by attention, not summed: no dot region
    "recbole/FwFM": (MEAN_BAG, FIELDS),  # pairwise dots weighted per field pair: no plain dot region
    # RecBole sequential models: padded histories [B, MAX_ITEM_LIST_LENGTH], padding id 0.
    "recbole/SASRec": (Expect("attention", None, recbole_zoo.SMALL["n_layers"],
                              "TransformerEncoder: causal softmax attention per layer over the padded history, additive "
                              "mask from item_seq != 0 (get_attention_mask); read at item_seq_len - 1 (gather_indexes), "
                              "so only the query rows up to the longest read history are computed"),),
    "recbole/BERT4Rec": (Expect("attention", None, recbole_zoo.SMALL["n_layers"],
                                "TransformerEncoder: bidirectional softmax attention per layer over the padded history, "
                                "additive mask from item_seq != 0"),),
    "recbole/GRU4Rec": (gru("GRU4Rec.gru_layers: nn.GRU(embedding_size, hidden_size, batch_first=True) over the "
                            "history's embeddings"),),
    "recbole/Caser": (),  # convolutions over the history's embedding matrix
    "recbole/NARM": (gru("NARM.gru: nn.GRU(embedding_size, hidden_size, n_layers, batch_first=True) under its "
                         "additive attention"),),
    # TorchRec models and modules, EmbeddingBagCollection + KeyedJaggedTensor inputs.
    "torchrec/DLRM": (LOOKUPS, Expect("interaction", ("recompile::dot_interaction",), 1,
                                      "InteractionArch: bmm of [dense, sparse] with its transpose, the pairs picked "
                                      "with triu_indices(F + 1, offset=1)")),
    "torchrec/DLRM_DCN": (LOOKUPS, cross("InteractionDCNArch: LowRankCrossNet, x0 * (W (V x) + b) + x with the "
                                         "weights in ParameterLists, dcn_num_layers layers")),
    "torchrec/DeepFM": (LOOKUPS, fm("FactorizationMachine: the flattened FM over the pooled embeddings")),
    "torchrec/CrossNet": (LOOKUPS, cross("CrossNet: x0 * (W x + b) + x, W in a ParameterList (matmul form)")),
    "torchrec/LowRankCrossNet": (LOOKUPS, cross("LowRankCrossNet: x0 * (W (V x) + b) + x")),
    "torchrec/VectorCrossNet": (LOOKUPS, vector_cross("VectorCrossNet: x0 * (x . w) + b + x in its [B, N, 1] column "
                                                      "form, a vector weight per layer, both layers in one op")),
    "torchrec/LowRankMixtureCrossNet": (LOOKUPS, cross("LowRankMixtureCrossNet: gated experts x0 * (U g(C g(V x))) + "
                                                       "b mixed by a softmax gate (DCN-Mix)")),
    # generative-recommenders' HSTU (gr_hstu): jagged q/k/v padded with fbgemm.jagged_to_padded_dense.
    "gr/HSTU": (Expect("attention", ("recompile::hstu_attention",), gr_hstu.LAYERS,
                       "_hstu_attention: silu(einsum(q, k) + bias) / n * causal mask, einsum with v, per layer (q, k padded with "
                       "keyword arguments; the bias moved into place by pad/repeat/slices; the mask a module buffer)"),),
}

GRAPH_BREAKS: dict[str, tuple[int, str, str | None]] = {
    **dict.fromkeys(("recbole/GRU4Rec", "recbole/NARM"), (
        0, "nn.GRU: Dynamo breaks the graph there without allow_rnn; rec_ascend's tracing context sets it", None)),
    "gr/HSTU": (0, "fbgemm.dense_to_jagged has a data-dependent output shape: Dynamo stops there without "
                   "capture_dynamic_output_shape_ops, splitting the attention region; rec_ascend's tracing context sets it", None),
    "recbole/BERT4Rec:full_sort": (2, "reconstruct_test_data writes the mask token per row in a Python loop, "
                                      "item_seq[batch_id][last_position] with a position read from the data: Dynamo "
                                      "breaks there and runs that function eagerly, under any backend", None),
}


# Cases of the wider corpus (``harness.WIDE_CASES``) whose compiled numbers differ from eager's as under plain
# torch.compile (any backend), and why.
DIFFERENCES: dict[str, str] = {
    "recbole/FiGNN:loss": "torch.compile gives W_attn a zero gradient where eager gives none: FiGNN stores an attention "
                          "graph its one layer does not use on self.graph, which Dynamo returns from the graph",
}


def graph_breaks(case: str) -> tuple[int, str, str | None]:
    """The breaks expected in ``case`` ("recbole/BERT4Rec:full_sort"): its own entry, else its model's."""
    return GRAPH_BREAKS.get(case, GRAPH_BREAKS.get(case.split(":")[0], (0, "", None)))


assert set(EXPECTED) == {f"recbole/{n}" for n in recbole_zoo.CONTEXT + recbole_zoo.SEQUENTIAL} | {
    f"torchrec/{n}" for n in torchrec_zoo.MODELS} | {"gr/HSTU"}, "every corpus model has its row"


# Beyond the corpus: the regions rec_ascend must find in TorchRec's other modules (``torchrec_zoo.WIDE``).
WIDE_EXPECTED: dict[str, tuple[Expect, ...]] = {
    "torchrec/DeepFMModules": (LOOKUPS, fm("modules.deepfm.FactorizationMachine over each feature's pooled [B, 1, D] "
                                           "embedding, flattened and concatenated")),
    "torchrec/MLP": (LOOKUPS,),  # modules.mlp.MLP: linear layers and swish + layer norm, no region of ours
    "torchrec/EmbeddingCollection": (Expect("embedding", ("recompile::grouped_embedding_bag",), 1,
                                            "EmbeddingCollection: one nn.Embedding lookup per table of the KJT's values "
                                            "(no pooling), grouped into one call"),),
    "torchrec/PositionWeighted": (Expect("embedding", ("recompile::grouped_embedding_bag",), 1,
                                         "FeatureProcessedEmbeddingBagCollection: each id weighted by its position "
                                         "(PositionWeightedModule), pooled per table with per-sample weights, grouped"),),
    "torchrec/TransformerDLRM": (LOOKUPS, Expect("attention", ("recompile::padded_softmax_attention",), 1,
                                                 "InteractionTransformerArch: nn.TransformerEncoder's multi-head "
                                                 "attention over the [B, F + 1, D] embeddings, no mask")),
}

assert set(WIDE_EXPECTED) == {f"torchrec/{n}" for n in torchrec_zoo.WIDE}, "every TorchRec wide model has its row"
