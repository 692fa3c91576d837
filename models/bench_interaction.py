"""Interaction benchmark: DLRM (26 tables of dim 64) and DCN-v2 (20 tables of dim 16, 3 cross layers),
forward and training step, eager vs inductor vs rec_ascend side by side, and cold compile times.
``--models dcn_mix``: the same DCN-v2 with mixture-of-experts cross layers (4 experts of rank 32, DCN-Mix).
``--ops [OP ...]``: each interaction op alone (the kernel the lowering picks on this CPU) against the eager
spelling it replaces and Inductor's compilation of that spelling, forward and forward + backward, at the workloads'
shapes (``vector_cross_*``: the DCN-v1 vector cross at RecBole DCN's and a DLRM-sized input's shapes).

    python -m models.bench_interaction [--quick] [--no-compile-time] [--models dlrm dcn dcn_mix]
                                       [--modes forward train] [--batch N] [--threads N] [--ops [OP ...]]

Steps are timed with the wall clock (``time.perf_counter``), best of rounds that run every backend once in
turn. Cold compile time is measured in a fresh process per backend with empty Inductor and recompile caches
(first call minus the steady-state step), then once more for rec_ascend with its autotune cache warm.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .ctr import DCNConfig, DCNv2, MixtureCrossLayer
from .dlrm import DLRM, DLRMConfig, synthetic_batch
from .timing import race_ms
from recompile.lowering import choose, detect_target

BACKENDS = ("eager", "inductor", "rec_ascend")
MODELS = ("dlrm", "dcn", "dcn_mix")
DEFAULT_MODELS = ["dlrm", "dcn"]
MODES = ("forward", "train")


def make(model: str, quick: bool):
    rows = 2_000 if quick else 10_000
    if model == "dlrm":
        cfg = DLRMConfig(table_rows=[rows] * 26, dim=64, bottom=[512, 256, 64], top=[512, 256, 1])
        return DLRM(cfg), cfg
    mixture = dict(low_rank=32, num_experts=4) if model == "dcn_mix" else {}
    cfg = DCNConfig(table_rows=[rows] * 20, dim=16, num_cross=3, deep=[512, 256], **mixture)
    return DCNv2(cfg), cfg


def step_fn(model, mode: str):
    if mode == "forward":
        def forward(*args):
            with torch.no_grad():
                return model(*args)
        return forward
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train(*args):
        opt.zero_grad(set_to_none=True)
        loss = model(*args).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    return train


def run_steps(quick: bool, models: list[str], modes: list[str], batch: int | None) -> list[dict]:
    default_batch, iters = (256, 30) if quick else (2048, 20)
    batch = batch or default_batch
    rows = []
    for name in models:
        for mode in modes:
            torch._dynamo.reset()
            fns = {}
            for backend in BACKENDS:  # one model per backend: the training steps update their weights
                torch.manual_seed(0)
                model, cfg = make(name, quick)
                fns[backend] = step_fn(model if backend == "eager" else torch.compile(model, backend=backend), mode)
            args = synthetic_batch(cfg, batch, torch.Generator().manual_seed(1))
            steps = {backend: functools.partial(fn, *args) for backend, fn in fns.items()}
            row = {"model": name, "mode": mode, "batch": batch, **race_ms(steps, iters)}
            rows.append(row)
            print(_format(row), flush=True)
    return rows


def _format(row: dict) -> str:
    best_other = min(row["eager"], row["inductor"])
    return (f"{row['model']:7s} {row['mode']:8s} B={row['batch']:<5d} eager {row['eager']:8.2f} ms  "
            f"inductor {row['inductor']:8.2f} ms  rec_ascend {row['rec_ascend']:8.2f} ms  |  "
            f"rec/eager {row['eager'] / row['rec_ascend']:5.2f}x  rec/inductor {row['inductor'] / row['rec_ascend']:5.2f}x  "
            f"rec/min(eager,inductor) {best_other / row['rec_ascend']:5.2f}x")


def _dot_case(batch: int):
    """DLRM's interaction: the dense vector and 26 pooled embeddings of dim 64."""
    feats = [torch.randn(batch, 64, requires_grad=True) for _ in range(27)]
    rows, cols = torch.triu_indices(27, 27, 1)
    impl = choose("recompile::dot_interaction", detect_target("cpu")).impl

    def eager():
        t = torch.stack(feats, 1)
        return torch.cat([feats[0], torch.bmm(t, t.transpose(1, 2))[:, rows, cols]], 1)
    return eager, lambda: torch.ops.recompile.dot_interaction(feats, feats[0], True, False, impl), feats


def _cross_case(batch: int):
    """DCN-v2's three full-rank cross layers over 13 dense + 20 x 16 embedding values."""
    layers = [torch.nn.Linear(333, 333) for _ in range(3)]
    x0 = torch.randn(batch, 333, requires_grad=True)
    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]

    def eager():
        x = x0
        for layer in layers:
            x = x0 * layer(x) + x
        return x
    impl = choose("recompile::cross_stack", detect_target("cpu")).impl
    return eager, lambda: torch.ops.recompile.cross_stack(x0, x0, weights, biases, [], torch.is_grad_enabled(), impl)[0], [x0]


def _mixture_case(batch: int):
    """One DCN-Mix layer of dcn_mix: 4 experts of rank 32 with the C stage, relu."""
    layer = MixtureCrossLayer(333, 32, 4)
    x0, x = torch.randn(batch, 333, requires_grad=True), torch.randn(batch, 333, requires_grad=True)
    experts = [[expert[i].weight for expert in layer.experts] for i in (0, 2, 4)]
    biases = [expert[4].bias for expert in layer.experts]
    impl = choose("recompile::cross_mixture", detect_target("cpu")).impl
    return (lambda: layer(x0, x),
            lambda: torch.ops.recompile.cross_mixture(x0, x, layer.gate.weight, *experts, biases, "relu",
                                                      torch.is_grad_enabled(), impl)[0], [x0, x])


def _vector_cross_case(batch: int, dim: int, layers: int):
    """DCN-v1's vector cross stack, written as RecBole's DCN writes it (``tensordot``, raw Parameters)."""
    weights = [torch.nn.Parameter(torch.randn(dim) / dim ** 0.5) for _ in range(layers)]
    biases = [torch.nn.Parameter(torch.randn(dim) * 0.1) for _ in range(layers)]
    x0 = torch.randn(batch, dim, requires_grad=True)

    def eager():
        x = x0
        for w, b in zip(weights, biases):
            s = torch.tensordot(x, w, dims=([1], [0]))
            x = (x0.transpose(0, 1) * s).transpose(0, 1) + b + x
        return x
    impl = choose("recompile::vector_cross", detect_target("cpu")).impl
    return eager, lambda: torch.ops.recompile.vector_cross(x0, x0, weights, biases, impl), [x0]


OP_CASES = {"dot_interaction": _dot_case, "cross_stack": _cross_case, "cross_mixture": _mixture_case,
            # RecBole DCN's defaults on ml-100k (embedding_size 10, about 8 fields, 6 layers); a DLRM-sized input
            "vector_cross_recbole": functools.partial(_vector_cross_case, dim=80, layers=6),
            "vector_cross_333": functools.partial(_vector_cross_case, dim=333, layers=3)}


def run_ops(batch: int, rounds: int = 30, names: list[str] | None = None) -> None:
    """Each op (or those ``names``) against its eager spelling and Inductor's compilation of it, forward and
    forward + backward; the ratio is against the faster of the two."""
    def forward(fn):
        with torch.no_grad():
            fn()

    def train(fn, grad):
        fn().backward(grad)

    def timed(step, *args):
        return {name: functools.partial(step, fn, *args) for name, fn in candidates.items()}

    for name, case in OP_CASES.items():
        if names and name not in names:
            continue
        eager, op, _ = case(batch)
        candidates = {"eager": eager, "inductor": torch.compile(eager, backend="inductor"), "op": op}
        grad = torch.randn_like(eager().detach())
        torch.testing.assert_close(op(), eager(), rtol=1e-4, atol=1e-3)
        fwd, both = race_ms(timed(forward), rounds), race_ms(timed(train, grad), rounds)
        columns = [f"{what}: eager {t['eager']:7.3f} ms  inductor {t['inductor']:7.3f} ms  op {t['op']:7.3f} ms "
                   f"({min(t['eager'], t['inductor']) / t['op']:4.2f}x min)"
                   for what, t in (("forward", fwd), ("fwd+bwd", both))]
        print(f"{name:20s} B={batch:<5d} " + "  ".join(columns), flush=True)


def cold_compile(model: str, backend: str, quick: bool, cache: str, threads: int) -> float:
    """Seconds of the first training step beyond a steady one, in a fresh process."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               RECOMPILE_CACHE_DIR=os.path.join(cache, "recompile"))
    code = (
        f"import time, json, torch; torch.set_num_threads({threads})\n"
        "from models.bench_interaction import make, step_fn, synthetic_batch\n"
        f"model, cfg = make({model!r}, {quick})\n"
        "args = synthetic_batch(cfg, 256, torch.Generator().manual_seed(1))\n"
        f"fn = step_fn(torch.compile(model, backend={backend!r}), 'train')\n"
        "t0 = time.perf_counter(); fn(*args); first = time.perf_counter() - t0\n"
        "t0 = time.perf_counter(); fn(*args); steady = time.perf_counter() - t0\n"
        "print(json.dumps(first - steady))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_compile_times(quick: bool, models: list[str], threads: int) -> None:
    for name in models:
        with tempfile.TemporaryDirectory() as fresh_inductor, tempfile.TemporaryDirectory() as fresh_rec:
            inductor = cold_compile(name, "inductor", quick, fresh_inductor, threads)
            rec = cold_compile(name, "rec_ascend", quick, fresh_rec, threads)
            rec_warm = cold_compile(name, "rec_ascend", quick, fresh_rec, threads)  # autotune decision cached
        print(f"{name:7s} cold compile (train step): inductor {inductor:6.1f} s  rec_ascend {rec:6.1f} s "
              f"(ratio {rec / inductor:4.2f})  rec_ascend with cached decision {rec_warm:6.1f} s", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables and batch, few iterations")
    parser.add_argument("--no-compile-time", action="store_true", help="skip the cold compile measurements")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=DEFAULT_MODELS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--batch", type=int, help="batch size (default 256 with --quick, else 2048)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--ops", nargs="*", choices=list(OP_CASES), default=None,
                        help="time each interaction op (or those named) against its eager spelling and Inductor")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.ops is not None:
        run_ops(args.batch or (256 if args.quick else 2048), names=args.ops)
        return
    run_steps(args.quick, args.models, args.modes, args.batch)
    if not args.no_compile_time:
        run_compile_times(args.quick, args.models, args.threads)


if __name__ == "__main__":
    main()
