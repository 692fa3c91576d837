"""Compile cost of rec_ascend against Inductor: cold compile time of a step, and the per-call overhead.

    python -m models.bench_compile [--models interaction-dlrm interaction-dcn hstu-ml100k deepfm ...]
                                   [--modes train forward] [--repeats N] [--threads N] [--no-overhead] [--no-cold]

Cold compile: each (model, mode, backend) runs in a fresh process with empty Inductor and recompile caches
(``TORCHINDUCTOR_CACHE_DIR``, ``RECOMPILE_CACHE_DIR``); the figure is the first step's time minus a steady
step's, and beside it the same difference in the process's own CPU time (all its threads; not Inductor's
kernel-compile workers), which load from other processes moves less than wall time. Backends alternate within each repeat, so that load from other processes falls on both alike; the
median of the repeats is printed, with rec_ascend's autotune decisions: the candidate kept, the seconds each
candidate took to build (Inductor's compile) and the Inductor graphs it left uncompiled. Models:
``interaction-dlrm`` and ``interaction-dcn`` are ``models.bench_interaction``'s (batch 256), ``hstu-ml100k`` the
main job's HSTU on MovieLens-100k (training only, 3 steps of ``models.train``), any other name a zoo model's
small config.

Per-call overhead: microseconds per call of a one-op graph on an 8-element tensor (no rec region), of one cross
layer at batch 1 (a rec region, raced), of four embedding bags at batch 2 (one grouped lookup: the custom op's
own cost), and of each zoo model's forward at batch 1 (small configs), under eager, Inductor and rec_ascend, timed
side by side, with rec_ascend's over Inductor's.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .bench import backend_step
from .timing import race_ms
from .zoo import MODELS as ZOO

COMPILED = ("inductor", "rec_ascend")
MAIN_JOB = "hstu-ml100k"
# models.bench_interaction's DLRM and DCN-v2 (batch 256), by their name there.
INTERACTION = {"interaction-dlrm": "dlrm", "interaction-dcn": "dcn"}
MODELS = (*INTERACTION, MAIN_JOB, *sorted(ZOO))
MODES = ("train", "forward")


def _interaction_step(name: str, mode: str, backend: str):
    from .bench_interaction import make, step_fn, synthetic_batch

    model, cfg = make(name, True)
    args = synthetic_batch(cfg, 256, torch.Generator().manual_seed(1))
    fn = step_fn(torch.compile(model, backend=backend), mode)
    return functools.partial(fn, *args)


def _main_job_compile_s(backend: str) -> float:
    from .train import parser, run_training

    args = parser().parse_args(["--model", "hstu", "--data", "ml-100k", "--epochs", "1", "--max-steps", "3",
                                "--quiet", "--backend", backend])
    return run_training(args)["compile_s"]


def child(model: str, mode: str, backend: str) -> dict:
    """In a fresh process: seconds of the first step beyond a steady one, and the autotune decisions stored."""
    start_cpu = time.process_time()
    if model == MAIN_JOB:
        cold = _main_job_compile_s(backend)
        cpu = time.process_time() - start_cpu
    else:
        step = _interaction_step(INTERACTION[model], mode, backend) if model in INTERACTION else \
            backend_step(model, "small", backend, mode == "train")
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        first, first_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        cold, cpu = first - (time.perf_counter() - start), first_cpu - (time.process_time() - start_cpu)
    folder = Path(os.environ["RECOMPILE_CACHE_DIR"]) / "autotune"
    decisions = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return {"cold_s": cold, "cpu_s": cpu, "decisions": [
        {"choice": d["choice"], "compile_s": d.get("compile_s", {}),
         "not_compiled": sorted(n for n, why in d["rejected"].items() if why.startswith("not compiled"))}
        for d in decisions]}


def cold_compile(model: str, mode: str, backend: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   RECOMPILE_CACHE_DIR=os.path.join(cache, "recompile"), OMP_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, "-m", f"{__package__}.bench_compile", "--child", model, mode, backend],
                             env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"cold compile of {model} ({mode}, {backend}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _describe(decisions: list[dict]) -> str:
    parts = []
    for d in decisions:
        built = ", ".join(f"{name} {s:.1f} s" for name, s in d["compile_s"].items() if s >= 0.05)
        skipped = f"; not compiled: {', '.join(d['not_compiled'])}" if d["not_compiled"] else ""
        parts.append(f"kept {d['choice']} (built: {built or 'nothing to compile'}{skipped})")
    return " | ".join(parts)


def run_cold(models: list[str], modes: list[str], repeats: int, threads: int) -> list[dict]:
    rows = []
    for model in models:
        for mode in (["train"] if model == MAIN_JOB else modes):
            runs = {backend: [] for backend in COMPILED}
            for _ in range(repeats):
                for backend in COMPILED:
                    runs[backend].append(cold_compile(model, mode, backend, threads))
            seconds = {backend: statistics.median(r["cold_s"] for r in results) for backend, results in runs.items()}
            cpu = {backend: statistics.median(r["cpu_s"] for r in results) for backend, results in runs.items()}
            row = {"model": model, "mode": mode, **seconds, "ratio": seconds["rec_ascend"] / seconds["inductor"],
                   "cpu_s": cpu, "cpu_ratio": cpu["rec_ascend"] / max(cpu["inductor"], 1e-9),
                   "decisions": runs["rec_ascend"][-1]["decisions"]}
            rows.append(row)
            print(f"{model:24s} {mode:8s} cold compile: inductor {row['inductor']:6.1f} s  rec_ascend "
                  f"{row['rec_ascend']:6.1f} s  ({row['ratio']:4.2f}x Inductor's; the compiling process's own CPU "
                  f"{row['cpu_ratio']:4.2f}x)  {_describe(row['decisions'])}", flush=True)
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
    parser.add_argument("--json", default="docs/benchmarks/compile.json", help="the cold compiles' rows ('': none)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_cold:
        rows = run_cold(args.models, args.modes, args.repeats, args.threads)
        if args.json:
            from .bench_corpus import commit  # (imports the corpus: not in the children)
            from .train import write_json

            write_json(args.json, {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                              f"{os.cpu_count()} cpus", "threads": args.threads, "commit": commit(),
                                   "repeats": args.repeats, "load_1min": os.getloadavg()[0], "rows": rows,
                                   "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    if not args.no_overhead:
        run_overhead()


if __name__ == "__main__":
    main()
