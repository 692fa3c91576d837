"""The model zoo's quality bars on MovieLens-100k, over several seeds, with paired comparisons.

    python -m models.compare --seeds 0 1 2 3 4 --json quality.json

Trains HSTU and SASRec with the same settings (epochs, embedding size, loss: ``models.train``'s, shared), and
the two-tower model with its dot-product and its mixture-of-logits head (same embedding size, settings shared by
the two heads), on each seed, and ranks every user's held-out item among all items. Prints per-seed and
mean +- std HR@10 / NDCG@10 beside the popularity baseline, then each bar as a paired comparison: the
difference per seed (same seed = same data order and negatives), and a paired bootstrap over users of the
difference of each user's gain averaged over the seeds. A bar holds when the bootstrap's 95% interval is above 0.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np
import torch

from . import data as D
from .main import EPOCHS, popularity_ranks
from .metrics import ranking_metrics, user_gains
from .train import parser as train_parser
from .train import run_training, write_json

MODELS = ("hstu", "sasrec", "two_tower_mol", "two_tower")  # longest first: the workers finish together
LABELS = {"hstu": "HSTU", "sasrec": "SASRec", "two_tower": "two-tower dot", "two_tower_mol": "two-tower MoL",
          "popularity": "popularity", "sid_gr": "SID-GR"}
K = 10
METRICS = (f"HR@{K}", f"NDCG@{K}")
# The two-tower model trains on (user, item) pairs, one per training interaction: fewer epochs, a larger batch,
# the 20 most recent items as the user's history, a constant learning rate (both heads alike; the epochs and
# negatives chosen on the validation item by models.tune).
TWO_TOWER_ARGS = ["--epochs", "6", "--batch-size", "256", "--max-len", "20", "--sampled-negatives", "1024",
                  "--lr-schedule", "constant", "--warmup-steps", "0"]
# Each model's own settings on top of the shared ones (chosen on the validation item by models.tune).
MODEL_ARGS = {"hstu": [], "sasrec": [], "two_tower": TWO_TOWER_ARGS, "two_tower_mol": TWO_TOWER_ARGS}


@dataclass(frozen=True)
class Bar:
    """One quality bar: ``better`` beats ``worse`` on ``metric``."""

    better: str
    worse: str
    metric: str


BARS = (Bar("hstu", "sasrec", f"NDCG@{K}"), Bar("hstu", "popularity", f"NDCG@{K}"),
        Bar("sasrec", "popularity", f"NDCG@{K}"), Bar("two_tower_mol", "two_tower", f"HR@{K}"))


def _train(argv: list[str]) -> dict:
    result = run_training(train_parser().parse_args(argv))
    return {key: result[key] for key in ("model", "seed", "metrics", "ranks", "ms_per_step", "steps")}


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def paired(better: np.ndarray, worse: np.ndarray, per_seed: tuple[list[float], list[float]] | None,
           resamples: int = 10_000) -> dict:
    """Paired comparison of per-user gains [seeds, users] (a baseline has one row, repeated): per-seed differences
    and a bootstrap over users of the mean difference of the seed-averaged gains."""
    diff = better.mean(0) - worse.mean(0)  # [users]
    rng = np.random.default_rng(0)
    boot = diff[rng.integers(0, len(diff), (resamples, len(diff)))].mean(1)
    out = {"mean_diff": float(diff.mean()), "ratio": float(better.mean() / worse.mean()),
           "bootstrap_ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
           "bootstrap_p_not_better": float((boot <= 0).mean())}
    if per_seed is not None:
        d = np.array(per_seed[0]) - np.array(per_seed[1])
        out.update(seed_diffs=d.tolist(), seed_wins=int((d > 0).sum()),
                   seed_diff_std=float(d.std(ddof=1)) if len(d) > 1 else 0.0)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=EPOCHS, help="HSTU and SASRec (the two-tower heads: 3)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--backend", default="eager", choices=("eager", "inductor", "rec_ascend"),
                   help="eager by default: rec_ascend trains the same curve (tests/test_models.py) and compiles per run")
    p.add_argument("--eval-split", default="test", choices=D.EVAL_SPLITS,
                   help="valid to choose settings; test (the default) to report them")
    p.add_argument("--workers", type=int, default=2, help="training runs at once, one thread each")
    p.add_argument("--model-args", nargs=2, action="append", default=[], metavar=("MODEL", "ARGS"),
                   help="replace MODEL's own settings (MODEL_ARGS) by ARGS, one string of models.train options")
    p.add_argument("--json", help="write the results here")
    return p


def train_runs(args, common: list[str], own: dict[str, list[str]]) -> dict[str, list[dict]]:
    """model -> its runs, one per seed, ``args.workers`` at a time; ``own``: each model's own settings."""
    jobs = [["--model", m, "--seed", str(s), *common, *own[m]] for m in args.models for s in args.seeds]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(1,)) as pool:
        runs = list(pool.map(_train, jobs))
    return {m: [r for r in runs if r["model"] == m] for m in args.models}


def seed_table(by_model: dict[str, list[dict]], popularity: dict, seeds: list[int]) -> dict:
    """Print and return every model's metrics per seed, mean and std."""
    print(f"\n{'model':14s} {'metric':8s} " + " ".join(f"{'seed ' + str(s):>8s}" for s in seeds)
          + f" {'mean':>8s} {'std':>7s}")
    summary = {}
    for model, model_runs in by_model.items():
        summary[model] = {}
        for metric in METRICS:
            values = [r["metrics"][metric] for r in model_runs]
            mean, std = float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            summary[model][metric] = {"per_seed": values, "mean": mean, "std": std}
            print(f"{LABELS[model]:14s} {metric:8s} " + " ".join(f"{v:8.4f}" for v in values)
                  + f" {mean:8.4f} {std:7.4f}")
    for metric in METRICS:
        print(f"{'popularity':14s} {metric:8s} {' ' * 9 * len(seeds)}{popularity[metric]:8.4f}")
    summary["popularity"] = {m: {"per_seed": None, "mean": popularity[m], "std": 0.0} for m in METRICS}
    return summary


def check_bars(summary: dict, gains: dict[str, dict[str, np.ndarray]], num_seeds: int) -> list[dict]:
    """Print and return each bar's paired comparison (bars over models not trained are skipped)."""
    comparisons = []
    for bar in BARS:
        if bar.better not in gains or bar.worse not in gains:
            continue
        per_seed = None if "popularity" in (bar.better, bar.worse) else (
            summary[bar.better][bar.metric]["per_seed"], summary[bar.worse][bar.metric]["per_seed"])
        result = paired(gains[bar.better][bar.metric], gains[bar.worse][bar.metric], per_seed)
        holds = result["bootstrap_ci95"][0] > 0
        comparisons.append({"better": bar.better, "worse": bar.worse, "metric": bar.metric, "holds": holds,
                            **result})
        lo, hi = result["bootstrap_ci95"]
        seeds = "" if per_seed is None else (f"; wins on {result['seed_wins']}/{num_seeds} seeds, "
                                             f"per-seed diff std {result['seed_diff_std']:.4f}")
        print(f"  {LABELS[bar.better]} > {LABELS[bar.worse]} on {bar.metric}: "
              f"{summary[bar.better][bar.metric]['mean']:.4f} vs {summary[bar.worse][bar.metric]['mean']:.4f} "
              f"(x{result['ratio']:.2f}, diff {result['mean_diff']:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}], "
              f"P(diff<=0) {result['bootstrap_p_not_better']:.3f}{seeds}) -> {'holds' if holds else 'NOT shown'}")
    return comparisons


def main(argv: list[str] | None = None) -> dict:
    args, train_argv = parser().parse_known_args(argv)
    train_argv = ["--data", "ml-100k", "--epochs", str(args.epochs), *train_argv]
    settings = train_parser().parse_args(train_argv)
    common = ["--backend", args.backend, "--eval-split", args.eval_split, "--quiet", *train_argv]
    own = {**MODEL_ARGS, **{m: a.split() for m, a in args.model_args}}
    parts = [f"shared: {settings.epochs} epochs, dim {settings.dim}, max_len {settings.max_len}, lr {settings.lr} "
             f"({settings.lr_schedule}, {settings.warmup_steps} warmup steps), {settings.sampled_negatives} sampled "
             f"negatives, temperature {settings.temperature}",
             *(f"{LABELS[m]}: {' '.join(own[m])}" for m in args.models if own[m]),
             f"{args.backend}, {args.workers} workers x 1 thread"]
    print(f"Quality on MovieLens-100k, {args.eval_split} item, full ranking; seeds {args.seeds}; " + "; ".join(parts),
          flush=True)
    start = time.perf_counter()
    by_model = train_runs(args, common, own)

    split = D.leave_one_out(D.load_ratings())
    baseline_ranks = popularity_ranks(split, args.eval_split)
    summary = seed_table(by_model, ranking_metrics(baseline_ranks), args.seeds)
    gains = {m: {metric: torch.stack([user_gains(torch.tensor(r["ranks"]), metric) for r in rs]).numpy()
                 for metric in METRICS} for m, rs in by_model.items()}
    gains["popularity"] = {metric: user_gains(baseline_ranks, metric)[None].numpy() for metric in METRICS}
    print(f"\nbars (paired: differences per seed; bootstrap over {len(baseline_ranks)} users of the seed-averaged "
          "gains)")
    comparisons = check_bars(summary, gains, len(args.seeds))
    elapsed = time.perf_counter() - start
    runs = [r for model_runs in by_model.values() for r in model_runs]
    print(f"\n{len(runs)} training runs in {elapsed / 60:.1f} min")
    out = {"eval_split": args.eval_split, "seeds": args.seeds, "backend": args.backend, "settings": vars(settings),
           "model_args": own, "summary": summary, "bars": comparisons, "runs": [{k: r[k] for k in r if k != "ranks"} for r in runs],
           "seconds": elapsed}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
