"""An LSTM sequential recommender (``LSTM4Rec``) under eager, plain Inductor and rec_ascend, side by side.

    python -m models.bench_recurrent [--quick] [--batch 128] [--steps 20] [--rounds N] [--threads 1]
                                     [--json docs/benchmarks/recurrent.json]

In one process with cold caches (``bench_corpus.cold_caches``: no FX-graph cache shared between the backends),
per mode (inference under ``no_grad``, and a training step: cross entropy + backward), per backend: the first
call (Dynamo's trace and the compile, CPU and wall seconds), then four batches whose size and sequence length
both change (the compiles Dynamo made by then, and their seconds), then the steady per-call time of every backend
interleaved round by round (``models.timing.race_ms``, CPU time). Plain Inductor breaks the graph at the LSTM
(Dynamo's ``allow_rnn`` off) and runs it eagerly; rec_ascend traces it and makes it ``recompile::lstm``
(``docs/recurrent.md``).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import torch.nn as nn

from .bench_corpus import cold_caches, commit, warm_up
from .timing import race_ms
from .train import write_json

BACKENDS = ("eager", "inductor", "rec_ascend")
CHANGING = ((96, 17), (160, 23), (64, 9), (200, 30))  # (batch, steps) of the batches after the first


class LSTM4Rec(nn.Module):
    """Item ids -> embeddings -> LSTM -> the last step's output -> scores over every item (the table tied)."""

    def __init__(self, items: int = 1000, dim: int = 32, hidden: int = 64, layers: int = 1, **lstm):
        super().__init__()
        self.emb = nn.Embedding(items, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=layers, batch_first=True, **lstm)
        self.out = nn.Linear(hidden * (1 + self.lstm.bidirectional), dim)

    def forward(self, ids: torch.Tensor, state=None) -> torch.Tensor:
        out, _ = self.lstm(self.emb(ids), state)
        return self.out(out[:, -1]) @ self.emb.weight.T


def step(fn, training: bool):
    """One call: inference under no_grad, or a training step (cross entropy on the first item + backward)."""
    def run(ids):
        if not training:
            with torch.no_grad():
                return fn(ids)
        loss = nn.functional.cross_entropy(fn(ids), ids[:, 0])
        loss.backward()
        return loss
    return run


def compiled(model: nn.Module, backend: str):
    torch._dynamo.reset()
    return model if backend == "eager" else torch.compile(model, backend=backend)


def first_calls(model: nn.Module, backend: str, training: bool, ids: torch.Tensor) -> tuple[dict, object]:
    """The first call's seconds, then the changing batches' seconds and the graphs Dynamo compiled by then."""
    from torch._dynamo.utils import counters

    counters.clear()
    run = step(compiled(model, backend), training)
    cpu, wall = time.thread_time(), time.perf_counter()
    run(ids)
    row = {"first_cpu_s": round(time.thread_time() - cpu, 3), "first_wall_s": round(time.perf_counter() - wall, 3)}
    cpu = time.thread_time()
    for batch, steps in CHANGING:
        run(torch.randint(0, model.emb.num_embeddings, (batch, steps)))
    row.update(changing_cpu_s=round(time.thread_time() - cpu, 3), graphs=counters["stats"]["unique_graphs"],
               graph_breaks=sum(counters["graph_break"].values()))
    return row, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, inference only")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="docs/benchmarks/recurrent.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cold_caches()
    warm_up()
    import recompile  # noqa: F401  (its imports paid before any first call is timed, as Inductor's are)

    rows = []
    for training in (False,) if args.quick else (False, True):
        torch.manual_seed(0)
        model = LSTM4Rec().train(training)
        ids = torch.randint(0, model.emb.num_embeddings, (args.batch, args.steps))
        runs = {}
        for backend in BACKENDS:
            row, runs[backend] = first_calls(model, backend, training, ids)
            rows.append({"mode": "training" if training else "inference", "backend": backend, **row})
        steady = race_ms({name: (lambda run=run: run(ids)) for name, run in runs.items()},
                         rounds=3 if args.quick else args.rounds, clock=time.thread_time)
        for row in rows[-len(BACKENDS):]:
            row["steady_ms"] = round(steady[row["backend"]], 4)
        for row in rows[-len(BACKENDS):]:
            print(f"{row['mode']:9} {row['backend']:10} first call {row['first_cpu_s']:6.2f} s CPU "
                  f"({row['first_wall_s']:.2f} wall), changing batches {row['changing_cpu_s']:6.2f} s, "
                  f"{row['graphs']} graphs, {row['graph_breaks']} breaks, steady {row['steady_ms']:.3f} ms "
                  f"({steady['eager'] / row['steady_ms']:.2f}x eager, "
                  f"{steady['inductor'] / row['steady_ms']:.2f}x Inductor)")
    write_json(args.json, {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "commit": commit(), "batch": args.batch, "steps": args.steps, "clock": "cpu",
                           "quick": args.quick, "rows": rows})


if __name__ == "__main__":
    main()
