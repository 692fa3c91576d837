"""Compile cost of rec_ascend against Inductor: cold compile time of a step, and the per-call overhead.

    python -m models.bench_compile [--models interaction-dlrm interaction-dcn hstu-ml100k deepfm recbole/FM ...]
                                   [--modes train forward] [--repeats N] [--threads N] [--no-overhead] [--no-cold]
                                   [--warm]

Cold compile: each (model, mode, backend) runs in a fresh process with empty Inductor and recompile caches
(``TORCHINDUCTOR_CACHE_DIR``, ``RECOMPILE_CACHE_DIR``); the figure is the first step's time minus the fastest of
three steady steps', and beside it the same difference in CPU time: the process's own (all its threads) and that of
its children that ended (not Inductor's kernel-compile workers, which run on), which load from other processes moves
less than wall time. Backends alternate within each repeat, so that load from other processes falls on both alike;
the median of the repeats is printed, with rec_ascend's autotune decisions: the candidate kept, the seconds each
candidate took to build (Inductor's compile) and the Inductor graphs it left uncompiled. Models:
``interaction-dlrm`` and ``interaction-dcn`` are ``models.bench_interaction``'s (batch 256; ``cross-layer``, one cross
layer, is stepped as they are), ``hstu-ml100k`` the
main job's HSTU on MovieLens-100k (training only, 3 steps of ``models.train``; CPU seconds: the whole run's),
``<package>/<model>`` a corpus model (``models/corpus``: its training case for mode ``train``, its inference entry
for ``forward``, at batch 128 as ``models.bench_corpus`` compiles it; a step returns its output and gradients), any
other name a zoo model's small config.

Warm compile (``--warm``): after each cold compile, a second fresh process on the same cache folders (Inductor's FX
graph and AOT autograd caches, recompile's autotune decisions), both with Inductor's C++ compiles run in the
process (``TORCHINDUCTOR_COMPILE_THREADS=1``, so that its CPU seconds count them, as ``models.bench_corpus``'s do):
cold and warm compile seconds of Inductor and rec_ascend side by side, whether the warm process's first step
computed the cold one's bit for bit (output, loss, gradients: caches must never change results), the races the warm
process ran (autotune decisions it stored: none where the cold one's were loaded) and Inductor's cache counters
(hits, misses, bypasses) in each. Rows go to ``docs/benchmarks/compile_warm.json``.

Per-call overhead: microseconds per call of a one-op graph on an 8-element tensor (no rec region), of one cross
layer at batch 1 (a rec region, raced), of four embedding bags at batch 2 (one grouped lookup: the custom op's
own cost), and of each zoo model's forward at batch 1 (small configs), under eager, Inductor and rec_ascend, timed
side by side, with rec_ascend's over Inductor's.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy
import torch

from .bench import backend_step
from .corpus.harness import CASES, run
from .timing import race_ms
from .zoo import MODELS as ZOO

COMPILED = ("inductor", "rec_ascend")
MAIN_JOB = "hstu-ml100k"
CROSS = "cross-layer"  # one cross layer at batch 256 (``_Cross``): the smallest graph the tuner races
# models.bench_interaction's DLRM and DCN-v2 (batch 256), by their name there.
INTERACTION = {"interaction-dlrm": "dlrm", "interaction-dcn": "dcn"}
CORPUS = tuple(sorted({case.model for case in CASES.values()}))  # "recbole/FM", "torchrec/DLRM", ...
CORPUS_ROWS = 128  # the batch models.bench_corpus compiles a case at
MODELS = (*INTERACTION, MAIN_JOB, CROSS, *sorted(ZOO), *CORPUS)
MODES = ("train", "forward")
# Inductor's cache counters a compiling process reports (``torch._dynamo.utils.counters``).
CACHE_COUNTERS = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
                  "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}


def _interaction_step(name: str, mode: str, backend: str):
    from .bench_interaction import make, step_fn, synthetic_batch

    if name == CROSS:
        model, args = _Cross(), (torch.randn(256, 16),)
    else:
        model, cfg = make(name, True)
        args = synthetic_batch(cfg, 256, torch.Generator().manual_seed(1))
    fn = step_fn(torch.compile(model, backend=backend), mode)
    return functools.partial(fn, *args)


def _main_job(backend: str) -> dict:
    from .train import parser, run_training

    args = parser().parse_args(["--model", "hstu", "--data", "ml-100k", "--epochs", "1", "--max-steps", "3",
                                "--quiet", "--backend", backend])
    return run_training(args)


def _corpus_step(model: str, mode: str, backend: str):
    """The corpus case of ``model`` that trains (mode ``train``) or not, at batch ``CORPUS_ROWS``: a call returns its
    output and, training, every parameter's gradient (``harness.run``)."""
    case = next(c for c in CASES.values() if c.model == model and c.training == (mode == "train"))
    module = case.make(0)
    return functools.partial(run, case, torch.compile(module, backend=backend), module, case.inputs(CORPUS_ROWS, 0))


def _step(model: str, mode: str, backend: str):
    """One step of ``model`` under ``backend``, returning what it computed (output or loss; a corpus case's
    gradients too)."""
    if model in INTERACTION or model == CROSS:
        return _interaction_step(INTERACTION.get(model, model), mode, backend)
    if model in CORPUS:
        return _corpus_step(model, mode, backend)
    return backend_step(model, "small", backend, mode == "train")


def digest(value) -> str:
    """The sha256 of every tensor in ``value`` (nested tuples, lists, dicts; bit for bit, with its shape and dtype)
    and of every other leaf's repr: two steps computed the same where their digests are equal."""
    sha = hashlib.sha256()
    for leaf in torch.utils._pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach().cpu().contiguous()
            sha.update(f"{list(leaf.shape)} {leaf.dtype}".encode())
            sha.update(leaf.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            sha.update(repr(leaf).encode())
    return sha.hexdigest()


def child(model: str, mode: str, backend: str) -> dict:
    """In a fresh process: seconds of the first step beyond the fastest of three steady ones (wall and CPU), the
    digest of what the first step computed, Inductor's cache counters, the autotune decisions on disk and how many
    of them this process stored (races it ran)."""
    from torch._dynamo.utils import counters

    from .bench_corpus import _process_clocks, decisions_since

    started = time.time()
    # RecBole's data loader shuffles with the global generators: seeded, every process steps on the same batch.
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    if model == MAIN_JOB:
        start_cpu = _process_clocks()[1]
        result = _main_job(backend)
        seconds, cpu, first = result["compile_s"], _process_clocks()[1] - start_cpu, result["losses"][0]
    else:
        step, times = _step(model, mode, backend), []
        for _ in range(4):
            wall, cpu = _process_clocks()
            out = step()
            end_wall, end_cpu = _process_clocks()
            first = out if not times else first
            times.append((end_wall - wall, end_cpu - cpu))
        (first_wall, first_cpu), steady = times[0], times[1:]
        seconds = max(0.0, first_wall - min(w for w, _ in steady))
        cpu = max(0.0, first_cpu - min(c for _, c in steady))
    folder = Path(os.environ["RECOMPILE_CACHE_DIR"]) / "autotune"
    decisions = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return {"compile_s": seconds, "cpu_s": cpu, "first": digest(first), "races": len(decisions_since(started)),
            "caches": {name: counters[group][name] for group, names in CACHE_COUNTERS.items() for name in names},
            "decisions": [
                {"choice": d["choice"], "compile_s": d.get("compile_s", {}),
                 "not_compiled": sorted(n for n, why in d["rejected"].items() if why.startswith("not compiled"))}
                for d in decisions]}


def compile_process(model: str, mode: str, backend: str, threads: int, cache: str, **env: str) -> dict:
    """``child`` in a fresh process on the Inductor and recompile cache folders under ``cache``."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               RECOMPILE_CACHE_DIR=os.path.join(cache, "recompile"), OMP_NUM_THREADS=str(threads), **env)
    out = subprocess.run([sys.executable, "-m", f"{__package__}.bench_compile", "--child", model, mode, backend],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"compile of {model} ({mode}, {backend}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_compile(model: str, mode: str, backend: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        return compile_process(model, mode, backend, threads, cache)


def cold_and_warm(model: str, mode: str, backend: str, threads: int) -> tuple[dict, dict]:
    """A cold compile, then a warm one: a second fresh process on the cache folders the first filled; each runs
    Inductor's C++ compiles itself, so that its CPU seconds count them."""
    with tempfile.TemporaryDirectory() as cache:
        cold = compile_process(model, mode, backend, threads, cache, TORCHINDUCTOR_COMPILE_THREADS="1")
        return cold, compile_process(model, mode, backend, threads, cache, TORCHINDUCTOR_COMPILE_THREADS="1")


def _describe(decisions: list[dict]) -> str:
    parts = []
    for d in decisions:
        built = ", ".join(f"{name} {s:.1f} s" for name, s in d["compile_s"].items() if s >= 0.05)
        skipped = f"; not compiled: {', '.join(d['not_compiled'])}" if d["not_compiled"] else ""
        parts.append(f"kept {d['choice']} (built: {built or 'nothing to compile'}{skipped})")
    return " | ".join(parts)


def _cases(models: list[str], modes: list[str]) -> list[tuple[str, str]]:
    return [(model, mode) for model in models for mode in (["train"] if model == MAIN_JOB else modes)]


def _repeated(measure, model: str, mode: str, repeats: int, threads: int) -> dict[str, list]:
    """``measure(model, mode, backend, threads)`` ``repeats`` times per backend, the backends alternating within each
    repeat, so that load from other processes falls on both alike."""
    runs = {backend: [] for backend in COMPILED}
    for _ in range(repeats):
        for backend in COMPILED:
            runs[backend].append(measure(model, mode, backend, threads))
    return runs


def run_cold(models: list[str], modes: list[str], repeats: int, threads: int) -> list[dict]:
    rows = []
    for model, mode in _cases(models, modes):
        runs = _repeated(cold_compile, model, mode, repeats, threads)
        seconds = {backend: statistics.median(r["compile_s"] for r in results) for backend, results in runs.items()}
        cpu = {backend: statistics.median(r["cpu_s"] for r in results) for backend, results in runs.items()}
        row = {"model": model, "mode": mode, **seconds, "ratio": seconds["rec_ascend"] / seconds["inductor"],
               "cpu_s": cpu, "cpu_ratio": cpu["rec_ascend"] / max(cpu["inductor"], 1e-9),
               "decisions": runs["rec_ascend"][-1]["decisions"]}
        rows.append(row)
        print(f"{model:24s} {mode:8s} cold compile: inductor {row['inductor']:6.1f} s  rec_ascend "
              f"{row['rec_ascend']:6.1f} s  ({row['ratio']:4.2f}x Inductor's; the compiling process's own CPU "
              f"{row['cpu_ratio']:4.2f}x)  {_describe(row['decisions'])}", flush=True)
    return rows


def _counts(caches: dict[str, int]) -> str:
    return ", ".join(f"{name.replace('_cache_', ' ')} {n}" for name, n in caches.items() if n) or "none"


def run_warm(models: list[str], modes: list[str], repeats: int, threads: int) -> list[dict]:
    """Per (model, mode) and backend, cold and warm compile (``cold_and_warm``), backends alternating within each
    repeat: the medians of the repeats, whether every warm first step computed its cold one's bit for bit, the most
    races a warm process ran, and the last pair's cache counters."""
    rows = []
    for model, mode in _cases(models, modes):
        runs = _repeated(cold_and_warm, model, mode, repeats, threads)
        row = {"model": model, "mode": mode}
        for backend, pairs in runs.items():
            colds, warms = zip(*pairs)
            row[backend] = {"cold_s": statistics.median(r["compile_s"] for r in colds),
                            "warm_s": statistics.median(r["compile_s"] for r in warms),
                            "cold_cpu_s": statistics.median(r["cpu_s"] for r in colds),
                            "warm_cpu_s": statistics.median(r["cpu_s"] for r in warms),
                            "equal": all(cold["first"] == warm["first"] for cold, warm in pairs),
                            "warm_races": max(r["races"] for r in warms),
                            "cold_caches": colds[-1]["caches"], "warm_caches": warms[-1]["caches"]}
        row["decisions"] = runs["rec_ascend"][-1][0]["decisions"]
        rows.append(row)
        times = "  ".join(f"{b} {row[b]['cold_cpu_s']:5.1f} -> {row[b]['warm_cpu_s']:5.1f} "
                          f"({row[b]['cold_s']:5.1f} -> {row[b]['warm_s']:5.1f})" for b in COMPILED)
        print(f"{model:24s} {mode:8s} compile cold -> warm, CPU s (wall s): {times}; first step bit-equal: "
              + ", ".join(f"{b} {'yes' if row[b]['equal'] else 'NO'}" for b in COMPILED)
              + f"; races in rec_ascend's warm process: {row['rec_ascend']['warm_races']}; warm caches: "
              + ", ".join(f"{b} ({_counts(row[b]['warm_caches'])})" for b in COMPILED), flush=True)
    return rows


class _Cross(torch.nn.Module):
    """One cross layer: the smallest graph with a rec region (the tuner races it)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x0):
        return x0 * self.lin(x0) + x0


class _Bags(torch.nn.Module):
    """Four embedding bags at batch 2: the smallest graph with a grouped lookup (one recompile.grouped_embedding_bag
    call under rec_ascend)."""

    def __init__(self, tables: int = 4, rows: int = 10, dim: int = 8):
        super().__init__()
        self.bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))

    def forward(self, ids, offsets):
        return torch.cat([bag(ids, offsets) for bag in self.bags], 1)


def _print_per_call(what: str, us: dict[str, float]) -> None:
    ratio = us["rec_ascend"] / us["inductor"]
    print(f"per call, {what}: " + "  ".join(f"{n} {v:8.1f} us" for n, v in us.items()) +
          f"  (rec_ascend / inductor {ratio:.3f})", flush=True)


def run_overhead(rounds: int = 20) -> None:
    """Microseconds per call, eager vs Inductor vs rec_ascend, side by side (interleaved, best round): a one-op
    graph (no rec region: rec_ascend returns Inductor's compile), one cross layer at batch 1 (a rec region: the
    tuner's choice, after its check in place), four embedding bags at batch 2 (one grouped lookup), each zoo model's
    forward at batch 1."""
    # A fresh function or module per backend: Dynamo keeps one cache per code object, not per backend.
    tiny = {"x + 1 on 8 elements": (lambda: lambda t: t + 1, (torch.randn(8),)),
            "one cross layer at batch 1": (_Cross, (torch.randn(1, 16),)),
            "grouped lookup of 4 tables at batch 2": (_Bags, (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])))}
    with torch.no_grad():
        for what, (make, args) in tiny.items():
            torch._dynamo.reset()
            fns = {"eager": make(), **{backend: torch.compile(make(), backend=backend) for backend in COMPILED}}
            steps = {n: functools.partial(f, *args) for n, f in fns.items()}
            _print_per_call(what, {n: ms * 1e3 for n, ms in race_ms(steps, rounds, iters=200, warmup=20).items()})
    for name in sorted(ZOO):
        torch._dynamo.reset()
        steps = {backend: backend_step(name, "small", backend, False, batch=1) for backend in ("eager", *COMPILED)}
        _print_per_call(f"{name} forward at batch 1",
                        {n: ms * 1e3 for n, ms in race_ms(steps, rounds, iters=20, warmup=20).items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.bench_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=[*INTERACTION, MAIN_JOB])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["train"])
    parser.add_argument("--repeats", type=int, default=1, help="cold compiles per backend (the median is printed)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--no-overhead", action="store_true", help="skip the per-call overhead measurements")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold compiles (per-call overhead only)")
    parser.add_argument("--warm", action="store_true",
                        help="each cold compile followed by a warm one, on the same cache folders")
    parser.add_argument("--json", help="the compiles' rows ('': none; default: docs/benchmarks/compile.json, "
                                       "compile_warm.json with --warm)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.warm or not args.no_cold:
        rows = (run_warm if args.warm else run_cold)(args.models, args.modes, args.repeats, args.threads)
        path = f"docs/benchmarks/compile{'_warm' * args.warm}.json" if args.json is None else args.json
        if path:
            from .bench_corpus import commit
            from .train import write_json

            write_json(path, {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                         f"{os.cpu_count()} cpus", "threads": args.threads, "commit": commit(),
                              "repeats": args.repeats, "load_1min": os.getloadavg()[0], "rows": rows,
                              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    if not args.no_overhead:
        run_overhead()


if __name__ == "__main__":
    main()
