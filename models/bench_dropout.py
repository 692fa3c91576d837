"""Dropout masks, measured side by side: ``python -m models.bench_dropout [--quick] [--threads N]``.

``nn.Dropout`` alone and inside an MLP block (linear, ReLU, dropout) at the main job's shape (the HSTU step's
~2200 tokens x 64) and at a SASRec attention map, forward and training step (forward + backward), under eager,
``backend="inductor"`` and ``backend="rec_ascend"`` (whose dropout pass draws the mask with the native hash
kernel); every backend keeps 1 - p of the elements, checked.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from models.timing import race_ms

SHAPES = {"tokens": (2190, 64), "attention": (32, 2, 100, 100)}
BACKENDS = ("eager", "inductor", "rec_ascend")


def _modules(shape: tuple[int, ...], p: float) -> dict[str, nn.Module]:
    width = shape[-1]
    return {"dropout": nn.Dropout(p), "mlp block": nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(p))}


def _compiled(module: nn.Module, backend: str):
    return module if backend == "eager" else torch.compile(module, backend=backend, dynamic=False)


def _kept(out: torch.Tensor, p: float) -> None:
    share = (out != 0).double().mean().item()
    if abs(share - (1 - p)) > 0.02:
        raise AssertionError(f"kept {share:.3f} of the elements, expected {1 - p:.3f}")


def bench(shape: tuple[int, ...], p: float, rounds: int) -> list[str]:
    lines = []
    x = torch.randn(shape)
    for name, module in _modules(shape, p).items():
        torch._dynamo.reset()  # each module class compiles afresh (no recompile limit across shapes)
        fns = {backend: _compiled(module, backend) for backend in BACKENDS}
        xg = x.clone().requires_grad_()
        with torch.no_grad():
            for fn in fns.values():
                _kept(fn(x), p) if name == "dropout" else fn(x)
            forward = race_ms({b: (lambda fn=fn: fn(x)) for b, fn in fns.items()}, rounds)
        train = race_ms({b: (lambda fn=fn: fn(xg).sum().backward()) for b, fn in fns.items()}, rounds)
        for mode, ms in (("forward", forward), ("train", train)):
            cols = "  ".join(f"{b} {ms[b]:8.3f} ms" for b in BACKENDS)
            lines.append(f"{name:10s} {mode:8s} {'x'.join(map(str, shape)):16s} {cols}  |  rec/eager "
                         f"{ms['eager'] / ms['rec_ascend']:5.2f}x  rec/inductor {ms['inductor'] / ms['rec_ascend']:5.2f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.bench_dropout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds instead of 30")
    parser.add_argument("--p", type=float, default=0.2)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, p={args.p}")
    for shape in SHAPES.values():
        for line in bench(shape, args.p, 10 if args.quick else 30):
            print(line, flush=True)


if __name__ == "__main__":
    main()
