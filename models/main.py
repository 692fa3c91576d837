"""The main job (``make run``): HSTU on MovieLens-100k compiled with rec_ascend, beside SASRec and popularity.

Trains HSTU and SASRec with the same epochs, embedding size and sampled-softmax loss, both compiled with
rec_ascend on this machine's CPU, evaluates HR@10 / NDCG@10 by full ranking on the leave-one-out test item,
and times HSTU's training step under eager PyTorch and rec_ascend for the speedup, interleaved round by round
in one run (``models.timing.race_ms``), so that load that changes during the job falls on both alike.
"""
from __future__ import annotations

import argparse

import torch

from . import data as D
from .metrics import popularity_scores, ranking_metrics, target_ranks
from .timing import race_ms
from .train import compile_for, make_optimizer, optimizer_step, sequential_batch, sequential_task
from .train import parser as train_parser
from .train import run_training, write_json


# Epochs of the main job and of models.compare: on the validation item both HSTU and SASRec still gain from 8 to
# ~16 epochs and level off by 20 (README, "Quality").
EPOCHS = 20


def popularity_ranks(split: D.LeaveOneOut, which: str) -> torch.Tensor:
    """Rank of each user's held-out item when every user is shown the most popular training items."""
    _, targets = split.held_out(which)
    scores = popularity_scores(split.train.items, split.num_items).expand(len(targets), -1)
    return target_ranks(scores, torch.from_numpy(targets))


def training_steps(settings, backends=("eager", "rec_ascend"), num_batches: int = 8) -> dict:
    """One HSTU training step per backend, as callables: copies of the model (same initial weights) stepping
    through the same ``num_batches`` batches in turn."""
    split = D.leave_one_out(D.load_ratings(settings.data, settings.data_path))
    windows = D.training_windows(split.train, settings.max_len)
    g = torch.Generator().manual_seed(settings.seed)
    rows = list(D.batches(len(windows), settings.batch_size, g))[:num_batches]
    steps = {}
    for backend in backends:
        torch.manual_seed(settings.seed)
        task = sequential_task(settings, split.num_items)
        fmt = task.encoder.input_format
        batches = [sequential_batch(settings, split, windows, r, fmt, torch.Generator().manual_seed(i))
                   for i, r in enumerate(rows)]
        step_fn = compile_for(task, backend)
        optimizer, _ = make_optimizer(settings, task.parameters(), 1)
        calls = iter(range(10**9))
        steps[backend] = lambda step_fn=step_fn, optimizer=optimizer, batches=batches, calls=calls: optimizer_step(
            optimizer, lambda: step_fn(*batches[next(calls) % len(batches)]))
    return steps


def interleaved_step_ms(settings, rounds: int, num_batches: int = 8) -> dict[str, float]:
    """Milliseconds per HSTU training step (the best round) under eager and rec_ascend (``training_steps``),
    timed one step each in turn, round by round."""
    return race_ms(training_steps(settings, num_batches=num_batches), rounds)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--timing-rounds", type=int, default=30,
                   help="rounds of HSTU training steps timed under eager and rec_ascend, one step each per round")
    p.add_argument("--json", help="write the results here")
    args, train_argv = p.parse_known_args(argv)
    common = ["--data", "ml-100k", "--epochs", str(args.epochs), *train_argv]
    settings = train_parser().parse_args(common)
    print(f"HSTU vs SASRec on MovieLens-100k, {args.epochs} epochs, dim {settings.dim}, max_len {settings.max_len}, "
          f"rec_ascend on CPU ({torch.get_num_threads()} threads), {settings.eval_split} item")

    def compiled(model: str) -> dict:
        return run_training(train_parser().parse_args(["--model", model, "--backend", "rec_ascend", *common]))

    results = {"hstu": compiled("hstu"), "sasrec": compiled("sasrec")}
    timed = interleaved_step_ms(train_parser().parse_args(["--model", "hstu", *common]), args.timing_rounds)
    popularity = ranking_metrics(popularity_ranks(D.leave_one_out(D.load_ratings()), settings.eval_split))
    print(f"\n{'model':12s} {'HR@10':>8s} {'NDCG@10':>8s} {'ms/step':>9s} {'compile s':>10s}")
    for model, result in results.items():
        m = result["metrics"]
        print(f"{model:12s} {m['HR@10']:8.4f} {m['NDCG@10']:8.4f} {result['ms_per_step']:9.1f} "
              f"{result['compile_s']:10.1f}")
    print(f"{'popularity':12s} {popularity['HR@10']:8.4f} {popularity['NDCG@10']:8.4f}")
    speedup = timed["eager"] / timed["rec_ascend"]
    print(f"\nHSTU training step, interleaved over {args.timing_rounds} rounds: eager {timed['eager']:.1f} ms, "
          f"rec_ascend {timed['rec_ascend']:.1f} ms ({speedup:.2f}x eager)")
    summary = {**results, "popularity": popularity, "hstu_eager_ms_per_step": timed["eager"],
               "hstu_rec_ascend_ms_per_step": timed["rec_ascend"], "hstu_speedup_over_eager": speedup}
    if args.json:
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
