"""RecBole 1.2.1 models, unmodified, on the MovieLens-100k files its wheel ships.

RecBole is installed without its dependency pins (``pip install --no-deps recbole==1.2.1``); the small runtime
packages its config, data and model modules import are in the ``test`` extra. Two things in it need the harness:

- it reads NumPy 1 aliases (``np.float_`` ...) at import: ``numpy_aliases`` defines the ones NumPy 2 removed,
  before the first import, and leaves NumPy otherwise alone;
- importing its sequential models turns on autograd anomaly detection for the whole process
  (``sine.py``: ``torch.autograd.set_detect_anomaly(True)``): ``anomaly_kept`` puts it back around every call
  that imports RecBole's modules (``recbole()``, ``config``'s ``Config``, ``build``'s ``get_model``).

Models are built through RecBole's own ``Config`` / ``create_dataset`` / ``data_preparation``, so their
hyper-parameters are RecBole's defaults for ml-100k except the sizes ``SMALL`` shrinks, and batches are its
training dataloader's (labels for context-aware models; item histories, masks and targets for sequential ones).
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import random
import types
import warnings

import numpy as np
import torch
import torch.nn as nn

# NumPy 2 removed these aliases; RecBole 1.2.1 reads them at import and when building datasets.
NUMPY_ALIASES = {"float_": np.float64, "complex_": np.complex128, "unicode_": np.str_}

# FiBiNET is not in RecBole 1.2.1; AFM and FwFM are its other pairwise-interaction models.
CONTEXT = ("DCNV2", "DCN", "DeepFM", "WideDeep", "xDeepFM", "AutoInt", "AFM", "FwFM", "NFM", "PNN", "FM")
SEQUENTIAL = ("SASRec", "BERT4Rec", "GRU4Rec", "Caser", "NARM")
# Further RecBole models, checked for numbers, compile count, regions and graph breaks (``python -m
# models.check_corpus_wide``, tests/test_corpus_wide.py), not benchmarked. Left out: FEARec (its HybridAttention's slide
# step divides by zero at SMALL's sizes).
WIDE_CONTEXT = ("DSSM", "EulerNet", "FFM", "FiGNN", "FNN", "KD_DAGFM", "LR")
WIDE_SEQUENTIAL = ("CORE", "FOSSIL", "GCSAN", "HGN", "HRM", "LightSANs", "NextItNet", "NPE", "RepeatNet", "SHAN",
                   "SINE", "SRGNN", "STAMP", "GRU4RecCPR", "SASRecCPR")
# Beyond the corpus (``python -m models.check_corpus_wide``), by the data they train on: general recommenders on
# (user, item, sampled negative) triples ("general"; ConvNCF has no full sort and scores pairs), or on 0/1 labels
# ("pointwise": they score pairs, no full sort); sequential models trained with BPR over a sampled negative
# ("pairwise"), reading item features (ml-100k's movie classes, "featured"), or scoring (history, item) pairs
# against 0/1 labels (DIN, "din"). Left out, and why: docs/corpus.md, "Beyond the corpus".
WIDE_GENERAL = ("BPR", "ENMF", "CDAE", "MultiDAE", "SimpleX", "ConvNCF")
WIDE_POINTWISE = ("NeuMF", "DMF", "NNCF", "FISM", "NAIS")
WIDE_PAIRWISE = ("FPMC", "TransRec")
WIDE_FEATURED = ("FDSA", "GRU4RecF", "SASRecF")
WIDE_DIN = ("DIN",)
SCORES_PAIRS = ("ConvNCF",)  # general models without full_sort_predict
# The model whose configuration prepares the data of its kind; every model of the kind reads the same columns.
REPRESENTATIVE = {"context": "DCN", "sequential": "SASRec", "general": "BPR", "pointwise": "NeuMF",
                  "pairwise": "FPMC", "featured": "FDSA", "din": "DIN"}
KINDS = {**dict.fromkeys(SEQUENTIAL + WIDE_SEQUENTIAL, "sequential"), **dict.fromkeys(WIDE_GENERAL, "general"),
         **dict.fromkeys(WIDE_POINTWISE, "pointwise"), **dict.fromkeys(WIDE_PAIRWISE, "pairwise"),
         **dict.fromkeys(WIDE_FEATURED, "featured"), **dict.fromkeys(WIDE_DIN, "din")}
ROWS = 4096  # training rows prepared per kind: the largest batch the benchmark times

# Sizes small enough for the test suite; the rest is RecBole's per-model default configuration.
SMALL = {
    "embedding_size": 8, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 2,
    "mlp_hidden_size": [16, 16], "cross_layer_num": 2, "low_rank": 4, "cin_layer_size": [8, 8],
    "attention_size": 8, "num_layers": 1, "MAX_ITEM_LIST_LENGTH": 12, "nv": 2, "nh": 2,
}
# The sequential models train with a full softmax over the items (CE): no sampled negatives; the pairwise ones
# keep RecBole's default, one uniformly sampled negative per row.
SEQUENTIAL_CONFIG = {"train_neg_sample_args": None, "loss_type": "CE"}
KIND_CONFIG = {"sequential": SEQUENTIAL_CONFIG, "featured": SEQUENTIAL_CONFIG}
# ConvNCF's default convolutions (kernels 4, 4, 2, 2 with equal strides) need its 64-wide embeddings.
MODEL_CONFIG = {"ConvNCF": {"embedding_size": 64}}


def numpy_aliases() -> None:
    for name, value in NUMPY_ALIASES.items():
        if not hasattr(np, name):
            setattr(np, name, value)


@contextlib.contextmanager
def anomaly_kept():
    """Autograd's anomaly detection as it was before the block: importing RecBole's sequential models (its
    ``sine.py``, imported with the first one a ``Config`` or ``get_model`` names) turns it on for the whole process,
    and every step after it would record each op's traceback and check each gradient."""
    anomaly = torch.is_anomaly_enabled()
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(anomaly)


@functools.cache
def recbole():
    """The RecBole modules the corpus uses, imported once with the aliases set and anomaly detection undone."""
    numpy_aliases()
    with warnings.catch_warnings(), anomaly_kept():
        warnings.simplefilter("ignore")
        from recbole.config import Config
        from recbole.data import create_dataset, data_preparation
        from recbole.data.transform import construct_transform
        from recbole.utils import get_model
    logging.getLogger().setLevel(logging.ERROR)
    return types.SimpleNamespace(Config=Config, create_dataset=create_dataset, data_preparation=data_preparation,
                                 construct_transform=construct_transform, get_model=get_model)


def dataset_root() -> str:
    import importlib.util

    return os.path.join(os.path.dirname(importlib.util.find_spec("recbole").origin), "dataset_example")


def _params(name: str) -> dict:
    return {**SMALL, **KIND_CONFIG.get(kind(name), {}), **MODEL_CONFIG.get(name, {}), "data_path": dataset_root(),
            "use_gpu": False, "show_progress": False, "train_batch_size": ROWS, "state": "ERROR"}


@functools.cache
def config(name: str):
    """RecBole's configuration of model ``name`` on ml-100k (its defaults, the sizes ``SMALL`` sets)."""
    # Config imports the model's module (anomaly_kept: a sequential one's package turns anomaly detection on)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), anomaly_kept():
        warnings.simplefilter("ignore")
        return recbole().Config(model=name, dataset="ml-100k", config_dict=_params(name))


@functools.cache
def training_data(kind: str):
    """(dataset, first training batch of ``ROWS`` rows) that RecBole's dataloader gives every model of ``kind``:
    the models of one kind read the same data, so it is prepared once."""
    rb = recbole()
    cfg = config(REPRESENTATIVE[kind])
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        train, _, _ = rb.data_preparation(cfg, rb.create_dataset(cfg))
    return train.dataset, next(iter(train))


def kind(name: str) -> str:
    return KINDS.get(name, "context")


@functools.cache
def transform(name: str):
    """The batch transform model ``name``'s configuration names; constructing it also writes the field names it
    adds into the configuration (BERT4Rec's model reads them), so it comes before the model."""
    return recbole().construct_transform(config(name))


def build(name: str, seed: int = 0) -> nn.Module:
    """RecBole model ``name`` with its initial weights drawn from ``seed``, in eval mode (dropout off, so the
    compiled and eager runs compare the same function)."""
    dataset, _ = training_data(kind(name))
    transform(name)
    with anomaly_kept():
        model_class = recbole().get_model(name)
    torch.manual_seed(seed)
    return model_class(config(name), dataset).eval()


def batch(name: str, size: int, seed: int = 0):
    """``size`` rows (a RecBole ``Interaction``) of the shuffled training data, the ``seed``-th such slice, after
    the batch transform the model's configuration names (BERT4Rec's item masking)."""
    if size > ROWS:
        raise ValueError(f"batch {size} for {name}: the corpus prepares {ROWS} rows per model")
    dataset, rows = training_data(kind(name))
    start = seed * size % (ROWS - size + 1)
    random.seed(seed)
    return transform(name)(dataset, rows[start:start + size])
