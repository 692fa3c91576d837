"""Train and evaluate a zoo model on real (MovieLens) or Criteo-shaped synthetic data.

    python -m models.train --model hstu --data ml-100k --backend rec_ascend --epochs 4 [--json out.json]

Sequential models (hstu, sasrec) and two-tower models learn next items with sampled softmax and are evaluated
by HR@K / NDCG@K over a full ranking of all items on the leave-one-out test item. CTR models train on
Criteo-shaped synthetic data (labelled so in the output) and report AUC / log-loss. Prints and writes
metrics, the loss curve, throughput and compile time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from . import data as D
from .dlrm import to_kjt
from .metrics import auc, log_loss, ranking_metrics, target_ranks
from .retrieval import InBatchSoftmaxTask
from .sequential import NextItemTask
from .zoo import CTR_MODELS, MODELS, SEQUENTIAL, sequential_encoder, two_tower

BACKENDS = ("eager", "inductor", "rec_ascend")
DATASETS = ("ml-100k", "ml-1m", "ml-20m", "criteo-synthetic")


def compile_for(module: nn.Module, backend: str):
    import recompile  # noqa: F401  (names backend="rec_ascend" where the package is not installed)

    return module if backend == "eager" else torch.compile(module, backend=backend)


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.tty = sys.stderr.isatty()

    def update(self, loss: float) -> None:
        self.done += 1
        if not self.enabled or (not self.tty and self.done != self.total):
            return
        filled = int(30 * self.done / self.total)
        end = "\n" if self.done == self.total else ""
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                         f"loss {loss:.4f}{end}")
        sys.stderr.flush()


@dataclass
class Run:
    """Losses and step times of a training run; the first step of each epoch holds any compilation."""

    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    examples: int = 0
    max_steps: int | None = None
    # per epoch: its mean training loss and, with --eval-every-epoch, the held-out metrics after it
    curve: list[dict] = field(default_factory=list)
    _epoch_start: int = 0

    def step(self, fn, examples: int) -> float:
        start = time.perf_counter()
        loss = fn()
        self.step_seconds.append(time.perf_counter() - start)
        self.losses.append(loss)
        self.examples += examples
        return loss

    def end_epoch(self, held_out_ranks=None) -> None:
        losses = self.losses[self._epoch_start:]
        self._epoch_start = len(self.losses)
        record = {"epoch": len(self.curve) + 1, "mean_loss": float(np.mean(losses))}
        if held_out_ranks is not None:
            record["metrics"] = ranking_metrics(held_out_ranks())
        self.curve.append(record)

    @property
    def finished(self) -> bool:
        return self.max_steps is not None and len(self.losses) >= self.max_steps

    def summary(self) -> dict:
        steady = self.step_seconds[1:] or self.step_seconds
        step_s = float(np.median(steady))
        return {
            "steps": len(self.losses),
            "ms_per_step": step_s * 1e3,
            "examples_per_s": self.examples / sum(self.step_seconds),
            "compile_s": max(0.0, self.step_seconds[0] - step_s),
            "losses": self.losses,
            "curve": self.curve,
        }


def optimizer_step(optimizer: torch.optim.Optimizer, compute_loss, scheduler=None) -> float:
    optimizer.zero_grad()
    loss = compute_loss()
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def make_optimizer(args, parameters, total_steps: int):
    """AdamW (plain Adam at weight decay 0) and the learning-rate schedule: constant, or cosine decay to 0,
    either after ``--warmup-steps`` of linear warmup."""
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=args.weight_decay)
    warmup = args.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if args.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def sequential_task(args, num_items: int) -> NextItemTask:
    """The next-item task of ``args.model`` (SASRec, HSTU) with the run's sizes, on ``args.device``."""
    heads = args.num_heads
    encoder = sequential_encoder(args.model, num_items, dim=args.dim, max_len=args.max_len,
                                 num_layers=args.num_layers, num_heads=heads, dropout=args.dropout,
                                 **({"attn_dim": args.dim // heads, "linear_dim": args.dim // heads}
                                    if args.model == "hstu" else {}))
    return NextItemTask(encoder, temperature=args.temperature).to(args.device)


def sequential_batch(args, split: D.LeaveOneOut, windows, rows, fmt: str, g: torch.Generator) -> tuple:
    """One training batch of the next-item task in input format ``fmt``: (targets, negatives, *inputs), on
    ``args.device``."""
    inputs, targets = D.next_item_batch(windows, rows, fmt, args.max_len)
    negatives = D.sample_negatives(targets.flatten(), args.in_batch_negatives, split.num_items,
                                   args.sampled_negatives, g)
    return mark_sequence_dynamic(tuple(t.to(args.device) for t in (targets, negatives, *inputs)))


def train_sequential(args, split: D.LeaveOneOut, run: Run) -> tuple[nn.Module, dict]:
    task = sequential_task(args, split.num_items)
    fmt = task.encoder.input_format
    step_fn = compile_for(task, args.backend)
    windows = D.training_windows(split.train, args.max_len)
    g = torch.Generator().manual_seed(args.seed)
    num_batches = math.ceil(len(windows) / args.batch_size)
    optimizer, scheduler = make_optimizer(args, task.parameters(), num_batches * args.epochs)
    ranks = lambda: sequential_ranks(task, split, fmt, args.max_len, args.eval_split)  # noqa: E731
    for epoch in range(args.epochs):
        task.train()
        bar = Progress(num_batches, f"{args.model} epoch {epoch + 1}/{args.epochs}", not args.quiet)
        for rows in D.batches(len(windows), args.batch_size, g):
            batch = sequential_batch(args, split, windows, rows, fmt, g)
            bar.update(run.step(lambda: optimizer_step(optimizer, lambda: step_fn(*batch), scheduler), len(rows)))
            if run.finished:
                return task, None
        run.end_epoch(ranks if args.eval_every_epoch else None)
    return task, ranks()


def mark_sequence_dynamic(batch: tuple) -> tuple:
    """Batch and jagged-total dims vary; the negatives' count and the padded length do not."""
    for index, tensor in enumerate(batch):
        if index != 1:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return batch


@torch.no_grad()
def sequential_ranks(task: NextItemTask, split: D.LeaveOneOut, fmt: str, max_len: int,
                     which: str = "test") -> torch.Tensor:
    """0-based rank of every user's held-out item among all items (see ``metrics.target_ranks``)."""
    task.eval()
    history, targets = split.held_out(which)
    items = task.item_embeddings()
    ranks = []
    for rows in D.batches(len(targets), 256):
        inputs, last = D.history_inputs(history, rows, fmt, max_len)
        users = task.user_embeddings(*(t.to(items.device) for t in inputs), last=last.to(items.device))
        ranks.append(target_ranks(users @ items.t(), torch.from_numpy(targets[rows]).to(items.device)).cpu())
    return torch.cat(ranks)


def train_two_tower(args, split: D.LeaveOneOut, run: Run) -> tuple[nn.Module, dict]:
    num_users = len(split.train)
    model = two_tower(args.model, num_users, split.num_items, args.dim, temperature=args.temperature,
                      components=args.mol_components)
    task = InBatchSoftmaxTask(model).to(args.device)
    step_fn = compile_for(task, args.backend)
    pairs = D.user_item_pairs(split.train, args.max_len)
    g = torch.Generator().manual_seed(args.seed)
    num_batches = math.ceil(len(pairs.users) / args.batch_size)
    optimizer, scheduler = make_optimizer(args, task.parameters(), num_batches * args.epochs)
    ranks = lambda: two_tower_ranks(model, split, args.max_len, args.eval_split)  # noqa: E731
    for epoch in range(args.epochs):
        task.train()
        bar = Progress(num_batches, f"{args.model} epoch {epoch + 1}/{args.epochs}", not args.quiet)
        for rows in D.batches(len(pairs.users), args.batch_size, g):
            history, offsets = D.bags([pairs.history[r] for r in rows])
            positives = pairs.items[rows]
            negatives = torch.randint(1, split.num_items + 1, (args.sampled_negatives,), generator=g)
            batch = tuple(t.to(args.device) for t in (pairs.users[rows], history, offsets, positives, negatives))
            for tensor in batch[:4]:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            bar.update(run.step(lambda: optimizer_step(optimizer, lambda: step_fn(*batch), scheduler), len(rows)))
            if run.finished:
                return task, None
        run.end_epoch(ranks if args.eval_every_epoch else None)
    return task, ranks()


@torch.no_grad()
def two_tower_ranks(model, split: D.LeaveOneOut, history_len: int, which: str = "test") -> torch.Tensor:
    model.eval()
    history, targets = split.held_out(which)
    device = model.item_emb.weight.device
    items = torch.arange(1, split.num_items + 1, device=device)
    ranks = []
    for rows in D.batches(len(targets), 128):
        bags, offsets = D.bags([history.items[r][-history_len:] for r in rows])
        scores = model(torch.from_numpy(rows).to(device), bags.to(device), offsets.to(device), items)
        ranks.append(target_ranks(scores, torch.from_numpy(targets[rows]).to(device)).cpu())
    return torch.cat(ranks)


def train_ctr(args, run: Run) -> tuple[nn.Module, dict]:
    workload = MODELS[args.model](args.size, seed=args.seed, dynamic_embeddings=args.dynamic_embeddings)
    model, cfg = workload.model, workload.model.cfg
    n_test = args.ctr_rows // 10
    rows = D.criteo_synthetic(args.ctr_rows + n_test, cfg.table_rows, cfg.num_dense, cfg.max_ids_per_bag,
                              seed=args.seed)
    as_inputs = (lambda b: (b[0], to_kjt(cfg, b[1], b[2]))) if args.model == "dlrm_torchrec" else (lambda b: b[:3])
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1  # a worker of --nproc (or of torchrun)
    from .bench_distributed import shard_ctr_model
    model, rank, world_size = shard_ctr_model(args.model, model, args.batch_size, args.backend) if distributed \
        else (model, 0, 1)
    step_fn = compile_for(model, args.backend)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    num_batches = math.ceil(args.ctr_rows / args.batch_size)
    for epoch in range(args.epochs):
        model.train()
        bar = Progress(num_batches, f"{args.model} epoch {epoch + 1}/{args.epochs}", not args.quiet and rank == 0)
        for index in D.batches(args.ctr_rows, args.batch_size, g):
            if len(index) < world_size:
                continue
            batch = rows.batch(np.array_split(index, world_size)[rank])  # this rank's slice of the global batch
            inputs = workload.mark_dynamic(as_inputs(batch))
            loss = lambda: nn.functional.binary_cross_entropy_with_logits(step_fn(*inputs), batch[3])  # noqa: E731
            bar.update(run.step(lambda: optimizer_step(optimizer, loss), len(index)))
            if run.finished:
                return model, {}
    model.eval()
    with torch.no_grad():
        test = rows.batch(np.arange(args.ctr_rows, args.ctr_rows + n_test))
        logits = model(*as_inputs(test))
    return model, {"AUC": auc(test[3], logits), "log_loss": log_loss(test[3], logits), "data_note": rows.note}


def run_training(args) -> dict:
    torch.manual_seed(args.seed)
    run = Run(max_steps=args.max_steps)
    if args.dynamic_embeddings and not MODELS[args.model].dynamic_embeddings:
        raise ValueError(f"--dynamic-embeddings: model {args.model!r} has no dynamic-embedding variant; models with "
                         f"one: {', '.join(n for n, e in MODELS.items() if e.dynamic_embeddings)}")
    if args.model in CTR_MODELS:
        if args.data != "criteo-synthetic":
            raise ValueError(f"CTR model {args.model!r} trains on --data criteo-synthetic, not {args.data!r}")
        _, metrics = train_ctr(args, run)
        held_out = {}
        data_desc = f"criteo-synthetic ({D.SYNTHETIC_NOTE}), {args.ctr_rows} training rows"
    else:
        if args.data == "criteo-synthetic":
            raise ValueError(f"model {args.model!r} needs MovieLens data (--data ml-100k or --data-path)")
        ratings = D.load_ratings(args.data, args.data_path)
        split = D.leave_one_out(ratings)
        train = train_sequential if args.model in SEQUENTIAL else train_two_tower
        _, ranks = train(args, split, run)
        metrics = {} if ranks is None else ranking_metrics(ranks)
        held_out = {} if ranks is None else {"ranks": ranks.tolist()}  # per user, for paired comparisons
        data_desc = f"{args.data} ({len(ratings)} ratings, {ratings.num_users} users, {ratings.num_items} items)"
    return {
        "model": args.model, "data": data_desc, "backend": args.backend, "epochs": args.epochs, "dim": args.dim,
        "max_len": args.max_len, "eval_split": args.eval_split, "seed": args.seed,
        "dynamic_embeddings": args.dynamic_embeddings, "metrics": metrics, **held_out,
        **run.summary(),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hstu", choices=sorted(MODELS))
    p.add_argument("--data", default="ml-100k", choices=DATASETS)
    p.add_argument("--data-path", help="GroupLens ratings.dat (ML-1M) or ratings.csv (ML-20M)")
    p.add_argument("--backend", default="rec_ascend", choices=BACKENDS)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64, help="embedding size (sequential and two-tower models)")
    p.add_argument("--max-len", type=int, default=100, help="history length (sequential and two-tower models)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2, help="sequential models (HSTU: q/k/u/v dims dim / heads)")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--in-batch-negatives", type=int, default=0,
                   help="sequential models: negatives drawn from the batch's targets (popularity-biased: no logQ "
                        "correction, so they penalise popular items)")
    p.add_argument("--sampled-negatives", type=int, default=1024, help="uniformly sampled negatives")
    p.add_argument("--temperature", type=float, default=0.05, help="softmax temperature (sequential and two-tower)")
    p.add_argument("--mol-components", type=int, default=4, help="two_tower_mol: user and item components each")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    p.add_argument("--lr-schedule", default="cosine", choices=("constant", "cosine"))
    p.add_argument("--warmup-steps", type=int, default=100, help="linear learning-rate warmup")
    p.add_argument("--device", default="cpu", help="sequential and two-tower models: torch device to train on")
    p.add_argument("--eval-split", default="test", choices=D.EVAL_SPLITS,
                   help="held-out item to rank: valid (second-to-last, for choosing settings) or test (last)")
    p.add_argument("--eval-every-epoch", action="store_true",
                   help="sequential and two-tower models: evaluate on --eval-split after every epoch (the curve in "
                        "the JSON's 'curve')")
    p.add_argument("--size", default="small", choices=("small", "bench"), help="CTR model size")
    p.add_argument("--ctr-rows", type=int, default=50_000, help="synthetic CTR training rows")
    p.add_argument("--dynamic-embeddings", action="store_true",
                   help="CTR models: sparse tables as hkv.DynamicEmbeddingBag hash tables (fused SGD row updates)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (no evaluation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, default=1, help="CTR models: train on N local processes (torch's launcher, "
                   "gloo on CPU): tables sharded, dense layers data-parallel, --batch-size split over the ranks")
    return p


def write_json(path: str, result: dict) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
        json.dump(result, f, indent=2)
    os.replace(f.name, path)


def format_result(result: dict) -> str:
    metrics = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in result["metrics"].items())
    return (f"{result['model']} on {result['data']}, backend {result['backend']}, {result['epochs']} epochs, "
            f"{result['eval_split']} item\n"
            f"  {metrics}\n  final loss {result['losses'][-1]:.4f}  {result['ms_per_step']:.1f} ms/step  "
            f"{result['examples_per_s']:.0f} examples/s  compile {result['compile_s']:.1f} s")


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # start N workers running this command, wait for them
        from recompile.launch import relaunch

        relaunch(args.nproc, f"{__package__}.train", sys.argv[1:] if argv is None else argv)
        return {}
    result = run_training(args)
    if int(os.environ.get("RANK", 0)):
        return result
    print(format_result(result))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
