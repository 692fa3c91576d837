"""The model zoo: name -> builder of a ``Workload`` (model + example inputs + training loss), small or bench-sized.

``MODELS["hstu"]("small")`` returns a Workload whose ``model(*inputs)`` runs; ``workload.loss(output)`` is the
training objective. Inputs are synthetic (random ids, power-law-free) and only serve to compile and time
the models; ``models.train`` feeds real data.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ctr import CTRConfig, DCNConfig, DCNv2, DeepFM, WideDeep
from .dlrm import DLRM, DLRMConfig, TorchRecDLRM, synthetic_batch, to_kjt
from .retrieval import InBatchSoftmaxTask, TwoTower, TwoTowerConfig
from .sequential import HSTU, HSTUConfig, NextItemTask, SASRec, SASRecConfig

SIZES = ("small", "bench")


@dataclass
class Workload:
    name: str
    model: nn.Module
    inputs: tuple
    # Training objective from the model's output and ``targets`` (identity for models that return their loss).
    objective: Callable[..., torch.Tensor]
    # (input index, dim) pairs that vary from batch to batch: batch sizes and jagged totals.
    dynamic_dims: list[tuple[int, int]] = field(default_factory=list)
    # What the objective compares the output with (the CTR models' labels).
    targets: tuple = ()

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        return self.objective(output, *self.targets)

    def to(self, device: torch.device | str) -> "Workload":
        """The model, inputs and targets moved to ``device`` (in place; returns self)."""
        self.model.to(device)
        self.inputs = tuple(_move(arg, device) for arg in self.inputs)
        self.targets = tuple(_move(arg, device) for arg in self.targets)
        return self

    def mark_dynamic(self, inputs: tuple | None = None) -> tuple:
        """Mark the varying dims of ``inputs`` (default: the example inputs) dynamic for torch.compile."""
        inputs = self.inputs if inputs is None else inputs
        for index, dim in self.dynamic_dims:
            arg = inputs[index]
            for tensor in _tensors(arg):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return inputs


def _move(arg, device):
    """A tensor, a list of tensors or a KeyedJaggedTensor on ``device``."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(a.to(device) for a in arg)
    return arg.to(device)


def _tensors(arg) -> list[torch.Tensor]:
    """The tensors of an input: itself, a list's items, or a KeyedJaggedTensor's values and lengths."""
    if isinstance(arg, (list, tuple)):
        return list(arg)
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [arg.values(), arg.lengths()]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    build_fn: Callable[..., Workload]
    # Whether the sparse tables can be hkv.DynamicEmbeddingBag hash tables (CTR models).
    dynamic_embeddings: bool = False

    def __call__(self, size: str = "small", seed: int = 0, batch: int | None = None,
                 dynamic_embeddings: bool = False) -> Workload:
        """The model (parameters drawn from ``seed``) and example inputs of ``batch`` rows (default: the size's)."""
        if size not in SIZES:
            raise ValueError(f"model size {size!r} for {self.name!r}; valid sizes: {', '.join(SIZES)}")
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        if not dynamic_embeddings:
            return self.build_fn(size, g, batch)
        if not self.dynamic_embeddings:
            raise ValueError(f"model {self.name!r} has no dynamic-embedding variant; models with one: "
                             f"{', '.join(n for n, e in MODELS.items() if e.dynamic_embeddings)}")
        return self.build_fn(size, g, batch, dynamic_embeddings=True)


def _returned(loss: torch.Tensor) -> torch.Tensor:
    """The objective of models whose output is their loss."""
    return loss


# -- CTR models: (dense, indices, offsets) -> logits; synthetic labels for the loss ---------------------------

CTR_SIZES = {
    "small": dict(table_rows=[60, 80, 100, 120], dim=8, batch=32),
    "bench": dict(table_rows=[100_000] * 26, dim=64, batch=2048),
}


def _ctr_workload(name, size, g, batch, make: Callable[[dict], nn.Module], kjt=False, dynamic_embeddings=False):
    spec = dict(CTR_SIZES[size], dynamic_embeddings=dynamic_embeddings)
    batch = spec.pop("batch") if batch is None else batch
    spec.pop("batch", None)
    model = make(spec)
    dense, indices, offsets = synthetic_batch(model.cfg, batch, g)
    labels = (torch.randint(0, 2, (batch,), generator=g).float(),)
    loss = F.binary_cross_entropy_with_logits
    if kjt:
        return Workload(name, model, (dense, to_kjt(model.cfg, indices, offsets)), loss, [(0, 0), (1, 0)], labels)
    return Workload(name, model, (dense, indices, offsets), loss, [(0, 0), (1, 0), (2, 0)], labels)


def _dlrm_cfg(spec: dict, interaction: str) -> DLRMConfig:
    dim = spec["dim"]
    return DLRMConfig(table_rows=spec["table_rows"], dim=dim, bottom=[4 * dim, dim], top=[8 * dim, 4 * dim, 1],
                      interaction=interaction, dynamic_embeddings=spec["dynamic_embeddings"])


def _ctr_cfg(cls, spec: dict, **kw):
    return cls(table_rows=spec["table_rows"], dim=spec["dim"], deep=[8 * spec["dim"], 4 * spec["dim"]],
               dynamic_embeddings=spec["dynamic_embeddings"], **kw)


# -- sequential models: NextItemTask(encoder)(targets, negatives, *inputs) -> loss ----------------------------

SEQ_SIZES = {
    "small": dict(num_items=200, dim=16, max_len=12, batch=6, negatives=16),
    "bench": dict(num_items=50_000, dim=64, max_len=200, batch=128, negatives=512),
}


def synthetic_histories(num_items: int, max_len: int, batch: int, g: torch.Generator):
    """Random jagged histories: ids [T] in 1..num_items, increasing timestamps [T], lengths [B] in 1..max_len."""
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g)
    total = int(lengths.sum())
    ids = torch.randint(1, num_items + 1, (total,), generator=g)
    gaps = torch.randint(1, 100_000, (total,), generator=g)
    timestamps = 880_000_000 + torch.cumsum(gaps, 0)
    return ids, timestamps, lengths


def _seq_workload(name: str, size: str, g: torch.Generator, batch: int | None) -> Workload:
    spec = SEQ_SIZES[size]
    L = spec["max_len"]
    encoder = sequential_encoder(name, spec["num_items"], dim=spec["dim"], max_len=L)
    ids, timestamps, lengths = synthetic_histories(spec["num_items"], L, batch or spec["batch"], g)
    targets = torch.randint(1, spec["num_items"] + 1, ids.shape, generator=g)
    negatives = torch.randint(1, spec["num_items"] + 1, (spec["negatives"],), generator=g)
    if encoder.input_format == "jagged":
        inputs, dynamic = (ids, timestamps, lengths), [(0, 0), (2, 0), (3, 0), (4, 0)]
    else:
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        positions = torch.arange(len(ids)) - (torch.cumsum(lengths, 0) - lengths)[rows]
        padded = torch.zeros(len(lengths), L, dtype=torch.int64).index_put((rows, positions), ids)
        targets = torch.zeros_like(padded).index_put((rows, positions), targets)
        inputs, dynamic = (padded,), [(0, 0), (2, 0)]
    return Workload(name, NextItemTask(encoder), (targets, negatives, *inputs), _returned, dynamic)


# -- two-tower retrieval: InBatchSoftmaxTask(users, history, offsets, positives, negatives) -> loss -----------

TWO_TOWER_SIZES = {
    "small": dict(num_users=50, num_items=200, dim=16, batch=8, history=5, negatives=16),
    "bench": dict(num_users=100_000, num_items=200_000, dim=64, batch=1024, history=20, negatives=1024),
}


def _two_tower_workload(name: str, size: str, g: torch.Generator, batch: int | None) -> Workload:
    spec = TWO_TOWER_SIZES[size]
    dim, n_items = spec["dim"], spec["num_items"]
    batch = batch or spec["batch"]
    lengths = torch.randint(1, spec["history"] + 1, (batch,), generator=g)
    history = torch.randint(1, n_items + 1, (int(lengths.sum()),), generator=g)
    inputs = (
        torch.randint(0, spec["num_users"], (batch,), generator=g), history, torch.cumsum(lengths, 0) - lengths,
        torch.randint(1, n_items + 1, (batch,), generator=g),
        torch.randint(1, n_items + 1, (spec["negatives"],), generator=g),
    )
    model = InBatchSoftmaxTask(two_tower(name, spec["num_users"], n_items, dim))
    return Workload(name, model, inputs, _returned, [(0, 0), (1, 0), (2, 0), (3, 0)])


def _ctr_entry(name: str, description: str, make: Callable[[dict], nn.Module]) -> ZooEntry:
    return ZooEntry(name, description, lambda s, g, b, **kw: _ctr_workload(name, s, g, b, make, **kw), True)


MODELS: dict[str, ZooEntry] = {e.name: e for e in [
    _ctr_entry("dlrm", "DLRM, dot interaction, nn.EmbeddingBag per table", lambda c: DLRM(_dlrm_cfg(c, "dot"))),
    _ctr_entry("dlrm_cat", "DLRM, concat interaction", lambda c: DLRM(_dlrm_cfg(c, "cat"))),
    ZooEntry("dlrm_torchrec", "DLRM over a TorchRec EmbeddingBagCollection fed a KeyedJaggedTensor",
           lambda s, g, b: _ctr_workload("dlrm_torchrec", s, g, b, lambda c: TorchRecDLRM(_dlrm_cfg(c, "dot")), True)),
    _ctr_entry("dcn_v2", "DCN-v2, full-rank cross, stacked", lambda c: DCNv2(_ctr_cfg(DCNConfig, c))),
    _ctr_entry("dcn_v2_lowrank_parallel", "DCN-v2, low-rank cross (r=dim/2), parallel", lambda c: DCNv2(
        _ctr_cfg(DCNConfig, c, low_rank=max(1, c["dim"] // 2), structure="parallel"))),
    _ctr_entry("deepfm", "DeepFM", lambda c: DeepFM(_ctr_cfg(CTRConfig, c))),
    _ctr_entry("wide_deep", "Wide & Deep", lambda c: WideDeep(_ctr_cfg(CTRConfig, c))),
    ZooEntry("two_tower", "two-tower retrieval, dot-product head, in-batch + sampled softmax",
           lambda s, g, b: _two_tower_workload("two_tower", s, g, b)),
    ZooEntry("two_tower_mol", "two-tower retrieval, mixture-of-logits head",
           lambda s, g, b: _two_tower_workload("two_tower_mol", s, g, b)),
    ZooEntry("sasrec", "SASRec, causal softmax attention over padded histories, sampled softmax",
           lambda s, g, b: _seq_workload("sasrec", s, g, b)),
    ZooEntry("hstu", "HSTU generative recommender, STU layers over jagged histories, sampled softmax",
           lambda s, g, b: _seq_workload("hstu", s, g, b)),
]}


# -- models sized for a dataset (models.train) ---------------------------------------------------------------

SEQUENTIAL = {"hstu": (HSTU, HSTUConfig), "sasrec": (SASRec, SASRecConfig)}
TWO_TOWER_HEADS = {"two_tower": "dot", "two_tower_mol": "mol"}
CTR_MODELS = ("dlrm", "dlrm_cat", "dlrm_torchrec", "dcn_v2", "dcn_v2_lowrank_parallel", "deepfm", "wide_deep")


def sequential_encoder(name: str, num_items: int, **config) -> nn.Module:
    """HSTU or SASRec over ``num_items`` items; ``config`` overrides fields of its config (dim, max_len, ...)."""
    model_cls, config_cls = SEQUENTIAL[name]
    return model_cls(replace(config_cls(num_items=num_items), **config))


def two_tower(name: str, num_users: int, num_items: int, dim: int, temperature: float = 0.05,
              components: int = 4) -> TwoTower:
    return TwoTower(TwoTowerConfig(num_users=num_users, num_items=num_items, dim=dim, tower=[2 * dim, dim],
                                   head=TWO_TOWER_HEADS[name], temperature=temperature,
                                   user_components=components, item_components=components))
