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
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.timing import race_ms

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


def cases(p: float) -> dict[str, tuple[nn.Module, Callable[[], tuple]]]:
    """name -> (module, its inputs)."""
    def tokens(rows, dim):
        return lambda: (torch.randn(rows, dim),)

    def loss_inputs(rows, dim):
        return lambda: (torch.randn(rows, dim), torch.randint(0, ITEMS, (rows,)), torch.randint(1, ITEMS, (1024,)))
    return {
        "dropout 2190x64": (nn.Dropout(p), tokens(2190, 64)),
        "linear+relu+dropout 2190x64": (nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(p)), tokens(2190, 64)),
        "dropout 32x2x100x100": (nn.Dropout(p), lambda: (torch.randn(32, 2, 100, 100),)),
        "sampled softmax 2190x1024": (SampledSoftmax(64), loss_inputs(2190, 64)),
        "sampled softmax 3200x1024": (SampledSoftmax(64), loss_inputs(3200, 64)),
    }


def _check(name: str, outs: dict[str, torch.Tensor], p: float) -> None:
    out, eager = outs["rec_ascend"], outs["eager"]
    if name.startswith("dropout"):
        share = (out != 0).double().mean().item()
        if abs(share - (1 - p)) > 0.02:
            raise AssertionError(f"{name}: kept {share:.3f} of the elements, expected {1 - p:.3f}")
    elif name.startswith("sampled"):
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


def bench(name: str, module: nn.Module, make_inputs: Callable[[], tuple], p: float, rounds: int) -> list[str]:
    torch._dynamo.reset()  # each case compiles afresh (no recompile limit across cases)
    fns = {b: module if b == "eager" else torch.compile(module, backend=b, dynamic=False) for b in BACKENDS}
    inputs = make_inputs()
    grads = tuple(t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        _check(name, {b: fn(*inputs) for b, fn in fns.items()}, p)
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
    for name, (module, make_inputs) in cases(args.p).items():
        for line in bench(name, module, make_inputs, args.p, 10 if args.quick else 30):
            print(line, flush=True)


if __name__ == "__main__":
    main()
