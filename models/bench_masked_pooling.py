"""Masked pooling as an embedding bag: rec_ascend with and without the rewrite, side by side.

    python -m models.bench_masked_pooling [--quick] [--models recbole/FM recbole/DeepFM ...] [--rounds N]
                                          [--threads N] [--json docs/benchmarks/masked_pooling.json]

Per case, in one process with cold caches (``bench_corpus.cold_caches``), ms per step timed interleaved round by
round (``models.timing.race_ms``) of: eager; rec_ascend with the embedding pass off (``passes={"embedding":
False}``: the masked pooling stays ``F.embedding`` * mask, summed, for Inductor to fuse); rec_ascend with it on (a
SUM ``grouped_embedding_bag`` with padding_idx 0). Autotune is off in both so that the rewrite is what runs;
``--autotune`` turns it on in both (the race may then drop the embedding pass's regions where they are slower).
Cases: RecBole context models' ``calculate_loss`` (loss + backward) and ``predict`` at batch 128 and 2048, whose
genre list is short (ml-100k: at most 6 genres), and a synthetic ``masked mean`` ([B, 50] ids, 30% padding, a
100k x 64 table, RecBole's arithmetic) where the bag's saving, no [B, L, D] intermediate, is larger.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch
import torch.nn as nn

from .bench_corpus import cold_caches, commit, step_fn, warm_up
from .corpus.harness import CASES, Case, assert_equal, run
from .timing import race_ms
from .train import write_json

VARIANTS = {"eager": None, "no_rewrite": {"passes": {"embedding": False}}, "rewrite": {}}
MODELS = ("recbole/FM", "recbole/DeepFM", "recbole/WideDeep")
BATCHES, QUICK_BATCHES = (128, 2048), (128,)


class MaskedMean(nn.Module):
    """RecBole's embed_token_seq_fields (mode="mean") over a long padded list, then a scalar per row."""

    def __init__(self, rows: int = 100_000, dim: int = 64):
        super().__init__()
        self.table = nn.Embedding(rows, dim)

    def forward(self, ids):
        mask = (ids != 0).float()
        count = torch.sum(mask, dim=1, keepdim=True)
        emb = self.table(ids)
        pooled = torch.sum(emb * mask.unsqueeze(2).expand_as(emb), dim=1) / (count + 1e-8)
        return pooled.pow(2).sum()


def _synthetic_inputs(rows: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100_000, (rows, 50), generator=g)
    return (ids.masked_fill(torch.rand(rows, 50, generator=g) < 0.3, 0),)


def _synthetic_model(seed: int) -> MaskedMean:
    torch.manual_seed(seed)
    return MaskedMean()


SYNTHETIC = [Case("synthetic/masked_mean", entry, training, _synthetic_model, _synthetic_inputs)
             for entry, training in (("train", True), ("forward", False))]


def bench_case(case: Case, batches, rounds: int, autotune: bool) -> dict:
    torch._dynamo.reset()
    modules = {name: case.make(0) for name in VARIANTS}
    fns = {name: modules[name] if opts is None else
           torch.compile(modules[name], backend="rec_ascend", options={**opts, "autotune": autotune})
           for name, opts in VARIANTS.items()}
    ms = {}
    for b in batches:  # outputs and gradients of both compiled variants equal eager's, or the run stops here
        inputs = case.inputs(b, 0)
        want, want_grads = run(case, modules["eager"], modules["eager"], inputs)
        for name in ("no_rewrite", "rewrite"):
            got, got_grads = run(case, fns[name], modules[name], inputs)
            assert_equal(got, want, 1e-5, 1e-6, f"{case.name} {name} output, batch {b}")
            for key, g in want_grads.items():
                assert_equal(got_grads[key], g, 1e-4, 1e-5, f"{case.name} {name} gradient of {key}, batch {b}")
        ms[str(b)] = race_ms({name: step_fn(case, fns[name], modules[name], inputs) for name in VARIANTS}, rounds)
    return {"case": case.name, "training": case.training, "ms": ms,  # numbers checked equal to eager above
            "rewrite_vs_no_rewrite": {b: m["no_rewrite"] / m["rewrite"] for b, m in ms.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.bench_masked_pooling", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted({c.model for c in CASES.values()}))
    p.add_argument("--quick", action="store_true", help="recbole/FM and the synthetic case, batch 128, one round")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds, each running every variant once in turn")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--autotune", action="store_true", help="autotune on in both rec_ascend variants")
    p.add_argument("--no-synthetic", dest="synthetic", action="store_false", help="leave out the synthetic case")
    p.add_argument("--json", default="docs/benchmarks/masked_pooling.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cold_caches()
    warm_up()
    models = ["recbole/FM"] if args.quick else args.models
    cases = [c for c in CASES.values() if c.model in models] + (SYNTHETIC if args.synthetic else [])
    batches, rounds = (QUICK_BATCHES, 1) if args.quick else (BATCHES, args.rounds)
    rows = []
    for case in cases:
        row = bench_case(case, batches, rounds, args.autotune)
        rows.append(row)
        print(f"{row['case']:32s} " + "  ".join(
            f"b{b}: " + " ".join(f"{k} {v:.3f}" for k, v in m.items()) + f" ms, rewrite {row['rewrite_vs_no_rewrite'][b]:.2f}x"
            for b, m in row["ms"].items()), flush=True)
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
              "threads": torch.get_num_threads(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "quick": args.quick, "rounds": rounds, "autotune": args.autotune, "rows": rows}
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
