"""How far apart the numbers of the race's candidates are (``docs/determinism.md``): the same model trained from the
same seed with each whole-graph candidate forced (real Inductor), with autotune off, and with every region on its
reference kernel, compared with each other (and with eager PyTorch where the model draws no dropout mask, also on
other threads: what another machine changes in the order of a reduction).

``spread(runs(make, steps))`` returns, over every pair of runs, the largest relative difference of the losses (per
step: ``|a - b| / |b|``) and of the parameters after the last step (per tensor: ``max |a - b| / max(max |b|,
FLOOR)``).

    python -m tests.candidate_spread [--quick] [--steps 3] [--cases zoo,corpus|NAME,...]

measures the zoo's training workloads and the corpus's training cases (or those named, in order) and writes
``docs/benchmarks/candidate_spread.json`` (``--quick``: DLRM only, nothing written).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from recompile import autotune
from tests import race_checks

CHOICES = ("eager", "rec+eager", "inductor", "inductor-captured")
# The stated bound (float32, 3 SGD steps): the largest relative difference of a loss or a parameter tensor between
# any two runs; measured on the zoo and the corpus in docs/benchmarks/candidate_spread.json.
BOUND = 1e-5
# A parameter tensor is compared relative to its largest magnitude, or to this when smaller (``_relative``).
FLOOR = 1e-3
REFERENCE = "rec+eager, reference kernels"


@contextlib.contextmanager
def patched(obj, **values):
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextlib.contextmanager
def cache_dir():
    """A fresh, empty autotune cache (``$RECOMPILE_CACHE_DIR``) for the block."""
    saved = os.environ.get("RECOMPILE_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["RECOMPILE_CACHE_DIR"] = cache
        try:
            yield Path(cache)
        finally:
            if saved is None:
                del os.environ["RECOMPILE_CACHE_DIR"]
            else:
                os.environ["RECOMPILE_CACHE_DIR"] = saved


@contextlib.contextmanager
def keeping(choice: str | None, kernels: str | None = None):
    """The race keeps ``choice`` wherever it is a candidate and every region runs ``kernels`` (None: as raced);
    Inductor compiles ``choice`` alone when it is an Inductor candidate, nothing else; no race is timed (every
    candidate takes as long) and no choice is checked in place, so that the run is the candidate's alone."""
    real, build = autotune.fastest, autotune.build

    def fastest(samples, *args, **kwargs):
        for wanted in (choice, kernels):
            if wanted in samples:
                return wanted
        return real(samples, *args, **kwargs)

    def race(steps, budget_s, **kwargs):
        return {name: [1.0] * autotune.MIN_ROUNDS for name in steps}

    def build_only(builders, decision):
        return build({n: b for n, b in builders.items() if n == choice or not n.startswith("inductor")}, decision)

    with patched(autotune, fastest=fastest, race=race, settled=lambda *args: True, build=build_only,
                 fastest_eagerly=lambda graphs, *args: "rec+eager" if "rec+eager" in graphs else next(iter(graphs)),
                 inductor_can_win=lambda *args: True, inductor_floor_ms=lambda *args: 0.0,
                 inductor_ms=lambda *args: None), patched(autotune.GraphChooser, checked=lambda self, pick: pick):
        yield


def _trained(make, steps: int, compiled: bool = True, options: dict | None = None):
    model, inputs, loss = make()
    losses, _ = race_checks.train(model, inputs, loss, steps, compiled=compiled, options=options)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _choices(cache: Path) -> list[str]:
    return sorted({json.loads(p.read_text())["choice"] for p in (cache / "autotune").glob("*.json")})


# (choice forced, kernels forced, options) of each compiled run; AUTOTUNE_OFF is Inductor on the rewrite, with
# the fastest kernels (the ``inductor`` candidate's numbers), REFERENCE_KERNELS every region on its reference kernel.
AUTOTUNE_OFF, REFERENCE_KERNELS = (None, None, {"autotune": False}), ("rec+eager", "reference", None)
VARIANTS = (*((choice, None, None) for choice in CHOICES), AUTOTUNE_OFF, REFERENCE_KERNELS)


def runs(make, steps: int, variants=VARIANTS) -> dict[str, tuple]:
    """The losses and final parameters of each run, by a label naming the choices the graphs kept; and eager
    PyTorch's where the model draws no dropout mask, with torch's threads and with other threads."""
    results = {}
    model, _, _ = make()
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    for choice, kernels, options in variants:
        with cache_dir() as cache, keeping(choice, kernels):
            torch._dynamo.reset()
            result = _trained(make, steps, options=options)
            label = "autotune off" if options else (REFERENCE if kernels else "+".join(_choices(cache)))
        results.setdefault(label, result)
    if not dropout:
        results["eager PyTorch"] = _trained(make, steps, compiled=False)
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)  # another machine's split of each reduction
        try:
            results["eager PyTorch, other threads"] = _trained(make, steps, compiled=False)
        finally:
            torch.set_num_threads(threads)
    return results


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``, ``max |b|`` taken as at least ``FLOOR``: a tensor that stays near zero (a bias
    whose gradient is zero but for rounding, such as a key projection's before a softmax) is measured absolutely."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(FLOOR)).item()


def spread(results: dict[str, tuple]) -> dict:
    """The largest relative differences between any two runs: of a step's loss, and of a parameter tensor (with the
    pair of runs and the tensor where it is)."""
    loss, params, where = 0.0, 0.0, ""
    for (a, (la, pa)), (b, (lb, pb)) in itertools.combinations(results.items(), 2):
        loss = max(loss, ((la.double() - lb.double()).abs() / lb.double().abs().clamp_min(1e-30)).max().item())
        for name in pb:
            if _relative(pa[name], pb[name]) > params:
                params, where = _relative(pa[name], pb[name]), f"{a} vs {b}: {name}"
    return {"runs": sorted(results), "loss": loss, "params": params, "params_at": where}


def zoo(name: str):
    from models.zoo import MODELS

    def make():
        workload = MODELS[name]("small", seed=0, batch=4)
        return workload.model, workload.inputs, workload.loss
    return make


def corpus(case):
    from models.corpus.harness import BATCHES
    return lambda: (case.make(0), case.inputs(BATCHES[0], 0), lambda loss: loss)


def workloads(selection: list[str]):
    """The workloads named (``zoo/<model>``, a corpus case's name) or of the kinds named (``zoo``, ``corpus``), in the
    order given."""
    from models.corpus.harness import CASES
    from models.zoo import MODELS

    every = {**{f"zoo/{name}": zoo(name) for name in MODELS}, **{c.name: corpus(c) for c in CASES.values() if c.training}}
    seen = set()
    for wanted in selection:
        for name, make in every.items():
            if name not in seen and wanted in (name, "zoo" if name.startswith("zoo/") else "corpus"):
                seen.add(name)
                yield name, make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default="zoo,corpus")
    parser.add_argument("--out", default="docs/benchmarks/candidate_spread.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    measured, out = {}, Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name, make in workloads(["zoo/dlrm"] if args.quick else args.cases.split(",")):
        start = time.perf_counter()
        try:
            measured[name] = spread(runs(make, args.steps))
        except Exception as exc:  # a model that does not train here is listed with its error
            measured[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        measured[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, json.dumps(measured[name]), flush=True)
        if not args.quick:
            worst = {key: max((m[key] for m in measured.values() if key in m), default=0.0) for key in ("loss", "params")}
            out.write_text(json.dumps({
                "what": "largest relative difference between the race's candidates (each forced), autotune off, "
                        "reference kernels and eager PyTorch: losses of each step, parameters after the last",
                "steps": args.steps, "machine": f"{platform.machine()} {autotune._cpu()}",
                "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat(), "commit": commit,
                "under_load": os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1), "worst": worst,
                "workloads": measured}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
