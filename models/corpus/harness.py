"""The corpus: each third-party model's entry points as cases, and the checks run on them.

A ``Case`` is one function of one model that ``torch.compile`` compiles: RecBole's ``calculate_loss`` (training:
its loss is differentiated), ``predict`` and ``full_sort_predict`` (inference); a TorchRec model's training loss
and its forward; the GR-style HSTU's loss and forward. ``check`` compiles a case with ``rec_ascend`` and runs it
on batches of changing size against eager (outputs, and every parameter's gradient for training cases),
counting compilations; ``found_regions`` runs ``recompile.explain`` on it.
"""
from __future__ import annotations

import collections
import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import gr_hstu, recbole_zoo, torchrec_zoo

# The batch sizes a check runs, in order: the second makes Dynamo compile a dynamic graph, the third must reuse it.
BATCHES = (16, 24, 37)


class Entry(nn.Module):
    """``model.<method>(*inputs)`` as a module's forward: what torch.compile compiles for a case."""

    def __init__(self, model: nn.Module, method: str = "forward"):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *inputs):
        return getattr(self.model, self.method)(*inputs)


class CTRLoss(nn.Module):
    """A TorchRec ranking model's training loss: binary cross-entropy of its output against 0/1 labels (its output
    is a probability for ``SimpleDeepFMNN``, whose over arch ends in a sigmoid; a logit for the others)."""

    def __init__(self, model: nn.Module, probability: bool):
        super().__init__()
        self.model, self.probability = model, probability

    def forward(self, dense, sparse, labels):
        out = self.model(dense, sparse).squeeze(-1)
        if self.probability:
            return F.binary_cross_entropy(out, labels)
        return F.binary_cross_entropy_with_logits(out, labels)


@dataclass(frozen=True)
class Case:
    model: str  # "<package>/<model>": recbole/DCNV2, torchrec/DLRM, gr/HSTU
    entry: str  # loss, predict, full_sort (RecBole); train, forward (TorchRec, GR)
    training: bool  # differentiated: gradients are compared and the training step is timed
    make: Callable[[int], nn.Module] = field(repr=False, compare=False)  # seed -> the module compiled
    inputs: Callable[[int, int], tuple] = field(repr=False, compare=False)  # (rows, seed) -> its inputs

    @property
    def name(self) -> str:
        return f"{self.model}:{self.entry}"

    def __str__(self) -> str:
        return self.name


# entry -> (the model's method, differentiated). Sequential and general models score candidates by ranking all
# items (full_sort_predict: what RecBole evaluates them with); context-aware, pointwise and DIN score the given
# pairs (predict).
RECBOLE_ENTRIES = {"loss": ("calculate_loss", True), "predict": ("predict", False), "full_sort": ("full_sort_predict", False)}


def _recbole_cases(name: str) -> list[Case]:
    pairs = recbole_zoo.kind(name) in ("context", "pointwise", "din") or name in recbole_zoo.SCORES_PAIRS
    entries = ("loss", "predict") if pairs else ("loss", "full_sort")
    cases = []
    for entry in entries:
        method, training = RECBOLE_ENTRIES[entry]
        cases.append(Case(f"recbole/{name}", entry, training,
                          functools.partial(lambda m, seed: Entry(recbole_zoo.build(name, seed), m), method),
                          lambda rows, seed: (recbole_zoo.batch(name, rows, seed),)))
    return cases


def _torchrec_cases(name: str) -> list[Case]:
    probability = name == "DeepFM"
    return [
        Case(f"torchrec/{name}", "train", True, lambda seed: CTRLoss(torchrec_zoo.build(name, seed), probability),
             lambda rows, seed: torchrec_zoo.batch(rows, seed)),
        Case(f"torchrec/{name}", "forward", False, lambda seed: torchrec_zoo.build(name, seed),
             lambda rows, seed: torchrec_zoo.batch(rows, seed)[:2]),
    ]


def _hstu_cases() -> list[Case]:
    return [
        Case("gr/HSTU", "train", True, lambda seed: Entry(gr_hstu.build(seed), "loss"), gr_hstu.batch),
        Case("gr/HSTU", "forward", False, gr_hstu.build, lambda rows, seed: gr_hstu.batch(rows, seed)[:2]),
    ]


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        *(c for n in recbole_zoo.CONTEXT + recbole_zoo.SEQUENTIAL for c in _recbole_cases(n)),
        *(c for n in torchrec_zoo.MODELS for c in _torchrec_cases(n)),
        *_hstu_cases(),
    ]
}


# The wider corpus, RecBole's and TorchRec's (``python -m models.check_corpus_wide``): numbers, compile count, regions
# and graph breaks only.
WIDE_CASES: dict[str, Case] = {
    c.name: c
    for n in recbole_zoo.WIDE_CONTEXT + recbole_zoo.WIDE_SEQUENTIAL + recbole_zoo.WIDE_GENERAL
    + recbole_zoo.WIDE_POINTWISE + recbole_zoo.WIDE_PAIRWISE + recbole_zoo.WIDE_FEATURED + recbole_zoo.WIDE_DIN
    for c in _recbole_cases(n)} | {c.name: c for n in torchrec_zoo.WIDE for c in _torchrec_cases(n)}


# Absolute tolerance of a gradient entry: a gradient that is zero analytically comes out as float noise around
# 1e-7 (CORE's bias before its softmax, eagerly and under plain Inductor alike).
GRAD_FLOOR = 1e-6


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run(case: Case, fn: Callable, module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``fn(*inputs)`` and, for a training case, every parameter's gradient of it (``fn`` is ``module`` or its
    compiled form)."""
    if not case.training:
        with torch.no_grad():
            return fn(*inputs), {}
    module.zero_grad(set_to_none=True)
    out = fn(*inputs)
    out.backward()
    return out.detach(), grads(module)


def assert_equal(got, want, rtol: float, atol: float, what: str, floor: float = 1e-7) -> None:
    """Within ``rtol`` of each entry, and ``atol`` relative to the tensor's largest entry (fused kernels sum
    floats in another order), at least ``floor``."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=max(floor, atol * float(want.abs().max())),
                               msg=lambda m: f"{what}: {m}")


@dataclass
class Checked:
    compiles: int  # backend calls over all batches
    first: int  # backend calls on the first batch (one per graph Dynamo captured)


def rec_passes_aot_eager(gm, example_inputs, options=None):
    """rec_ascend's pass pipeline, then AOT autograd running the rewritten graph eagerly instead of Inductor: the
    rec regions, their ops' fakes, autograd formulas and kernels run as under rec_ascend, without Inductor's
    C++ compile time (the tests check the rewrites on every corpus model; a few cases go through Inductor too)."""
    from torch._dynamo.backends.debugging import aot_eager

    from recompile.backend import resolve_target
    from recompile.options import RecompileOptions
    from recompile.pipeline import PassContext, run_pipeline

    opts = RecompileOptions.coerce(options)
    return aot_eager(run_pipeline(gm, PassContext(opts, resolve_target(opts), example_inputs)), example_inputs)


def check(case: Case, options: dict | None = None, batches=BATCHES, seed: int = 0, inductor: bool = True) -> Checked:
    """Compile ``case`` with rec_ascend (``inductor=False``: ``rec_passes_aot_eager``) and run it on ``batches``
    (rows each), comparing each output and gradient with eager's: outputs within 1e-5 relative, gradients 1e-4.
    Returns how often the backend compiled."""
    from recompile.backend import rec_ascend
    from recompile.tracing import TracingCalls

    backend = rec_ascend if inductor else rec_passes_aot_eager
    calls = [0]

    def counted(gm, example_inputs):
        calls[0] += 1
        return backend(gm, example_inputs, options=options)

    counted.backend_ctx_ctor = TracingCalls  # Dynamo traces under rec_ascend's settings, as for a user's model

    torch._dynamo.reset()  # the cases share code objects (Entry.forward): start from no cached graphs
    module = case.make(seed)
    compiled = torch.compile(module, backend=counted)
    first = None
    for i, rows in enumerate(batches):
        inputs = case.inputs(rows, seed + i)
        out_c, grads_c = run(case, compiled, module, inputs)
        first = calls[0] if first is None else first
        out_e, grads_e = run(case, module, module, inputs)
        assert_equal(out_c, out_e, 1e-5, 1e-6, f"{case.name} output, batch {rows}")
        assert grads_c.keys() == grads_e.keys(), f"{case.name}: gradients of {sorted(grads_c)} vs {sorted(grads_e)}"
        for name, g in grads_e.items():
            assert_equal(grads_c[name], g, 1e-4, 1e-5, f"{case.name} gradient of {name}, batch {rows}", GRAD_FLOOR)
    return Checked(calls[0], first)


@dataclass
class Found:
    regions: collections.Counter  # (kind, op) -> how many
    breaks: list[str]  # each graph break Dynamo made: why, and where (file:line)
    fallbacks: list[dict]


def found_regions(case: Case, rows: int = BATCHES[0], seed: int = 0, options: dict | None = None) -> Found:
    """What ``recompile.explain`` finds in ``case`` on one batch of ``rows``."""
    import recompile

    torch._dynamo.reset()
    module = case.make(seed)
    inputs = case.inputs(rows, seed)
    with torch.set_grad_enabled(case.training):
        report = recompile.explain(module, *inputs, options=options).to_dict()
    return Found(collections.Counter((r["kind"], r["op"]) for r in report["regions"]),
                 [f"{b['summary']} ({os.path.basename(b['at'] or '?')})" for b in report["breaks"]], report["fallbacks"])
