"""ms/step of every zoo model under eager, Inductor and rec_ascend, measured side by side in one run.

    python -m models.bench [--models hstu sasrec ...] [--train] [--quick] [--threads N] [--json bench.json] [--png bench.png]

Inputs are the zoo's synthetic example inputs (labelled so). ``--train`` times forward + backward of the
training loss; otherwise a forward pass under ``torch.no_grad``. Each backend gets a fresh model built from
the same seed and warm-up steps (which compile); then the best of rounds that run every backend once in turn,
so that load from other processes falls on all of them alike. A row where rec_ascend is slower than the faster
of eager and Inductor by more than ``LOSS_MARGIN`` is flagged ``LOSS`` (the autotuner should have kept that one),
and ``LOSS (dynamo)`` where Dynamo alone (``backend="eager"``: the captured graphs run as they are, the floor of
every compiled backend) is as slow, so that the loss is Dynamo's per-call cost, not a choice of the autotuner.
"""
from __future__ import annotations

import argparse
import os

import torch

from .timing import race_ms
from .train import BACKENDS, compile_for, write_json
from .zoo import MODELS, SIZES


# rec_ascend slower than the faster of eager and Inductor by more than this share is flagged as a loss
# (the autotuner should have kept that one); below it, the difference is within this machine's noise.
LOSS_MARGIN = 0.10
# The small configs take 0.1-2 ms a step: 30 rounds cost well under a second a model, and the best of 5 was
# within this machine's noise of the 10% loss margin.
QUICK_ROUNDS = 30
# Dynamo with no compiler behind it: the per-call floor of any torch.compile backend.
DYNAMO = "dynamo"
COLUMNS = (*BACKENDS, DYNAMO)


def backend_step(name: str, size: str, backend: str, train: bool, batch: int | None = None,
                 device: torch.device = torch.device("cpu")):
    """One step of a fresh zoo model (same seed for every backend) under ``backend`` on ``device``; it returns the
    output (a forward step) or the loss (a training step)."""
    workload = MODELS[name](size, batch=batch).to(device)
    model = workload.model.train(train)
    fn = torch.compile(model, backend="eager") if backend == DYNAMO else compile_for(model, backend)
    inputs = workload.mark_dynamic()

    def step():
        if train:
            model.zero_grad(set_to_none=True)
            loss = workload.loss(fn(*inputs))
            loss.backward()
            return loss.detach()
        else:
            with torch.no_grad():
                return fn(*inputs)
    return step


def run(models: list[str], size: str, train: bool, rounds: int, progress=print) -> dict:
    rows = []
    for name in models:
        torch._dynamo.reset()
        steps = {backend: backend_step(name, size, backend, train) for backend in COLUMNS}
        ms = race_ms(steps, rounds)
        best_other = min(ms["eager"], ms["inductor"])
        row = {"model": name, "ms": ms, "eager_over_rec_ascend": ms["eager"] / ms["rec_ascend"],
               "inductor_over_rec_ascend": ms["inductor"] / ms["rec_ascend"],
               "loses": ms["rec_ascend"] > best_other * (1 + LOSS_MARGIN),
               "dynamo_floor": ms["rec_ascend"] <= ms[DYNAMO] * (1 + LOSS_MARGIN)}
        progress(format_row(row))
        rows.append(row)
    losses = [row["model"] + (" (dynamo)" if row["dynamo_floor"] else "") for row in rows if row["loses"]]
    progress(f"rec_ascend slower than min(eager, inductor) by more than {LOSS_MARGIN:.0%}: "
             f"{', '.join(losses) if losses else 'none'} (dynamo: Dynamo alone is as slow)")
    return {"mode": "train (forward + backward)" if train else "inference (forward)", "size": size,
            "data": "synthetic example inputs", "threads": torch.get_num_threads(), "rows": rows, "losses": losses}


HEADER = (f"{'model':26s} {'eager ms':>10s} {'inductor ms':>12s} {'rec_ascend ms':>14s} {'eager/rec':>10s} "
          f"{'inductor/rec':>13s} {'dynamo ms':>10s}  loss")


def format_row(row: dict) -> str:
    ms = row["ms"]
    return (f"{row['model']:26s} {ms['eager']:10.2f} {ms['inductor']:12.2f} {ms['rec_ascend']:14.2f} "
            f"{row['eager_over_rec_ascend']:9.2f}x {row['inductor_over_rec_ascend']:12.2f}x "
            f"{ms[DYNAMO]:10.2f}  {_loss(row)}")


def _loss(row: dict) -> str:
    return ("LOSS (dynamo)" if row["dynamo_floor"] else "LOSS") if row["loses"] else ""


def write_chart(result: dict, path: str) -> None:
    """Grouped bars of ms/step per model and backend (matplotlib, the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    width = 0.8 / len(BACKENDS)
    for i, backend in enumerate(BACKENDS):
        ax.bar([r + i * width for r in range(len(rows))], [row["ms"][backend] for row in rows], width, label=backend)
    ax.set_xticks([r + width for r in range(len(rows))], [row["model"] for row in rows], rotation=30, ha="right")
    ax.set_ylabel("ms / step")
    ax.set_yscale("log")
    ax.set_title(f"{result['mode']}, {result['size']} configs, {result['data']}")
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS), metavar="MODEL")
    p.add_argument("--train", action="store_true", help="time forward + backward of the training loss")
    p.add_argument("--size", default="bench", choices=SIZES)
    p.add_argument("--quick", action="store_true", help=f"small configs, {QUICK_ROUNDS} timed rounds")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds, each running every backend once in turn")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--png", default="bench.png")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size, rounds = ("small", QUICK_ROUNDS) if args.quick else (args.size, args.rounds)
    print(f"{'train' if args.train else 'forward'} ms/step, {size} configs, synthetic example inputs, "
          f"{torch.get_num_threads()} threads")
    print(HEADER)
    result = run(args.models, size, args.train, rounds)
    write_json(args.json, result)
    try:
        write_chart(result, args.png)
        print(f"wrote {args.json} and {args.png}")
    except ImportError:
        print(f"wrote {args.json}; no chart: matplotlib is not installed (pip install '.[bench]')")
    return result


if __name__ == "__main__":
    main()
