"""The sequential models' training-step ops, measured side by side: ``python -m models.bench_sequential [--quick]``.

At the main job's shapes (an HSTU step on ML-100k: ~2200 tokens x 64, 1024 sampled negatives) and at SASRec's
(32 histories padded to 100, 2 heads): ``nn.Dropout`` alone and after a linear + ReLU, and the next-item sampled
softmax loss as ``models.sequential.NextItemTask`` writes it (cosine logits / temperature, accidental hits masked,
``cross_entropy(reduction="none")``, averaged), forward and training step (forward + backward), under eager,
``backend="inductor"`` and ``backend="rec_ascend"`` (its dropout and sampled_softmax passes). rec_ascend's dropout
keeps 1 - p of the elements and its loss equals eager's, checked.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .timing import race_ms

BACKENDS = ("eager", "inductor", "rec_ascend")
ITEMS = 1683


class SampledSoftmax(nn.Module):
    """NextItemTask's loss over given hidden states: forward(h, targets, negatives) -> mean loss."""

    def __init__(self, dim: int, temperature: float = 0.05):
        super().__init__()
        self.item = nn.Embedding(ITEMS, dim)
        self.temperature = temperature

    def forward(self, h, targets, negatives):
        h = F.normalize(h, dim=-1)
        pos = (h * F.normalize(self.item(targets), dim=-1)).sum(-1, keepdim=True)
        neg = h @ F.normalize(self.item(negatives), dim=-1).t()
        neg = neg.masked_fill(negatives.unsqueeze(0) == targets.unsqueeze(1), float("-inf"))
        logits = torch.cat([pos, neg], dim=1) / self.temperature
        return F.cross_entropy(logits, torch.zeros_like(targets), reduction="none").mean()


def keeps(p: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A check that rec_ascend's dropout kept 1 - p of the elements (to 0.02)."""
    def check(out: torch.Tensor, eager: torch.Tensor) -> None:
        share = (out != 0).double().mean().item()
        if abs(share - (1 - p)) > 0.02:
            raise AssertionError(f"kept {share:.3f} of the elements, expected {1 - p:.3f}")
    return check


def same_as_eager(out: torch.Tensor, eager: torch.Tensor) -> None:
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


@dataclass(frozen=True)
class Case:
    module: nn.Module
    inputs: Callable[[], tuple]
    check: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # (rec_ascend's output, eager's)


def cases(p: float) -> dict[str, Case]:
    def tokens(rows, dim):
        return lambda: (torch.randn(rows, dim),)

    def loss_inputs(rows, dim):
        return lambda: (torch.randn(rows, dim), torch.randint(0, ITEMS, (rows,)), torch.randint(1, ITEMS, (1024,)))
    return {
        "dropout 2190x64": Case(nn.Dropout(p), tokens(2190, 64), keeps(p)),
        "linear+relu+dropout 2190x64": Case(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(p)), tokens(2190, 64)),
        "dropout 32x2x100x100": Case(nn.Dropout(p), lambda: (torch.randn(32, 2, 100, 100),), keeps(p)),
        "sampled softmax 2190x1024": Case(SampledSoftmax(64), loss_inputs(2190, 64), same_as_eager),
        "sampled softmax 3200x1024": Case(SampledSoftmax(64), loss_inputs(3200, 64), same_as_eager),
    }


def bench(name: str, case: Case, rounds: int) -> list[str]:
    torch._dynamo.reset()  # each case compiles afresh (no recompile limit across cases)
    fns = {b: case.module if b == "eager" else torch.compile(case.module, backend=b, dynamic=False) for b in BACKENDS}
    inputs = case.inputs()
    grads = tuple(t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        if case.check is not None:
            case.check(fns["rec_ascend"](*inputs), fns["eager"](*inputs))
        forward = race_ms({b: (lambda fn=fn: fn(*inputs)) for b, fn in fns.items()}, rounds)
    train = race_ms({b: (lambda fn=fn: fn(*grads).sum().backward()) for b, fn in fns.items()}, rounds)
    lines = []
    for mode, ms in (("forward", forward), ("train", train)):
        cols = "  ".join(f"{b} {ms[b]:8.3f} ms" for b in BACKENDS)
        lines.append(f"{name:28s} {mode:8s} {cols}  |  rec/eager {ms['eager'] / ms['rec_ascend']:5.2f}x  "
                     f"rec/inductor {ms['inductor'] / ms['rec_ascend']:5.2f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.bench_sequential", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds instead of 30")
    parser.add_argument("--p", type=float, default=0.2, help="dropout rate")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dropout p={args.p}")
    for name, case in cases(args.p).items():
        for line in bench(name, case, 10 if args.quick else 30):
            print(line, flush=True)


if __name__ == "__main__":
    main()
