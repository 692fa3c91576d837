"""Criteo-shaped DLRM on CPU: eager vs backend="inductor" vs backend="rec_ascend", side by side.

26 ``nn.EmbeddingBag`` sum tables of 1k-26k rows, dim 64, 1-8 ids per bag drawn from a power law
(alpha 1.05), dot interaction, MLPs 13-512-256-64 and 512-256-1. Measures forward at two batch sizes,
a training step with the user's SGD, and rec_ascend's fused embedding optimizer against eager + SGD.
``python -m models.bench_embedding [--quick]``
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import tempfile
from typing import Callable

import torch
import torch.nn.functional as F

from .dlrm import DLRM, DLRMConfig, synthetic_batch
from .timing import race_ms

CRITEO = DLRMConfig(
    table_rows=[1000 + 1000 * i for i in range(26)],
    dim=64,
    bottom=[512, 256, 64],
    top=[512, 256, 1],
    max_ids_per_bag=8,
    id_alpha=1.05,
)
LR = 0.01
BACKENDS = ("eager", "inductor", "rec_ascend")


def _compiled(model, backend: str, options=None):
    if backend == "eager":
        return model
    return torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def forward(batch: int, iters: int) -> dict[str, float]:
    model = DLRM(CRITEO).eval()
    args = synthetic_batch(CRITEO, batch)
    steps = {}
    with torch.no_grad():
        want = model(*args)
        for backend in BACKENDS:
            fn = _compiled(model, backend)
            _check(fn(*args), want, f"forward {backend}")
            steps[backend] = functools.partial(fn, *args)
        return race_ms(steps, 5, iters)


def _sgd_step(model, opt, args):
    opt.zero_grad(set_to_none=True)
    clicks = (args[0][:, 0] > 0).float()  # a label read off the dense features: CTR training's bounded loss
    loss = F.binary_cross_entropy_with_logits(model(*args), clicks)
    loss.backward()
    opt.step()
    return loss.detach()


def train(batch: int, iters: int) -> dict[str, float]:
    base = DLRM(CRITEO)
    args = synthetic_batch(CRITEO, batch)
    steps = {}
    for backend in BACKENDS:
        model = copy.deepcopy(base)
        steps[backend] = functools.partial(_sgd_step, _compiled(model, backend), torch.optim.SGD(model.parameters(), lr=LR),
                                           args)
    return race_ms(steps, 5, iters)


def fused_train(batch: int, iters: int) -> dict[str, float]:
    """rec_ascend with the fused exact SGD on the tables (the MLPs keep the user's SGD) vs eager + SGD."""
    base = DLRM(CRITEO)
    args = synthetic_batch(CRITEO, batch)
    eager = copy.deepcopy(base)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=LR)
    fused = copy.deepcopy(base)
    fn = torch.compile(fused, backend="rec_ascend", options={"embedding_optimizer": {"type": "exact_sgd", "lr": LR}})
    dense = [p for name, p in fused.named_parameters() if not name.startswith("embeddings.")]
    fused_opt = torch.optim.SGD(dense, lr=LR)
    for _ in range(2):  # the same steps give the same model
        _check(_sgd_step(fn, fused_opt, args), _sgd_step(eager, eager_opt, args), "fused step loss")
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        _check(p.detach(), q.detach(), f"fused step {name}")
    return race_ms({"eager": functools.partial(_sgd_step, eager, eager_opt, args),
                  "rec_ascend": functools.partial(_sgd_step, fn, fused_opt, args)}, iters)


def _row(label: str, times: dict[str, float], target: float) -> str:
    cells = "  ".join(f"{b} {times[b]:8.3f} ms" for b in BACKENDS if b in times)
    rec = times["eager"] / times["rec_ascend"]
    vs_inductor = f", {times['inductor'] / times['rec_ascend']:.2f}x vs inductor" if "inductor" in times else ""
    verdict = "meets" if rec >= target else "MISSES"
    return f"{label:28s} {cells}   rec_ascend {rec:.2f}x vs eager{vs_inductor}  (target {target}x: {verdict})"


def _measured(label: str, measure: Callable[[], dict[str, float]], target: float) -> None:
    """Print a measurement's row, then what rec_ascend's autotune chose for the graphs compiled meanwhile."""
    from recompile.autotune import cache_dir

    before = set(cache_dir().glob("*.json"))
    print(_row(label, measure(), target))
    for path in sorted(set(cache_dir().glob("*.json")) - before, key=os.path.getmtime):
        decision = json.loads(path.read_text())
        kernels = ", ".join(f"{node.removesuffix('_default')}: {impl}" for node, impl in decision["regions"].items())
        print(f"{'':28s} rec_ascend ran the {decision['choice']} graph ({decision['mode']}; {kernels})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--skip-fused", action="store_true", help="leave out the fused-optimizer step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--only", choices=("forward", "train", "fused"), help="run one measurement")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Fresh autotune decisions: a cached one may have been measured with other kernels or on another load.
    os.environ.setdefault("RECOMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="bench_embedding_"))
    iters = 5 if args.quick else 30
    torch.manual_seed(0)
    print(f"Criteo-shaped DLRM: 26 tables of 1k-26k rows, dim 64, 1-8 ids/bag (alpha 1.05), {torch.get_num_threads()} threads")
    if args.only in (None, "forward"):
        _measured("forward, batch 128", lambda: forward(128, iters * 4), 2.0)
        _measured("forward, batch 2048", lambda: forward(2048, iters), 1.5)
    if args.only in (None, "train"):
        _measured("train step (SGD), batch 2048", lambda: train(2048, iters), 1.2)
    if args.only in (None, "fused") and not args.skip_fused:
        _measured("fused optimizer, batch 2048", lambda: fused_train(2048, iters), 3.0)


if __name__ == "__main__":
    main()
