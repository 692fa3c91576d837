"""Choose each model's settings for the quality bars on the validation item, by one procedure for both models.

    python -m models.tune --pair sequential --seeds 0 1 --workers 1 --json tune_sequential.json

A pair (HSTU and SASRec; or the two-tower model's MoL and dot-product heads) is trained on every point of the
pair's grid, each model alike, on each seed, ranking the validation (second-to-last) item after every epoch.
A point's score is its metric averaged over the seeds and over the last ~15% of the run's epochs (one
epoch's figure swings more than the gaps looked for). The epoch count is shared by the pair: for each count,
each model's best point; the count where the two best scores sum highest wins, and each model keeps its best
point at that count. With a constant learning rate a run of the longest count also gives the shorter counts
(the curve after each epoch); a decaying schedule trains once per count. Every point tried is printed and
written to the JSON. ``--test-seeds`` then runs ``models.compare`` on the test item with the choice.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np

from . import compare
from .train import parser as train_parser
from .train import run_training, write_json

# pair -> (models, metric, settings both models share, grid: option -> values; "--epochs" is the shared count)
PAIRS = {
    "sequential": (("hstu", "sasrec"), "NDCG@10", ["--lr-schedule", "cosine", "--warmup-steps", "100"], {
        "--epochs": [20],
        "--num-layers": [2, 4],
        "--sampled-negatives": [256, 1024],
    }),
    "two_tower": (("two_tower_mol", "two_tower"), "HR@10", ["--batch-size", "256", "--max-len", "20",
                                                            "--lr-schedule", "constant", "--warmup-steps", "0"], {
        "--epochs": [3, 6],
        "--sampled-negatives": [128, 1024],
    }),
}


def tail(epochs: int) -> int:
    """Epochs averaged into a score: the last ~15% of the run (one epoch's figure swings more than the gaps)."""
    return max(1, round(0.15 * epochs))


def points(grid: dict[str, list], shared: list[str]) -> list[dict]:
    """The grid's points; with a constant schedule, the epoch counts collapse into one run of the longest."""
    options = [k for k in grid if k != "--epochs"]
    shared_schedule = train_parser().parse_args(shared).lr_schedule
    out = []
    for values in itertools.product(*(grid[k] for k in options)):
        point = dict(zip(options, values))
        counts = grid["--epochs"] if point.get("--lr-schedule", shared_schedule) == "constant" else None
        if counts is None:
            out += [{**point, "--epochs": e, "counts": [e]} for e in grid["--epochs"]]
        else:
            out.append({**point, "--epochs": max(counts), "counts": list(counts)})
    return out


def as_argv(point: dict) -> list[str]:
    return [str(x) for k, v in point.items() if k != "counts" for x in (k, v)]


def _train(job: tuple[list[str], float]) -> dict | None:
    argv, deadline = job
    if time.time() > deadline:  # budget spent before this run started: skipped for every model alike
        return None
    result = run_training(train_parser().parse_args(argv))
    print(f"{' '.join(argv)}: {result['curve'][-1]['metrics']}", flush=True)
    return {"curve": [c["metrics"] for c in result["curve"]], "seconds": result["steps"] * result["ms_per_step"] / 1e3}


def key(point: dict) -> str:
    return " ".join(as_argv({k: v for k, v in point.items() if k != "--epochs"}))


def run_grid(args, models, shared, grid) -> list[dict]:
    """Every (point, model, seed), the points in grid order so that a budget cut leaves whole points."""
    deadline = time.time() + args.budget_s
    todo = [(p, m, s) for p in points(grid, shared) for s in args.seeds for m in models]
    jobs = [(["--model", m, "--seed", str(s), "--eval-split", "valid", "--eval-every-epoch", "--quiet",
              "--backend", "eager", *shared, *args.train_args, *as_argv(p)], deadline) for p, m, s in todo]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=compare._init_worker,
                             initargs=(1,)) as pool:
        runs = list(pool.map(_train, jobs))
    return [{"point": p, "model": m, "seed": s, **r} for (p, m, s), r in zip(todo, runs) if r is not None]


def scores(runs: list[dict], models, metric: str, seeds) -> dict:
    """(model, epochs, point key) -> mean over seeds of the metric averaged over the tail epochs up to epochs;
    only points trained for every model and seed."""
    table = {}
    for run in runs:
        for e in run["point"]["counts"]:
            last = [c[metric] for c in run["curve"][e - tail(e):e]]
            table.setdefault((run["model"], e, key(run["point"])), {})[run["seed"]] = float(np.mean(last))
    complete = {k for k in {(e, p) for _, e, p in table}
                if all(len(table.get((m, *k), {})) == len(seeds) for m in models)}
    return {(m, e, p): float(np.mean(list(v.values()))) for (m, e, p), v in table.items() if (e, p) in complete}


def choose(table: dict, models) -> dict:
    """The shared epoch count where the models' best points sum highest, and each model's best point there."""
    best = {}
    for (m, e, p), score in table.items():
        if score > best.get((m, e), ("", -1.0))[1]:
            best[(m, e)] = (p, score)
    counts = sorted({e for _, e in best if all((m, e) in best for m in models)})
    if not counts:
        raise RuntimeError("no grid point was trained for every model and seed within the budget")
    epochs = max(counts, key=lambda e: sum(best[(m, e)][1] for m in models))
    return {"epochs": epochs, **{m: {"args": f"--epochs {epochs} {best[(m, epochs)][0]}",
                                     "score": best[(m, epochs)][1]} for m in models}}


def report(table: dict, models, metric: str) -> None:
    rows = sorted({(e, p) for _, e, p in table}, key=lambda r: -sum(table[(m, *r)] for m in models))
    print(f"\nvalidation {metric} (mean over seeds and the last ~15% of epochs), best pair sums first")
    print(" ".join(f"{m:>13s}" for m in models) + "  epochs  point")
    for e, p in rows:
        print(" ".join(f"{table[(m, e, p)]:13.4f}" for m in models) + f"  {e:6d}  {p}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", required=True, choices=sorted(PAIRS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--workers", type=int, default=1, help="training runs at once, one thread each")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no run after this many seconds (points left unfinished are dropped for both models)")
    p.add_argument("--test-seeds", type=int, nargs="*", default=[],
                   help="then run models.compare on the test item with the chosen settings on these seeds")
    p.add_argument("--json", help="write every point's scores and the choice here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args, args.train_args = parser().parse_known_args(argv)
    models, metric, shared, grid = PAIRS[args.pair]
    start = time.perf_counter()
    runs = run_grid(args, models, shared, grid)
    table = scores(runs, models, metric, args.seeds)
    report(table, models, metric)
    choice = choose(table, models)
    print(f"\nchosen ({len(runs)} runs in {(time.perf_counter() - start) / 60:.1f} min): shared epochs "
          f"{choice['epochs']}; " + "; ".join(f"{m}: {choice[m]['args']} ({choice[m]['score']:.4f})" for m in models))
    out = {"pair": args.pair, "metric": metric, "seeds": args.seeds, "shared": shared, "grid": grid,
           "train_args": args.train_args, "choice": choice,
           "scores": [{"model": m, "epochs": e, "point": p, "score": s} for (m, e, p), s in table.items()],
           "runs": runs}
    if args.json:
        write_json(args.json, out)
    if args.test_seeds:
        test_argv = ["--models", *models, "--seeds", *map(str, args.test_seeds), "--workers", str(args.workers),
                     *[x for m in models for x in ("--model-args", m, " ".join([*shared, *choice[m]["args"].split()]))],
                     *(["--json", args.json.replace(".json", "_test.json")] if args.json else []), *args.train_args]
        out["test"] = compare.main(test_argv)
    return out


if __name__ == "__main__":
    main()
