"""The corpus benchmark: third-party models (models/corpus), eager vs Inductor vs rec_ascend, side by side.

    python -m models.bench_corpus [--quick] [--models recbole/FM torchrec/DLRM ...] [--rounds N] [--threads N]
                                  [--json docs/benchmarks/corpus.json] [--doc docs/corpus.md]

Per corpus case (a model's training loss or inference entry), with cold compile caches (fresh Inductor and
recompile cache folders, Inductor's FX-graph and AOT-autograd caches off; each process forked below has its own):
- cold compile time: the first call of Inductor and of rec_ascend (default options: the autotune race included)
  at batch 128, less one steady step, each backend in a process of its own forked from this one after the
  imports (``own_process_compile``: empty caches on disk and in memory, Inductor's C++ compiles in that process),
  wall-clock and CPU seconds (the process's and its C++ compiler's); the ratio the table and the verdict use is
  CPU seconds with ``--cpu-time`` (load from other processes moves it less), wall-clock otherwise. Beside them,
  ``compile_shared_s``: the wall-clock of the first calls in the timing process that compiles Inductor first,
  whose kernels and one-time costs rec_ascend's compile then finds paid;
- ms per step of eager, Inductor and rec_ascend at batch 128 and 2048 (inference entries: batch 1 too), timed
  interleaved round by round, each round starting one backend further (``models.timing.race_rounds``), each sample
  a run of back-to-back calls (``iters``, from ``models.timing.autorange``, the same for every backend of a cell),
  in two timing processes forked one after the other, one compiling Inductor first and the other rec_ascend first
  (``timed_in_orders``: what a process compiles first can move the same code's speed by several percent), each timing
  half the rounds; each backend's best round of both, every round kept (``rounds_ms``) with the backend its
  process compiled first (``compiled_first``); a training step is loss + backward;
- the regions ``models/corpus/expected.py`` expects and those rec_ascend found, and the autotune race's decision
  per graph in each timing process (read from its cache: the candidate kept, each region's kernel, the race's
  timings, what it did not compile and why), which the verdict quotes where rec_ascend is slower than
  min(eager, Inductor);
- whether rec_ascend's output (and gradients) equal eager's (1e-5 / 1e-4 relative), in both timing processes;
- the model's floor, a lower bound: the math of its dense GEMMs (``floor_gemms``: each as its canonical GEMM
  whatever its spelling, a convolution's its im2col's; for training the backward's for the operands that need a
  gradient) timed alone, a memory-bound one no more than its bytes over the measured memory bandwidth, plus its
  lookups' bytes over that bandwidth; beside it the compiled call's own cost (``call_ms``);
- the rec pass pipeline's time per captured graph.
Writes the JSON and renders the corpus table into the doc between its ``corpus-table`` markers. Figures from a
loaded machine are marked so by the caller; ``--quick`` is a smoke run (four models, batch 128 and 1, one round in
each timing process).
The full run (48 cases, 24 models) takes about 28-30 min on 2 quiet cores, an estimate (22 min before the cold
compiles ran in processes of their own; hours on a loaded machine: ``--resume`` goes on from the JSON a stopped run
left; the second timing process adds a compile of both backends per case): ``ROUNDS`` timed rounds (half, rounded
up, in each timing process) after ``WARMUP`` untimed calls per backend, the regions and graph breaks read from the
floor's capture rather than a second trace.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import itertools
import json
import math
import operator
import os
import platform
import statistics
import subprocess
import tempfile
import time
from math import nan
from pathlib import Path

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from recompile.autotune import SHORT_CHECK_CALLS

from .corpus.expected import EXPECTED, graph_breaks
from .corpus.harness import CASES, Case, assert_equal, run
from .timing import autorange, race_ms, race_rounds
from .train import write_json

BACKENDS = ("eager", "inductor", "rec_ascend")
TRAIN_BATCHES, INFER_BATCHES = (128, 2048), (1, 128, 2048)
QUICK_TRAIN_BATCHES, QUICK_INFER_BATCHES = (128,), (1, 128)
QUICK_MODELS = ("recbole/FM", "recbole/SASRec", "torchrec/DLRM", "gr/HSTU")
ROUNDS = 5  # timed rounds of the full run, each backend once per round, interleaved
# Untimed calls of each backend per batch size before its rounds: past rec_ascend's check of a new graph's (or size
# bucket's) choice in place, which alternates the pick with the captured graph for its first calls (at most
# 2 * SHORT_CHECK_CALLS where each step has its backward), so that the rounds time the steady state a server or a
# training loop runs in.
WARMUP = 2 * SHORT_CHECK_CALLS + 1
SAMPLE_MS = 10.0  # a timed sample lasts at least this long for the fastest backend (``timing.autorange``)
# Wall-clock seconds a cell's timed rounds may stretch to past ``--rounds`` (``timing.race_rounds``): cells of short
# steps (batch 1: 10 ms a round per backend) get tens of rounds, whose best moves less from run to run under load.
ROUNDS_BUDGET_S = 1.0
FIRST_BATCH = 128  # the batch of the cold compiles and of the timing processes' first calls
# The compile orders of a cell's two timing processes (``timed_in_orders``): each compiles (first calls at
# FIRST_BATCH, then each batch's new graphs) in its order and times half the rounds.
ORDERS = (("inductor", "rec_ascend"), ("rec_ascend", "inductor"))
TABLE_START, TABLE_END = "<!-- corpus-table:start -->", "<!-- corpus-table:end -->"
CONVS = {torch.conv1d, torch.conv2d, torch.nn.functional.conv1d, torch.nn.functional.conv2d}
GEMMS = {torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm,
         torch.baddbmm, torch.einsum, torch.tensordot, operator.matmul} | CONVS
GEMM_METHODS = {"matmul", "mm", "bmm"}
RNNS = {torch.gru, torch.lstm, torch.rnn_tanh, torch.rnn_relu}  # their padded form: (input, hx, params, ...)


def cold_caches() -> str:
    """Fresh cache folders for Inductor and recompile (autotune decisions), and no FX-graph / AOT-autograd cache
    shared between the Inductor and rec_ascend compiles of one graph."""
    folder = tempfile.mkdtemp(prefix="bench_corpus_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["RECOMPILE_CACHE_DIR"] = os.path.join(folder, "recompile")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    return folder


def decisions_since(start: float) -> list[dict]:
    """The autotune decisions rec_ascend's race stored since ``start`` (time.time()), oldest first; a race whose
    rounds disagreed stores none (it kept the safe candidate)."""
    from recompile.autotune import cache_dir

    files = sorted((f for f in cache_dir().glob("*.json") if f.stat().st_mtime >= start), key=lambda f: f.stat().st_mtime)
    return [json.loads(f.read_text()) for f in files]


def describe_decision(d: dict) -> str:
    """One line: the candidate kept, its regions' kernels, the race's median ms, what was not compiled and why."""
    regions = ", ".join(f"{node}: {impl}" for node, impl in d["regions"].items()) or "no rec region"
    times = ", ".join(f"{name} {ms:.3g}" for name, ms in sorted(d["timings_ms"].items(), key=lambda kv: kv[1]))
    rejected = "; ".join(f"{name} {why}" for name, why in d["rejected"].items())
    return (f"{d['mode']} graph kept {d['choice']} ({regions}); race ms: {times}"
            + (f"; {rejected}" if rejected else ""))


def step_fn(case: Case, fn, module, inputs):
    """One timed step: loss + backward for a training case; for an inference entry the call under
    ``torch.no_grad()``, as a server runs it (eager, Inductor and rec_ascend alike: the graph captured, and so the
    race's candidates, are the inference graph's)."""
    if not case.training:
        def infer():
            with torch.no_grad():
                return fn(*inputs)

        return infer

    def step():
        module.zero_grad(set_to_none=True)
        fn(*inputs).backward()

    return step


def race(steps: dict, rounds: int, clock=time.perf_counter, iters: int | None = None,
         budget_s: float | None = None) -> tuple[dict, int, dict, dict]:
    """``race_rounds`` over the steps that run, each sample ``iters`` (default: ``autorange``'s count) back-to-back
    calls (the same for every backend), after ``WARMUP`` calls of each, at least ``rounds`` rounds and more within
    ``budget_s`` (default ``ROUNDS_BUDGET_S``): each backend's best round, the count, the errors of the backends that
    fail (Inductor fails on some RecBole graphs; left out), and every round's ms per backend (what ``paired``
    compares)."""
    errors = {}
    for name, step in list(steps.items()):
        try:
            step()
        except Exception as exc:  # noqa: BLE001  (any backend failure is a result to report)
            errors[name] = error_text(exc)
            del steps[name]
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    iters = iters or (autorange(steps, SAMPLE_MS, clock) if steps else 1)
    budget_s = ROUNDS_BUDGET_S if budget_s is None else budget_s
    samples = race_rounds(steps, rounds, iters, warmup=0, clock=clock, budget_s=budget_s)
    return {name: min(ms) for name, ms in samples.items()}, iters, errors, samples


def paired(samples: dict[str, list[float]]) -> str | None:
    """How rec_ascend's rounds compare with the faster of eager and Inductor in the same round: "slower in k of n
    rounds, median x" (a cell whose best rounds put rec_ascend behind but whose rounds disagree is load, not a
    cost); None without rec_ascend's rounds or a baseline's."""
    base = [min(r) for r in zip(*(samples[n] for n in ("eager", "inductor") if n in samples))]
    if "rec_ascend" not in samples or not base:
        return None
    ratios = [rec / b for rec, b in zip(samples["rec_ascend"], base)]
    return f"slower in {sum(r > 1 for r in ratios)} of {len(ratios)} rounds, median {statistics.median(ratios):.2f}x"


def error_text(exc: Exception) -> str:
    """The line of ``exc``'s message that says what failed (Dynamo wraps a backend's error in advice lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("Set TORCH")]
    said = next((line for line in lines if "Error:" in line), lines[-1] if lines else "")
    return f"{type(exc).__name__}: {said[:240]}"


def warm_up() -> None:
    """Pay the process's one-time costs (Inductor's imports and compile workers) before any compile is timed."""
    torch.compile(lambda x: (x * 2).sum(), backend="inductor")(torch.randn(4))
    torch._dynamo.reset()


def bandwidth_gbs(megabytes: int = 256, clock=time.perf_counter) -> float:
    """Measured copy bandwidth (bytes read + written per second), best of 5 on ``clock`` (the steps' clock: on a
    loaded machine wall-clock would count other processes' time and lower it, raising the lookups' floor)."""
    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src), clock) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def peak_gflops(size: int = 512, clock=time.perf_counter) -> float:
    """Measured GEMM throughput: a [size, size] x [size, size] ``mm`` timed as the floor's GEMMs are. With the copy
    bandwidth it splits GEMMs into memory-bound and compute-bound ones (``_gemm_floor_ms``)."""
    a, b, out = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    return 2 * size**3 / _steady_ms(lambda: torch.mm(a, b, out=out), 3, clock) / 1e6


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def _materialize(arg, requires_grad: bool):
    """A random tensor of ``arg``'s shape and dtype (fake tensors carry no data)."""
    value = _value(arg)
    if not isinstance(value, torch.Tensor):
        return value
    shape = [_hint(d) for d in value.shape]  # a dynamic graph's sizes: the ones it was captured with
    if value.is_floating_point():
        return torch.randn(shape, dtype=value.dtype).requires_grad_(requires_grad)
    return torch.zeros(shape, dtype=value.dtype)


def _gemm_call(node: fx.Node):
    if node.op == "call_function" and node.target in GEMMS:
        return node.target
    if node.op == "call_method" and node.target in GEMM_METHODS:
        return getattr(torch, node.target)
    return None


def floor_gemms(graphs: list[fx.GraphModule], training: bool) -> tuple[collections.Counter, list[fx.Node]]:
    """The dense GEMMs' math in ``graphs``: each GEMM node as its canonical GEMMs ``(batch, M, K, N, dtype)``, one
    [M, K] x [K, N] (``batch`` > 1: a bmm of truly batched operands), counted; for training also the backward's,
    dA = dC B^T and dB = A^T dC, for the operands that need a gradient. A batch dim along which one operand is
    broadcast joins the other's rows or columns (``matmul(W, x.unsqueeze(2))`` is one [D, D] x [D, B] GEMM, which
    ATen runs by copying W B times); C^T = B^T A^T, so the larger of M and N is the rows. A convolution is the GEMM
    of its im2col, W [C_out, C_in * kernel] x [C_in * kernel, B * output positions] per group (with kernel size 1,
    stride 1, no padding or dilation: exactly its GEMM). Beside them the GEMM nodes whose math is not read this way
    (einsums of other forms, operands given by keyword), timed as spelled."""
    gemms, spelled = collections.Counter(), []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in RNNS:
                gemms.update(_rnn_gemms(node, training))
            if _gemm_call(node) is None:
                continue
            dims = _gemm_dims(node)
            if dims is None:
                spelled.append(node)
                continue
            (g, m, k, n, dtype), (grad_a, grad_b) = dims
            gemms[_canonical(g, m, k, n, dtype)] += 1
            if training and grad_a:
                gemms[_canonical(g, m, n, k, dtype)] += 1
            if training and grad_b:
                gemms[_canonical(g, k, m, n, dtype)] += 1
    return gemms, spelled


def _rnn_gemms(node: fx.Node, training: bool) -> collections.Counter:
    """The GEMMs of a recurrent layer stack (``torch.gru`` / ``lstm`` / ``rnn_*`` on a padded batch), per layer and
    direction: the input projection of every step at once, [B T, I] x [I, G H], and the hidden state's product at
    each of the T steps, [B, H] x [H, G H]; for training also their backward: the inputs' gradient (all steps at
    once; for the first layer where its input needs one), the hidden state's at each step, and each weight's
    gradient summed over the steps as one GEMM. The gate math between them is not counted."""
    x, params = _value(node.args[0]), node.args[2]
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return collections.Counter()  # the packed-sequence form: (data [tokens, I], batch_sizes, hx, params, ...)
    num_layers, bidirectional, batch_first = node.args[4], node.args[7], node.args[8]
    batch, steps = [_hint(d) for d in (x.shape[:2] if batch_first else x.shape[1::-1])]
    per_direction = len(params) // (num_layers * (2 if bidirectional else 1))
    gemms = collections.Counter()
    for i, (w_ih, w_hh) in enumerate(zip(params[::per_direction], params[1::per_direction])):
        w_ih, w_hh = _value(w_ih), _value(w_hh)
        gates, inputs, hidden = _hint(w_ih.shape[0]), _hint(w_ih.shape[1]), _hint(w_hh.shape[1])
        gemms[_canonical(1, batch * steps, inputs, gates, x.dtype)] += 1
        gemms[_canonical(1, batch, hidden, gates, x.dtype)] += steps
        if training:
            if i >= (2 if bidirectional else 1) or x.requires_grad:
                gemms[_canonical(1, batch * steps, gates, inputs, x.dtype)] += 1
            gemms[_canonical(1, batch, gates, hidden, x.dtype)] += steps
            for w, k in ((w_ih, inputs), (w_hh, hidden)):
                if w.requires_grad:
                    gemms[_canonical(1, gates, batch * steps, k, x.dtype)] += 1
    return gemms


def _canonical(g: int, m: int, k: int, n: int, dtype: torch.dtype) -> tuple:
    return g, max(m, n), k, min(m, n), dtype


def _gemm_dims(node: fx.Node):
    """``((batch, M, K, N, dtype), (A needs grad, B needs grad))`` of a matmul-like node, None where it is spelled
    otherwise (keywords, an einsum of other than two operands)."""
    fn, args = _gemm_call(node), [_value(a) for a in node.args]
    if fn in CONVS:
        groups = args[6] if len(args) > 6 else node.kwargs.get("groups", 1)
        return _conv_dims(args[0], args[1], _value(node), groups) if len(args) > 1 else None
    if fn is torch.einsum:
        return _einsum_dims(node.args[0], args[1:])
    if fn is torch.tensordot:
        return _tensordot_dims(args[0], args[1], node.args[2] if len(args) > 2 else node.kwargs.get("dims", 2))
    if fn in (torch._C._nn.linear, torch.nn.functional.linear):
        a, b = args[:2] if len(args) > 1 else (None, None)  # x @ W^T
    elif fn in (torch.addmm, torch.baddbmm):
        a, b = args[1:3] if len(args) > 2 else (None, None)
    elif fn in (torch.matmul, torch.mm, torch.bmm, operator.matmul):
        a, b = args[:2] if len(args) > 1 else (None, None)
    else:
        return None
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    shape_a, shape_b = [_hint(d) for d in a.shape], [_hint(d) for d in b.shape]
    if fn in (torch._C._nn.linear, torch.nn.functional.linear):
        shape_b = shape_b[::-1]
    return _matmul_dims(shape_a, shape_b, a.dtype), _grads(a, b)


def _matmul_dims(a: list[int], b: list[int], dtype: torch.dtype) -> tuple:
    """``matmul``'s GEMM of operands of shapes ``a`` [.., M, K] and ``b`` [.., K, N] (a 1-d one a vector)."""
    a, b = ([1, *a] if len(a) == 1 else a), ([*b, 1] if len(b) == 1 else b)
    g, (m, k), n = 1, a[-2:], b[-1]
    for size_a, size_b in itertools.zip_longest(reversed(a[:-2]), reversed(b[:-2]), fillvalue=1):
        if size_a == size_b:
            g *= size_a
        elif size_b == 1:  # b broadcast along it: more rows of a
            m *= size_a
        else:  # a broadcast along it: more columns of b
            n *= size_b
    return g, m, k, n, dtype


def _conv_dims(x, weight, out, groups: int):
    """The im2col GEMM of a convolution of ``x`` by ``weight`` [C_out, C_in / groups, *kernel] into ``out``."""
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, out)) or not isinstance(groups, int):
        return None
    c_out, c_in, *kernel = [_hint(d) for d in weight.shape]
    spatial = [_hint(d) for d in out.shape]  # [B, C_out, *positions], or [C_out, *positions] unbatched
    rows = math.prod(spatial[-len(kernel):]) * (spatial[0] if out.dim() == weight.dim() else 1)
    return (groups, c_out // groups, c_in * math.prod(kernel), rows, weight.dtype), _grads(weight, x)


def _einsum_dims(equation, operands: list):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = [_value(o) for o in operands[0]]
    equation = equation.replace(" ", "") if isinstance(equation, str) else ""
    if len(operands) != 2 or "->" not in equation or "..." in equation:
        return None
    inputs, out = equation.split("->")
    subs = inputs.split(",")
    size = {c: _hint(d) for sub, op in zip(subs, operands) for c, d in zip(sub, op.shape)}
    dims = dict.fromkeys("gmkn", 1)  # an index of one operand summed away is a reduction before the GEMM: in none
    for c in set(inputs) - {","}:
        if c in subs[0] and c in subs[1]:
            dims["g" if c in out else "k"] *= size[c]
        elif c in out:
            dims["m" if c in subs[0] else "n"] *= size[c]
    return (*dims.values(), operands[0].dtype), _grads(*operands)


def _tensordot_dims(a, b, dims):
    if isinstance(dims, int):
        dims = (list(range(a.dim() - dims, a.dim())), list(range(dims)))
    contracted = {i % a.dim() for i in dims[0]}, {i % b.dim() for i in dims[1]}
    k = math.prod(_hint(a.shape[i]) for i in contracted[0])
    m = math.prod(_hint(d) for i, d in enumerate(a.shape) if i not in contracted[0])
    n = math.prod(_hint(d) for i, d in enumerate(b.shape) if i not in contracted[1])
    return (1, m, k, n, a.dtype), _grads(a, b)


def _grads(a, b) -> tuple[bool, bool]:
    return bool(getattr(a, "requires_grad", False)), bool(getattr(b, "requires_grad", False))


def floor_ms(graphs: list[fx.GraphModule], training: bool, gbs: float, gflops: float, rounds: int,
             clock=time.perf_counter) -> dict:
    """A lower bound of a step: its dense GEMMs' math (``floor_gemms``) each bounded by ``_gemm_floor_ms``, plus
    its lookups' bytes over ``gbs``."""
    gemms, spelled = floor_gemms(graphs, training)
    gemm_ms = sum(count * _gemm_floor_ms(shape, gbs, gflops, rounds, clock) for shape, count in gemms.items())
    for node in spelled:
        args = fx.node.map_aggregate(node.args, lambda a: _materialize(a, training))
        kwargs = fx.node.map_aggregate(node.kwargs, lambda a: _materialize(a, training))
        gemm_ms += _spelled_ms(_gemm_call(node), args, kwargs, training, rounds, clock)
    lookup_bytes = sum(_lookup_bytes(node) * (2 if training else 1) for gm in graphs for node in gm.graph.nodes
                       if node.op == "call_function" and "embedding" in getattr(node.target, "__name__", str(node.target)))
    lookup_ms = lookup_bytes / (gbs * 1e9) * 1e3
    return {"gemm_ms": gemm_ms, "gemms": [[g, m, k, n, count] for (g, m, k, n, _), count in gemms.items()],
            "gemms_spelled": len(spelled), "lookup_bytes": lookup_bytes, "lookup_ms": lookup_ms,
            "ms": gemm_ms + lookup_ms}


def _gemm_floor_ms(shape: tuple, gbs: float, gflops: float, rounds: int, clock) -> float:
    """A GEMM's floor: timed alone (``_canonical_ms``); a memory-bound one (thin: a matrix-vector or low-rank
    product, or batched tiny ones, whose flops at ``gflops`` take less time than its operands' and output's bytes
    at ``gbs``) no more than those bytes over ``gbs``, which a kernel fused around it can reach and ``mm`` alone,
    with its per-call and per-matrix overheads, does not."""
    g, m, k, n, dtype = shape
    bytes_ms = g * (m * k + k * n + m * n) * dtype.itemsize / gbs / 1e6
    timed = _canonical_ms(shape, rounds, clock)
    return min(timed, bytes_ms) if 2 * g * m * k * n / gflops / 1e6 < bytes_ms else timed


def _canonical_ms(shape: tuple, rounds: int, clock) -> float:
    """ms of the GEMM ``shape`` timed alone on contiguous inputs into a preallocated output, steady state
    (``autorange``'s back-to-back calls, best of ``rounds``), in the faster of its two orders: [M, N] = A B or its
    transpose [N, M] = B^T A^T, the same math (MKL's SGEMM runs an output of a few columns several times slower than
    its transpose, ``recompile.narrow_gemm``)."""
    g, m, k, n, dtype = shape
    return min(_mm_ms(g, *order, dtype, rounds, clock) for order in {(m, k, n), (n, k, m)})


def _mm_ms(g: int, m: int, k: int, n: int, dtype: torch.dtype, rounds: int, clock) -> float:
    batch = (g,) if g > 1 else ()
    a, b = torch.randn(*batch, m, k, dtype=dtype), torch.randn(*batch, k, n, dtype=dtype)
    out, mm = torch.empty(*batch, m, n, dtype=dtype), torch.bmm if g > 1 else torch.mm
    return _steady_ms(lambda: mm(a, b, out=out), rounds, clock)


def _spelled_ms(fn, args, kwargs, training: bool, rounds: int, clock) -> float:
    def once():
        out = fn(*args, **kwargs)
        if training and out.requires_grad:
            out.backward(torch.ones_like(out))

    return _steady_ms(once, rounds, clock)


def _steady_ms(step, rounds: int, clock) -> float:
    """ms per call of ``step``, timed as the backends' steps are: back-to-back calls, best of ``rounds``."""
    steps = {"step": step}
    return race_ms(steps, max(3, rounds), autorange(steps, SAMPLE_MS, clock), warmup=2, clock=clock)["step"]


def _lookup_bytes(node: fx.Node) -> int:
    """Rows gathered times their width, plus the output written: the bytes a lookup must move at least."""
    values = [_value(a) for a in node.all_input_nodes]
    ids = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
    tables = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2]
    out = _value(node)
    if ids is None or not tables:
        return 0
    width, size = _hint(tables[0].shape[1]), tables[0].element_size()
    written = _hint(out.numel()) * out.element_size() if isinstance(out, torch.Tensor) else 0
    return _hint(ids.numel()) * width * size + written


def _hint(size) -> int:
    """A dynamic graph's size as the int it was captured with."""
    return optimization_hint(size, fallback=1)


def capture(case: Case, inputs) -> tuple[list[fx.GraphModule], list[float], collections.Counter, int]:
    """Dynamo's graphs of ``case`` on ``inputs``, the rec pipeline's time on each, the regions it found, and the
    graph breaks Dynamo logged (``recompile.explain.logged_breaks``: also one that ends no captured graph)."""
    from recompile.backend import resolve_target
    from recompile.explain import logged_breaks
    from recompile.options import RecompileOptions
    from recompile.pipeline import PassContext, run_pipeline
    from recompile.tracing import TracingConfig

    opts = RecompileOptions()
    graphs, pass_ms, regions = [], [], collections.Counter()

    def backend(gm, example_inputs):
        ctx = PassContext(opts, resolve_target(opts), example_inputs, graph_id=len(graphs))
        start = time.perf_counter()
        run_pipeline(gm, ctx)
        pass_ms.append((time.perf_counter() - start) * 1e3)
        regions.update((r.kind, r.op) for r in ctx.regions)
        graphs.append(gm)
        return gm.forward

    backend.backend_ctx_ctor = TracingConfig  # Dynamo traces as it does for rec_ascend
    torch._dynamo.reset()
    with torch.set_grad_enabled(case.training), logged_breaks() as breaks:
        torch.compile(case.make(0), backend=backend)(*inputs)
    return graphs, pass_ms, regions, len(breaks)


def call_ms(case: Case, inputs, rounds: int, clock=time.perf_counter) -> float:
    """torch.compile's own work per step of ``case`` on ``inputs``: the step compiled as rec_ascend's is (Dynamo
    under rec_ascend's per-call context, AOT autograd) but each compiled graph returning the outputs of its first
    call, so that no kernel runs: Dynamo's guards and frame, AOT autograd's runtime wrappers, for training
    autograd's engine over the compiled backward and the gradients' accumulation. Timed as the steps are
    (``_steady_ms``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from recompile.tracing import TracingCalls

    def replay(gm, example_inputs, fresh: bool = False):
        outputs = []

        def run(*args):
            if not outputs:
                outputs.extend(gm(*args))
            return [torch.zeros_like(o) if fresh and isinstance(o, torch.Tensor) else o for o in outputs]

        return make_boxed_func(run)

    # the forward's outputs as computed (a later graph may index with them); the backward's fresh zeros, as the real
    # backward's are fresh (gradient accumulation takes them instead of copying a tensor held here; anomaly mode,
    # which RecBole's sequential models turn on, rejects uninitialized ones)
    aot = aot_autograd(fw_compiler=replay, bw_compiler=functools.partial(replay, fresh=True))

    def backend(gm, example_inputs):
        return aot(gm, example_inputs)

    backend.backend_ctx_ctor = TracingCalls  # Dynamo traces (and guards) as for rec_ascend, at its cost per call
    torch._dynamo.reset()
    module = case.make(0)
    return _steady_ms(step_fn(case, torch.compile(module, backend=backend), module, inputs), rounds, clock)


def equal(case: Case, compiled, module, reference, inputs) -> bool:
    out_c, grads_c = run(case, compiled, module, inputs)
    out_e, grads_e = run(case, reference, reference, inputs)
    try:
        assert_equal(out_c, out_e, 1e-5, 1e-6, case.name)
        for name, g in grads_e.items():
            assert_equal(grads_c[name], g, 1e-4, 1e-5, name)
    except (AssertionError, KeyError):
        return False
    return True


def own_process_compile(case: Case, backend: str, rows: int) -> dict:
    """The cold compile of ``case`` by ``backend`` as a user's first run meets it: in a process of its own
    (``in_own_process``: imports and warm-up paid, as in any process that has compiled before), with empty Inductor
    and recompile caches on disk and in memory (``own_caches``) and Inductor's C++ compiles run by that process
    (``compile_threads=1``, so that its CPU seconds count them): the first step at batch ``rows`` less the fastest of
    three steady steps, in wall-clock seconds (``wall_s``) and in CPU seconds of the process and its C++ compiler
    (``cpu_s``). ``{"error": ...}`` where the compile fails."""
    return in_own_process(functools.partial(_cold_compile, case, backend, rows))


def in_own_process(fn) -> dict:
    """``fn()``'s JSON-able dict, computed in a process forked from this one, which exits without running this
    process's exit handlers; ``{"error": ...}`` where ``fn`` raises or the process dies."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: computes, writes the result, exits
        os.close(read)
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001  (reported by the parent)
            result = {"error": error_text(exc)}
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(result))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if text else {"error": f"the forked process ended with status {status}"}


@contextlib.contextmanager
def own_caches():
    """Empty Inductor and recompile caches, on disk and in memory (``torch._inductor.utils.fresh_cache``), for the
    rest of a forked process, and Inductor's C++ compiles run by that process (``compile_threads=1``)."""
    from torch._inductor.utils import fresh_cache

    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="bench_corpus_own_") as folder, fresh_cache():
        os.environ["RECOMPILE_CACHE_DIR"] = folder
        yield


def _process_clocks() -> tuple[float, float]:
    """Wall-clock seconds and the CPU seconds of this process and of its children that ended (the C++ compiler)."""
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system


def _cold_compile(case: Case, backend: str, rows: int) -> dict:
    with own_caches():
        module = case.make(0)
        step = step_fn(case, compiled(backend, module), module, case.inputs(rows, 0))
        times = []
        for _ in range(4):
            wall, cpu = _process_clocks()
            step()
            end_wall, end_cpu = _process_clocks()
            times.append((end_wall - wall, end_cpu - cpu))
    (first_wall, first_cpu), steady = times[0], times[1:]
    return {"wall_s": max(0.0, first_wall - min(w for w, _ in steady)),
            "cpu_s": max(0.0, first_cpu - min(c for _, c in steady))}


def compiled(backend: str, module):
    """``module`` as ``backend`` runs it: itself for eager, else ``torch.compile``'s."""
    return module if backend == "eager" else torch.compile(module, backend=backend)


def timed_in_order(case: Case, order: tuple[str, str], batches: tuple, rounds: int, clock=time.perf_counter,
                   iters: list[int] | None = None) -> dict:
    """The timing of one compile order, in a process forked for it with caches of its own (``own_caches``): the
    three backends' modules, the first calls at batch ``FIRST_BATCH`` in ``order`` (``shared_s``: their compile,
    less a steady step), whether rec_ascend's numbers equal eager's, then per batch ``race`` over the steps, their
    first calls at that batch (a new graph or size bucket compiled) in ``order`` too, ``iters`` calls a sample where
    given (the other order's count); with the race's decisions stored since the previous batch's."""
    with own_caches():
        modules = {name: case.make(0) for name in BACKENDS}
        fns = {name: compiled(name, modules[name]) for name in BACKENDS}
        inputs = {b: case.inputs(b, 0) for b in batches}
        shared_s, errors = {}, {}
        started = time.time()
        for name in order:
            step = step_fn(case, fns[name], modules[name], inputs[FIRST_BATCH])
            try:
                cold = _timed(step)
            except Exception as exc:  # noqa: BLE001
                errors[f"{name} at batch {FIRST_BATCH}"] = error_text(exc)
                continue
            shared_s[name] = max(0.0, cold - min(_timed(step) for _ in range(3)))
        numbers_equal = "rec_ascend" in shared_s and equal(case, fns["rec_ascend"], modules["rec_ascend"],
                                                            modules["eager"], inputs[FIRST_BATCH])
        if batches[0] != FIRST_BATCH:  # its graph is compiled (and raced) anew: the first calls' race is not its
            started = time.time()
        timed = []
        for i, b in enumerate(batches):
            steps = {name: step_fn(case, fns[name], modules[name], inputs[b]) for name in ("eager", *order)}
            _, count, failed, samples = race(steps, rounds, clock, iters[i] if iters else None,
                                             ROUNDS_BUDGET_S / len(ORDERS))
            # the races of this batch's graphs (the first batch's: at the first calls), as they stand after the
            # timed calls: a choice the in-place check overturned is stored again, with why
            timed.append({"iters": count, "rounds": samples,
                          "decisions": [describe_decision(d) for d in decisions_since(started)]})
            started = time.time()
            errors.update({f"{name} at batch {b}": why for name, why in failed.items()})
    return {"first": order[0], "shared_s": shared_s, "numbers_equal": numbers_equal, "errors": errors,
            "batches": timed}


def timed_in_orders(case: Case, batches: tuple, rounds: int, clock=time.perf_counter) -> dict:
    """``timed_in_order`` in each of ``ORDERS``, one forked process after the other, each with half the rounds (at
    least ``rounds / 2``, within half of ``ROUNDS_BUDGET_S``) at the first's sample count, their rounds pooled per
    batch: what a process compiles first moves the steps of both compiled backends (docs/corpus.md, "compile
    order"), so neither backend is always the one compiled first. Per batch: each backend's best round (``ms``),
    every round (``rounds_ms``, a backend that failed in either process left out) and which backend its process
    compiled first (``compiled_first``), the sample count (``iters``), each process's race decisions, prefixed
    with its order; ``shared_s`` and ``numbers_equal`` from the processes (both must equal), their errors."""
    runs, errors = [], {}
    for order in ORDERS:
        iters = [t["iters"] for t in runs[0]["batches"]] if runs else None
        run = in_own_process(functools.partial(timed_in_order, case, order, batches, -(-rounds // len(ORDERS)),
                                               clock, iters))
        if "error" in run:
            errors[f"the timing process ({order[0]} compiled first)"] = run["error"]
        else:
            runs.append(run)
            errors.update(run["errors"])
    pooled = {"ms": {}, "iters": {}, "rounds_ms": {}, "compiled_first": {}, "decisions": {}, "errors": errors,
              "shared_s": runs[0]["shared_s"] if runs else {},
              "numbers_equal": bool(runs) and all(run["numbers_equal"] for run in runs)}
    for i, b in enumerate(batches):
        timed = [(run["first"], run["batches"][i]) for run in runs]
        names = [name for name in BACKENDS if timed and all(name in t["rounds"] for _, t in timed)]
        pooled["rounds_ms"][b] = {name: [ms for _, t in timed for ms in t["rounds"][name]] for name in names}
        pooled["compiled_first"][b] = [first for first, t in timed for _ in t["rounds"][names[0]]] if names else []
        pooled["ms"][b] = {name: min(ms) for name, ms in pooled["rounds_ms"][b].items()}
        pooled["iters"][b] = timed[0][1]["iters"] if timed else 0
        pooled["decisions"][b] = [f"{first} compiled first: {d}" for first, t in timed for d in t["decisions"]]
    return pooled


def bench_case(case: Case, rounds: int, gbs: float, gflops: float, quick: bool = False,
               clock=time.perf_counter) -> dict:
    if quick:
        batches = QUICK_TRAIN_BATCHES if case.training else QUICK_INFER_BATCHES
    else:
        batches = TRAIN_BATCHES if case.training else INFER_BATCHES
    compile_s, compile_cpu_s = {}, {}
    errors = {}
    for name in ("inductor", "rec_ascend"):
        cold = own_process_compile(case, name, FIRST_BATCH)
        if "error" in cold:
            errors[f"{name}'s cold compile in its own process"] = cold["error"]
        else:
            compile_s[name], compile_cpu_s[name] = cold["wall_s"], cold["cpu_s"]
    timed = timed_in_orders(case, batches, rounds, clock)
    errors.update(timed["errors"])
    ms, rounds_ms, decisions = timed["ms"], timed["rounds_ms"], timed["decisions"]
    numbers_equal = "rec_ascend" in compile_s and timed["numbers_equal"]
    floors, calls, found = {}, {}, {}
    for b in batches:
        inputs = case.inputs(b, 0)
        try:
            graphs, pass_ms, regions, breaks = capture(case, inputs)
        except Exception as exc:  # noqa: BLE001  (reported; the run goes on to the next case)
            errors[f"capture at batch {b}"] = error_text(exc)
            graphs, pass_ms, regions, breaks = [], [], collections.Counter(), None
        floors[b] = floor_ms(graphs, case.training, gbs, gflops, rounds, clock)
        try:
            calls[b] = call_ms(case, inputs, rounds, clock)
        except Exception as exc:  # noqa: BLE001
            errors[f"call cost at batch {b}"] = error_text(exc)
        found[b] = (pass_ms, regions, breaks)
    pass_ms, regions, breaks = found[FIRST_BATCH]
    expected = EXPECTED[case.model]
    return {
        "case": case.name, "training": case.training, "commit": commit(),
        "regions_expected": [{"label": e.label, "found": e.found(regions) >= e.count, "track": e.track} for e in expected],
        "regions_found": {f"{k} {op}": n for (k, op), n in sorted(regions.items())},
        "graph_breaks": {"found": breaks, "expected": graph_breaks(case.name)[0]},
        "autotune": {str(b): d for b, d in decisions.items()},
        "numbers_equal": numbers_equal,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "compile_shared_s": timed["shared_s"],
        "ms": {str(b): v for b, v in ms.items()},
        "iters": {str(b): v for b, v in timed["iters"].items()},
        "rounds_ms": {str(b): {name: [round(t, 5) for t in ts] for name, ts in v.items()} for b, v in rounds_ms.items()},
        "compiled_first": {str(b): v for b, v in timed["compiled_first"].items()},
        "floor": {str(b): v for b, v in floors.items()},
        "call_ms": {str(b): v for b, v in calls.items()},
        "pass_ms": pass_ms,
        "errors": errors,
        "verdict": verdict(ms, floors, compile_cpu_s if clock is time.thread_time else compile_s, decisions,
                           bool(regions), calls, rounds_ms) + [f"{k} failed: {v}" for k, v in errors.items()],
    }


def verdict(ms: dict, floors: dict, compile_s: dict, decisions: dict, raced: bool = True,
            calls: dict | None = None, rounds_ms: dict | None = None) -> list[str]:
    """Where the issue's targets are missed, and what the run shows about why: the race's decisions per batch
    (``raced``: the graphs had rec regions to race), the rounds compared pair by pair (``rounds_ms``: per batch,
    every round's ms per backend, ``paired``), the floor's parts and the compiled call's own cost (``calls``: ms
    per batch, ``call_ms``)."""
    notes = []
    for b, m in ms.items():
        if "rec_ascend" not in m:
            continue
        best = min(m.get("eager", float("inf")), m.get("inductor", float("inf")))
        call = (calls or {}).get(b)
        if m["rec_ascend"] > best:
            if decisions.get(b):
                why = "; ".join(decisions[b])
            elif raced:
                why = "no decision stored: a race whose rounds disagreed keeps the safe candidate"
            else:
                why = "no rec region and no decision stored: Inductor kept (a race whose rounds disagree keeps it)"
            rounds = paired((rounds_ms or {}).get(b, {}))
            notes.append(f"batch {b}: rec_ascend {m['rec_ascend']:.3f} ms > min(eager, inductor) {best:.3f} ms ({why})"
                         + (f"; {rounds}" if rounds else "")
                         + (f"; the compiled call's own cost {call:.3f} ms" if call else ""))
        floor = floors[b]
        if floor["ms"] and m["rec_ascend"] > 1.5 * floor["ms"]:
            notes.append(f"batch {b}: {m['rec_ascend'] / floor['ms']:.1f}x its floor {floor['ms']:.3f} ms (GEMMs "
                         f"{floor['gemm_ms']:.3f} + lookups {floor['lookup_ms']:.3f}): "
                         f"{m['rec_ascend'] - floor['ms']:.3f} ms in the rest (elementwise, softmax, losses, "
                         f"per-op dispatch" + (f"; the compiled call's own cost {call:.3f} ms" if call else "") + ")")
    if len(compile_s) == 2 and compile_s["rec_ascend"] > 1.5 * compile_s["inductor"]:
        notes.append(f"cold compile {compile_s['rec_ascend'] / max(compile_s['inductor'], 1e-9):.1f}x Inductor's")
    return notes


def render_table(rows: list[dict], cpu: bool = False) -> str:
    """The corpus table; the cold compile column in CPU seconds (``cpu``) with the wall-clock ratio beside it, or in
    wall-clock seconds (rows measured before compiles ran in their own process: the one wall-clock figure)."""
    lines = ["| case | regions expected: found | numbers equal | speed: min(eager, inductor) / rec per batch "
             "| rec / floor per batch | compiled call's own ms per batch "
             f"| cold compile rec / inductor{' (CPU s; wall-clock ratio)' if cpu else ''} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        regions = ", ".join(f"{e['label']}: {'yes' if e['found'] else 'no'}" for e in r["regions_expected"]) or "none"
        speed = ", ".join(f"{b}: {_ratio(min(m.get('eager', nan), m.get('inductor', nan)), m.get('rec_ascend'))}"
                          for b, m in r["ms"].items())
        floor = ", ".join(f"{b}: {_ratio(m.get('rec_ascend'), r['floor'][b]['ms'])}" for b, m in r["ms"].items())
        calls = r.get("call_ms", {})  # rows measured before the call cost was: none
        call = ", ".join(f"{b}: {calls[b]:.3f}" if b in calls else f"{b}: n/a" for b in r["ms"])
        wall = r["compile_s"]
        comp = r.get("compile_cpu_s", wall) if cpu else wall
        compile_text = " / ".join(f"{comp[k]:.1f} s" if k in comp else "failed" for k in ("rec_ascend", "inductor"))
        compile_text += f" ({_ratio(comp.get('rec_ascend'), comp.get('inductor'))}"
        if comp is not wall:
            compile_text += f"; wall {_ratio(wall.get('rec_ascend'), wall.get('inductor'))}"
        lines.append(f"| {r['case']} | {regions} | {'yes' if r['numbers_equal'] else 'NO'} | {speed} | {floor} "
                     f"| {call} | {compile_text}) |")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    """``a / b`` as "1.23x"; "n/a" where either failed (nan, None) or ``b`` is 0."""
    if a is None or b is None or a != a or b != b or not b:
        return "n/a"
    return f"{a / b:.2f}x"


def replace_between(path: str, start: str, end: str, body: str) -> None:
    """Replace the text between the doc's ``start`` and ``end`` markers with ``body``."""
    doc = Path(path)
    text = doc.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} markers to render the table between")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def write_doc(path: str, result: dict) -> None:
    """Replace the text between the doc's table markers with the table of ``result``."""
    done = len(result["rows"])
    partial = f", {done} of {result['cases']} cases measured (a partial run)" if done < result.get("cases", done) else ""
    commits = ", ".join(sorted({r.get("commit", result["commit"]) for r in result["rows"]})) or result["commit"]
    clock = "CPU time per step (time.thread_time)" if result.get("clock") == "cpu" else "wall-clock time per step"
    load = result.get("loadavg")
    note = (f"Measured {result['date']} on {result['machine']}, {result['threads']} threads, {clock}, "
            f"commit {commits}{', --quick' if result['quick'] else ''}, {result['rounds']} rounds{partial}"
            + (f"; load average {load[0]:.1f} when the run started" if load else "")
            + "; speed ratios above 1 mean rec_ascend is faster. Generated by `python -m models.bench_corpus`.")
    table = render_table(result["rows"], cpu=result.get("clock") == "cpu")
    replace_between(path, TABLE_START, TABLE_END, f"{note}\n\n{table}")


@functools.cache  # the commit the run started at (the worktree may move on while it runs)
def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


def kept_rows(path: str, cases: list[Case], resume: bool, replace: bool) -> list[dict]:
    """The rows of an earlier run's JSON to keep: ``resume`` keeps them all (the cases they hold are not measured
    again), ``replace`` those of the cases not being measured now; neither keeps none."""
    if not (resume or replace) or not Path(path).exists():
        return []
    rows = json.loads(Path(path).read_text())["rows"]
    names = {c.name for c in cases}
    return rows if resume else [r for r in rows if r["case"] not in names]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.bench_corpus", description=__doc__.split("\n\n")[0])
    models = sorted({c.model for c in CASES.values()})
    p.add_argument("--models", nargs="+", choices=models, metavar="MODEL", help=f"in this order; default: all ({', '.join(models)})")
    p.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                   help="these cases (model:entry, e.g. recbole/SASRec:full_sort) instead of whole --models")
    p.add_argument("--quick", action="store_true",
                   help=f"{', '.join(QUICK_MODELS)}; batch 128 (inference: 1 and 128); one round per timing process")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="timed rounds, each running every backend once in turn (half, rounded up, in each of the two "
                        "timing processes)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads: 1 (the compiles and the timing run in processes forked from this one, where "
                        "OpenMP hangs once this one has run a parallel region on more threads)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time steps in CPU time of the one torch thread (time.thread_time): on a loaded machine the "
                        "time other processes hold the core is left out; cold compiles compared in CPU seconds of each "
                        "backend's own process (its C++ compiler's included), wall-clock beside them")
    p.add_argument("--resume", action="store_true", help="keep the cases already in --json, measure only the others")
    p.add_argument("--replace", action="store_true",
                   help="keep the --json rows of the cases not chosen, measure the chosen ones again (shards: run "
                        "disjoint --models one after another with --replace into one JSON)")
    p.add_argument("--json", default="docs/benchmarks/corpus.json")
    p.add_argument("--render", action="store_true", help="only render --doc's table from --json (no case is run)")
    p.add_argument("--doc", default="docs/corpus.md", help="the doc whose corpus table is rendered ('' : none)")
    args = p.parse_args(argv)
    commit()  # read now: the rows name the commit the run started at, not one made while it ran
    if args.render:
        result = json.loads(Path(args.json).read_text())
        write_doc(args.doc, result)
        return result
    if args.threads != 1:
        p.error("--threads 1 only: the processes forked for the compiles and the timing hang in OpenMP once this "
                "process has run a parallel region on more than one thread")
    torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    load = os.getloadavg()
    cold_caches()
    warm_up()
    chosen = args.models or (QUICK_MODELS if args.quick else models)
    rounds = 1 if args.quick else args.rounds
    gbs = bandwidth_gbs(64 if args.quick else 256, clock)
    gflops = peak_gflops(clock=clock)
    print(f"copy bandwidth {gbs:.1f} GB/s, GEMM {gflops:.0f} GFLOP/s, {torch.get_num_threads()} threads, "
          f"load average {load[0]:.1f}", flush=True)
    cases = ([CASES[name] for name in args.cases] if args.cases else
             [c for model in chosen for c in CASES.values() if c.model == model])  # in the order given
    rows = kept_rows(args.json, cases, args.resume, args.replace)
    order = {name: i for i, name in enumerate(CASES)}
    total = len(CASES) if not args.quick and (args.resume or args.replace) else len(cases)
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
              "threads": torch.get_num_threads(), "clock": "cpu" if args.cpu_time else "wall", "commit": commit(),
              "quick": args.quick, "rounds": rounds, "bandwidth_gbs": gbs, "peak_gflops": gflops, "loadavg": load,
              "cases": total, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    done = {r["case"] for r in rows}
    for case in (c for c in cases if c.name not in done):
        row = bench_case(case, rounds, gbs, gflops, args.quick, clock)
        result["rows"] = sorted(result["rows"] + [row], key=lambda r: order.get(r["case"], len(order)))
        print(f"{row['case']:40s} equal={row['numbers_equal']} compile " +
              " ".join(f"{k} {v:.1f}s ({row['compile_cpu_s'].get(k, nan):.1f} s CPU)"
                       for k, v in row["compile_s"].items()) + "  " +
              "  ".join(f"b{b} (x{row['iters'][b]}): " + " ".join(f"{k} {v:.3f}" for k, v in m.items())
                        + f" floor {row['floor'][b]['ms']:.3f} call {row['call_ms'].get(b, nan):.3f}"
                        for b, m in row["ms"].items()), flush=True)
        for note in row["verdict"]:
            print(f"    {note}", flush=True)
        # written after every case: a run stopped early keeps (and says) what it measured; --resume goes on from it
        result["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        write_json(args.json, result)
        if args.doc:
            write_doc(args.doc, result)
    print(f"wrote {args.json}" + (f" and the table in {args.doc}" if args.doc else ""))
    return result


if __name__ == "__main__":
    main()
