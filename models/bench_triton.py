"""recompile's Triton kernels and compiled models on an accelerator, checked against eager and timed beside it.

    python -m models.bench_triton [--device cuda] [--ops embedding hstu_attention ...] [--models dlrm hstu ...]
                                  [--check-only] [--json docs/benchmarks/triton.json]

One run on a GPU (bench sizes, 5 rounds) takes a few minutes and writes docs/benchmarks/triton.json (machine,
date, commit included).

1. Kernels: every op with a Triton lowering, on random inputs of the bench models' sizes. The op with
   ``impl="triton"`` is checked against the eager PyTorch spelling (forward, and the gradient of every
   differentiable input through the op's autograd), then timed beside it: ms of the forward and of forward +
   backward for eager, Inductor (``torch.compile`` of the same spelling) and the Triton kernel, in interleaved
   rounds, the device synchronised around each.
2. Models: zoo models on the device under eager, Inductor and rec_ascend: the compiled outputs checked against
   eager, forward and training-step ms side by side, and the number of compiles over three batch sizes.

Without an accelerator, ``--device cpu`` runs the kernel checks under ``TRITON_INTERPRET=1`` at tiny sizes
(what the tests run); timings there would measure the interpreter, so ``--check-only`` skips them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

SIZES = ("tiny", "bench")
DOCS_JSON = "docs/benchmarks/triton.json"


@dataclass
class Case:
    """One op on one input: the Triton kernel, the eager spelling it replaces, and what to differentiate."""

    shape: str
    triton: Callable[[], torch.Tensor]
    eager: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor] = field(default_factory=list)
    tol: float = 1e-4
    # other kernels of the op worth timing beside the Triton one (e.g. the length-bucketed ATen attention)
    others: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)


# op -> (builder(size, device, dtype, generator) -> Case, dtypes it is checked in)
CASES: dict[str, tuple[Callable[..., Case], tuple[torch.dtype, ...]]] = {}


def case(op: str, *dtypes: torch.dtype):
    def register(build):
        CASES[op] = (build, dtypes or (torch.float32,))
        return build
    return register


def _randn(shape, device, dtype, gen, grad=True):
    t = torch.randn(shape, device=device, generator=gen).to(dtype)
    return t.requires_grad_(grad)


def _randint(low, high, shape, device, gen):
    return torch.randint(low, high, shape, device=device, generator=gen)


# Low-precision tolerance: the kernels accumulate in fp32, the eager spellings in the input dtype.
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}

EMBEDDING = {"tiny": dict(tables=3, rows=50, dim=8, batch=5, max_len=4),
             "bench": dict(tables=26, rows=100_000, dim=64, batch=2048, max_len=20)}


@case("grouped_embedding_bag", torch.float32, torch.float16)
def embedding_case(size, device, dtype, gen):
    from recompile.runtime.embedding import SUM

    s = EMBEDDING[size]
    weights = [_randn((s["rows"], s["dim"]), device, dtype, gen) for _ in range(s["tables"])]
    lengths = [_randint(0, s["max_len"] + 1, (s["batch"],), device, gen) for _ in weights]
    ids = [_randint(0, s["rows"], (int(n.sum()),), device, gen) for n in lengths]
    offsets = [torch.cumsum(n, 0) - n for n in lengths]
    t = len(weights)
    names = ",".join(f"t{i}" for i in range(t))
    empty = [torch.empty(0, device=device)] * t
    return Case(
        f"{t} tables {s['rows']}x{s['dim']}, batch {s['batch']}, 0-{s['max_len']} ids per bag, sum",
        lambda: torch.ops.recompile.grouped_embedding_bag(weights, ids, offsets, empty, [SUM] * t, [-1] * t,
                                                          [False] * t, [False] * t, "concat", names, "fatal", "triton"),
        lambda: torch.cat([F.embedding_bag(i, w, o, mode="sum") for w, i, o in zip(weights, ids, offsets)], 1),
        weights, TOL[dtype])


INTERACTION = {"tiny": dict(batch=6, features=5, dim=8), "bench": dict(batch=2048, features=27, dim=64)}


@case("dot_interaction", torch.float32, torch.bfloat16)
def dot_interaction_case(size, device, dtype, gen):
    from recompile.runtime.interaction import dot_interaction_reference

    s = INTERACTION[size]
    dense = _randn((s["batch"], s["dim"]), device, dtype, gen)
    embs = [_randn((s["batch"], s["dim"]), device, dtype, gen) for _ in range(s["features"] - 1)]
    return Case(
        f"batch {s['batch']}, {s['features']} features of dim {s['dim']}, upper triangle, dense prefix",
        lambda: torch.ops.recompile.dot_interaction([dense, *embs], dense, True, False, "triton"),
        lambda: dot_interaction_reference([dense, *embs], dense, True, False),
        [dense, *embs], TOL[dtype])


@case("fm_second_order", torch.float32)
def fm_case(size, device, dtype, gen):
    from recompile.runtime.interaction import fm_second_order_reference

    s = INTERACTION[size]
    v = _randn((s["batch"], s["features"] - 1, s["dim"]), device, dtype, gen)
    return Case(f"batch {s['batch']}, {s['features'] - 1} fields of dim {s['dim']}, summed",
                lambda: torch.ops.recompile.fm_second_order(v, True, "triton"),
                lambda: fm_second_order_reference(v, True), [v], 1e-3)


# DCN-v2 of the interaction issue: 20 tables of dim 16 and 13 dense features, 3 cross layers.
CROSS = {"tiny": dict(batch=6, dim=12, layers=2, experts=2, rank=4),
         "bench": dict(batch=2048, dim=333, layers=3, experts=4, rank=64)}


def _cross_params(s, device, dtype, gen):
    x0 = _randn((s["batch"], s["dim"]), device, dtype, gen)
    weights = [(_randn((s["dim"], s["dim"]), device, dtype, gen, False) * s["dim"] ** -0.5).requires_grad_()
               for _ in range(s["layers"])]
    biases = [_randn((s["dim"],), device, dtype, gen) for _ in range(s["layers"])]
    return x0, weights, biases


@case("cross_stack", torch.float32)
def cross_stack_case(size, device, dtype, gen):
    from recompile.runtime.interaction import cross_stack_reference

    s = CROSS[size]
    x0, weights, biases = _cross_params(s, device, dtype, gen)
    return Case(f"batch {s['batch']}, dim {s['dim']}, {s['layers']} full-rank layers",
                lambda: torch.ops.recompile.cross_stack(x0, x0, weights, biases, [], True, "triton")[0],
                lambda: cross_stack_reference(x0, x0, weights, biases, []), [x0, *weights, *biases], 1e-3)


@case("cross_mixture", torch.float32)
def cross_mixture_case(size, device, dtype, gen):
    from recompile.runtime.interaction import cross_mixture_reference

    s = CROSS[size]
    d, r, e = s["dim"], s["rank"], s["experts"]
    x0 = _randn((s["batch"], d), device, dtype, gen)

    def matrix(rows, cols):
        return (_randn((rows, cols), device, dtype, gen, False) * cols ** -0.5).requires_grad_()
    gate, downs, mids, ups = matrix(e, d), [matrix(r, d) for _ in range(e)], [matrix(r, r) for _ in range(e)], \
        [matrix(d, r) for _ in range(e)]
    biases = [_randn((d,), device, dtype, gen) for _ in range(e)]
    args = (x0, x0, gate, downs, mids, ups, biases, "relu")
    return Case(f"batch {s['batch']}, dim {d}, {e} experts of rank {r}, relu",
                lambda: torch.ops.recompile.cross_mixture(*args, torch.is_grad_enabled(), "triton")[0], lambda: cross_mixture_reference(*args),
                [x0, gate, *downs, *mids, *ups, *biases], 1e-3)


ATTENTION = {"tiny": dict(batch=4, max_len=40, heads=2, dim=16, buckets=16),
             "bench": dict(batch=128, max_len=1024, heads=2, dim=64, buckets=128)}


def _histories(s, device, dtype, gen):
    """Long-tailed jagged histories: lengths, offsets and q, k, v."""
    from .layers_jagged import long_tailed_lengths

    lengths = long_tailed_lengths(s["batch"], s["max_len"], torch.Generator().manual_seed(0)).to(device)
    offsets = torch.ops.recompile.complete_cumsum(lengths, "reference")
    q, k, v = (_randn((int(lengths.sum()), s["heads"], s["dim"]), device, dtype, gen) for _ in range(3))
    return lengths, offsets, q, k, v


def _padded(offsets, n, *jagged):
    """Jagged ``[total, ...]`` tensors padded to ``[B, n, ...]``."""
    from recompile.runtime.jagged import jagged_to_padded_dense_reference

    return [jagged_to_padded_dense_reference(t.flatten(1), offsets, n).unflatten(2, t.shape[1:]) for t in jagged]


def _jagged(out, offsets, total):
    from recompile.runtime.jagged import dense_to_jagged_reference

    return dense_to_jagged_reference(out.flatten(2), offsets, total).unflatten(1, out.shape[2:])


@case("hstu_attention", torch.float32, torch.bfloat16)
def hstu_attention_case(size, device, dtype, gen):
    """HSTU attention as the zoo runs it: relative position and time bias, targets at the end of each history."""
    from recompile.runtime.jagged_attention import HSTUArgs, HSTUBucket

    s = ATTENTION[size]
    n = s["max_len"]
    lengths, offsets, q, k, v = _histories(s, device, dtype, gen)
    total = q.shape[0]
    rel = (torch.randn(2 * n - 1, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    time_bias = (torch.randn(s["buckets"] + 1, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    timestamps = torch.randint(0, 3600, (total,), device=device, generator=gen).cumsum(0)
    targets = torch.minimum(lengths, _randint(0, 4, lengths.shape, device, gen))
    args = HSTUArgs(n, s["dim"] ** -0.5, True, 0)

    def attention(impl):
        return lambda: torch.ops.recompile.hstu_attention(q, k, v, offsets, n, args.alpha, True, targets, 0, rel,
                                                          timestamps, time_bias, impl)

    def padded():
        pq, pk, pv, pts = _padded(offsets, n, q, k, v, timestamps[:, None])
        out = HSTUBucket(pq, pk, pv, lengths, targets, pts[..., 0]).forward(args, rel, time_bias)
        return _jagged(out, offsets, total)
    # tl.dot rounds fp32 inputs to tf32 on NVIDIA GPUs
    tol = 2e-2 if device.type != "cpu" else TOL[dtype]
    return Case(f"{s['batch']} long-tailed histories up to {n} ({total} items), {s['heads']} heads x {s['dim']}, "
                f"causal, relative position and time bias ({s['buckets']} buckets), 0-3 targets; eager: padded to "
                "the longest", attention("triton"), padded, [q, k, v, rel, time_bias], max(tol, TOL[dtype]),
                {"aten bucketed": attention("cpu")})


@case("jagged_softmax_attention", torch.float32, torch.bfloat16)
def softmax_attention_case(size, device, dtype, gen):
    """SASRec's causal softmax attention on jagged histories."""
    from recompile.runtime.jagged_attention import SoftmaxBucket

    s = ATTENTION[size]
    n = s["max_len"]
    lengths, offsets, q, k, v = _histories(s, device, dtype, gen)
    scale = s["dim"] ** -0.5

    def attention(impl):
        return lambda: torch.ops.recompile.jagged_softmax_attention(q, k, v, offsets, scale, True, impl)

    def padded():
        return _jagged(SoftmaxBucket(*_padded(offsets, n, q, k, v), lengths).forward(scale, True), offsets, q.shape[0])
    tol = 2e-2 if device.type != "cpu" else TOL[dtype]
    return Case(f"{s['batch']} long-tailed histories up to {n} ({q.shape[0]} items), {s['heads']} heads x {s['dim']}, "
                "causal; eager: padded to the longest", attention("triton"), padded, [q, k, v], max(tol, TOL[dtype]),
                {"aten bucketed": attention("cpu")})


@case("jagged_softmax", torch.float32)
def jagged_softmax_case(size, device, dtype, gen):
    """Softmax over each history's rows, column by column (DIN-style attention pooling)."""
    from recompile.runtime.jagged import dense_to_jagged_reference, jagged_to_padded_dense_reference

    s = ATTENTION[size]
    n = s["max_len"]
    lengths, offsets, values, _, _ = _histories(s, device, dtype, gen)
    values = values.detach().flatten(1).requires_grad_()

    def padded():
        out = torch.softmax(jagged_to_padded_dense_reference(values, offsets, n, float("-inf")), 1)
        return dense_to_jagged_reference(out, offsets, values.shape[0])
    return Case(f"{s['batch']} long-tailed histories up to {n} ({values.shape[0]} rows) x {values.shape[1]}; eager: "
                "padded with -inf", lambda: torch.ops.recompile.jagged_softmax(values, offsets, n, "triton"), padded,
                [values], TOL[dtype])


@case("embedding_optimizer_step", torch.float32)
def optimizer_case(size, device, dtype, gen):
    """The fused row-wise Adagrad step over every table's looked-up rows (it updates the tables: each kernel steps
    its own copy); eager: the reference step (ids deduplicated, rows updated with index_add, table by table)."""
    from recompile.runtime.embedding import SUM
    from recompile.runtime.embedding_optimizer import format_optimizer

    s = EMBEDDING[size]
    t = s["tables"]
    tables = [_randn((s["rows"], s["dim"]), device, dtype, gen, False) for _ in range(t)]
    lengths = [_randint(0, s["max_len"] + 1, (s["batch"],), device, gen) for _ in range(t)]
    ids = [_randint(0, s["rows"], (int(n.sum()),), device, gen) for n in lengths]
    offsets = [torch.cumsum(n, 0) - n for n in lengths]
    grad = torch.randn(s["batch"], t * s["dim"], device=device, generator=gen)
    names, spec = ",".join(f"t{i}" for i in range(t)), format_optimizer("exact_rowwise_adagrad", lr=0.01)
    empty = [torch.empty(0, device=device)] * t

    def step(impl):
        own = [w.clone() for w in tables]

        def run():
            torch.ops.recompile.embedding_optimizer_step(grad, own, ids, offsets, empty, [SUM] * t, [-1] * t,
                                                         [False] * t, "concat", names, "fatal", spec, impl)
            return torch.cat([w.flatten() for w in own])
        return run
    return Case(f"{t} tables {s['rows']}x{s['dim']}, batch {s['batch']}, 0-{s['max_len']} ids per bag, row-wise "
                "Adagrad", step("triton"), step("reference"), tol=1e-4)


CUMSUM = {"tiny": 37, "bench": 2048 * 26}


@case("complete_cumsum", torch.int64, torch.int32)
def complete_cumsum_case(size, device, dtype, gen):
    lengths = _randint(0, 20, (CUMSUM[size],), device, gen).to(dtype)
    return Case(f"{lengths.numel()} lengths",
                lambda: torch.ops.recompile.complete_cumsum(lengths, "triton"),
                lambda: torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0).to(dtype)]), tol=0)


HKV = {"tiny": dict(capacity=256, keys=100, probes=60), "bench": dict(capacity=1 << 22, keys=2_000_000, probes=262_144)}


def hkv_find_case(stored):
    """hkv.HashTable.find through the Triton kernel (probe, then the row read out in the same launch; quantized rows
    dequantized there); eager: the same table probed by the vectorised torch kernel, rows gathered and dequantized
    in torch."""

    def build(size, device, dtype, gen):
        import hkv

        s = HKV[size]
        keys = torch.randperm(4 * s["keys"], device=device, generator=gen)[:s["keys"]] * 7919 - 2**40
        values = torch.randn(s["keys"], 16, device=device, generator=gen)
        tables = {}
        for kernel in ("triton", "reference"):
            tables[kernel] = hkv.HashTable(dim=16, init_capacity=s["capacity"], max_capacity=s["capacity"],
                                           bucket_size=128, device=device, kernel=kernel, dtype=stored or dtype)
            tables[kernel].insert_or_assign(keys, values)
        probes = torch.cat([keys[torch.randperm(s["keys"], device=device, generator=gen)[:s["probes"] // 2]],
                            keys[: s["probes"] // 2] + 1])  # half present, half absent (keys are 7919 apart)

        def find(kernel):
            def run():
                values, found = tables[kernel].find(probes)
                return torch.cat([values, found[:, None].to(values.dtype)], 1)
            return run
        return Case(f"{s['keys']} {stored or 'fp32'} rows of 16 in {s['capacity']} slots (buckets of 128), "
                    f"{s['probes']} probes, half absent", find("triton"), find("reference"), tol=0 if not stored else 1e-6)
    return build


for _stored in (None, "int8", "int4"):
    case("hkv_find" + (f"_{_stored}" if _stored else ""), torch.float32)(hkv_find_case(_stored))


# -- checking and timing -------------------------------------------------------------------------------------

def check(c: Case, device: torch.device) -> dict:
    """Largest error of the Triton kernel against eager: forward, then every gradient through the op."""
    got, want = c.triton(), c.eager()
    errors = {"forward": _error(got, want)}
    if c.leaves:
        grad = torch.randn(want.shape, device=device).to(want.dtype)
        got_grads = torch.autograd.grad(got, c.leaves, grad, allow_unused=True)
        want_grads = torch.autograd.grad(want, c.leaves, grad, allow_unused=True)
        errors["backward"] = max((_error(g, w) for g, w in zip(got_grads, want_grads) if w is not None), default=0.0)
    return {"errors": errors, "ok": all(e <= c.tol for e in errors.values())}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + max |want|): relative for large values, absolute near zero."""
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / (1 + want.abs().max()))


def host_syncs(fn: Callable[[], torch.Tensor]) -> int:
    """How often one forward call makes the host wait for the GPU (torch's sync debug mode, the op's own checks
    included)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.no_grad():
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _train(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step():
        fn().float().sum().backward()
    return step


def _no_grad(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step():
        with torch.no_grad():
            return fn()
    return step


def time_case(c: Case, device: torch.device, rounds: int) -> dict:
    """ms of forward (no grad) and forward + backward for eager, Inductor, Triton and the op's other kernels."""
    from .timing import race_ms

    compiled = torch.compile(c.eager, dynamic=False)
    runs = {"eager": c.eager, "inductor": compiled, "triton": c.triton, **c.others}
    out = {"forward_ms": race_ms({k: _no_grad(f) for k, f in runs.items()}, rounds, iters=10, device=device)}
    if c.leaves:
        out["train_ms"] = race_ms({k: _train(f) for k, f in runs.items()}, rounds, iters=5, device=device)
    return out


def run_kernels(ops: list[str], size: str, device: torch.device, rounds: int, check_only: bool, record) -> list:
    rows = []
    for op in ops:
        build, dtypes = CASES[op]
        for dtype in dtypes if device.type != "cpu" else dtypes[:1]:  # the interpreter's tl.dot takes fp32
            row = {"op": op, "dtype": str(dtype).replace("torch.", "")}
            try:
                gen = torch.Generator(device).manual_seed(0)
                c = build(size, device, dtype, gen)
                row["shape"] = c.shape
                row.update(check(c, device))
                if device.type == "cuda":
                    row["host_syncs"] = host_syncs(c.triton)
                if not check_only and row["ok"]:
                    row.update(time_case(c, device, rounds))
            except Exception as exc:  # a failing kernel is reported and the others still run
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=6))
            rows.append(row)
            record(format_kernel(row), rows)
    return rows


def format_kernel(row: dict) -> str:
    head = f"{row['op']:22s} {row['dtype']:8s} "
    if "error" in row:
        return head + f"FAILED {row['error']}"
    errs = " ".join(f"{k} err {v:.1e}" for k, v in row["errors"].items())
    syncs = f", {row['host_syncs']} host syncs" if "host_syncs" in row else ""
    return head + ("ok   " if row["ok"] else "WRONG ") + errs + syncs + timing_lines(row, "triton")


def timing_lines(row: dict, ours: str) -> str:
    """The row's forward and training ms, each with ``ours`` against eager and Inductor."""
    text = ""
    for key in ("forward_ms", "train_ms"):
        if key in row:
            ms = row[key]
            text += f"\n    {key[:-3]:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()) + \
                f"  | {ours} vs eager {ms['eager'] / ms[ours]:.2f}x, vs inductor {ms['inductor'] / ms[ours]:.2f}x"
    return text


# -- models ----------------------------------------------------------------------------------------------------

COMPILE_BATCHES = (64, 96, None)  # the batch sizes of the compile count (None: the size's own)


def run_models(names: list[str], size: str, device: torch.device, rounds: int, record) -> list:
    rows = []
    for name in names:
        row = {"model": name}
        try:
            row.update(model_row(name, size, device, rounds))
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=8))
        rows.append(row)
        record(format_model(row), rows)
    return rows


def model_row(name: str, size: str, device: torch.device, rounds: int) -> dict:
    from .bench import backend_step
    from .timing import race_ms
    from .train import BACKENDS

    outputs = {b: backend_step(name, size, b, False, device=device)() for b in BACKENDS}
    row = {"error_vs_eager": {b: _error(outputs[b].float(), outputs["eager"].float()) for b in BACKENDS[1:]}}
    for mode, train in (("forward_ms", False), ("train_ms", True)):
        steps = {b: backend_step(name, size, b, train, device=device) for b in BACKENDS}
        row[mode] = race_ms(steps, rounds, iters=3, device=device)
    row["compiles"] = compile_count(name, size, device)
    return row


def compile_count(name: str, size: str, device: torch.device) -> int:
    """Frames rec_ascend compiles while the batch size changes three times (dynamic dims marked)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from .zoo import MODELS

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("rec_ascend")
    model = None
    for batch in COMPILE_BATCHES:
        workload = MODELS[name](size, batch=batch).to(device)
        if model is None:  # one model (the first batch's), fed every batch's inputs
            model = torch.compile(workload.model, backend=counter)
        with torch.no_grad():
            model(*workload.mark_dynamic())
    return counter.frame_count


def format_model(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:24s} FAILED {row['error']}"
    text = f"{row['model']:24s} error vs eager " + " ".join(f"{k} {v:.1e}" for k, v in row["error_vs_eager"].items())
    return text + f", compiles over 3 batch sizes: {row['compiles']}" + timing_lines(row, "rec_ascend")


# -- main ------------------------------------------------------------------------------------------------------

def describe(device: torch.device) -> dict:
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    info = {"device": str(device), "torch": torch.__version__, "triton": triton.__version__,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "machine": platform.node(),
            "threads": torch.get_num_threads(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    return info


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.bench_triton", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=SIZES, help="input sizes (default: bench on an accelerator, tiny on CPU)")
    p.add_argument("--ops", nargs="*", default=sorted(CASES), choices=sorted(CASES), metavar="OP")
    p.add_argument("--models", nargs="*", default=["dlrm", "dcn_v2", "deepfm", "two_tower", "sasrec", "hstu"],
                   metavar="MODEL", help="zoo models to time (none: kernels only)")
    p.add_argument("--model-size", default="bench", choices=("small", "bench"))
    p.add_argument("--check-only", action="store_true", help="check the kernels, time nothing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help=f"where the results go (default: {DOCS_JSON} on an accelerator, "
                                  "bench_triton.json on CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    size = args.size or ("tiny" if device.type == "cpu" else "bench")
    args.json = args.json or ("bench_triton.json" if device.type == "cpu" else DOCS_JSON)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    result = {"setup": describe(device), "size": size}
    print(json.dumps(result["setup"]), flush=True)

    def record(line: str, rows: list, key: str) -> None:
        print(line, flush=True)
        result[key] = rows
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    import recompile  # noqa: F401  (names backend="rec_ascend" where the package is not installed)
    from recompile import runtime  # noqa: F401  (defines the ops)
    run_kernels(args.ops, size, device, args.rounds, args.check_only, lambda line, rows: record(line, rows, "kernels"))
    if args.models and not args.check_only:
        run_models(args.models, args.model_size, device, args.rounds, lambda line, rows: record(line, rows, "models"))
    return result


if __name__ == "__main__":
    main()
