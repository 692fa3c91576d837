"""Measured choices: keep, per graph, only what runs faster on this machine, and never lose correctness.

On the first compile of a graph (``options.autotune``, the default) the backend times, on the real
example inputs and within ``BUDGET_S`` seconds:

1. each rec region: every kernel the lowering table offers the target (library op, Triton, CPU
   kernel, reference = eager ATen), forward (and backward when the graph trains); the fastest whose
   result matches the reference kernel's is written into the op's ``impl`` argument;
2. the whole graph: ``rec+eager`` (the rewritten graph with the rec ops and eager ATen for the rest),
   ``eager`` (the captured graph as it was), ``rec+eager-<pass>`` (the rewrite without one pass's regions,
   when several passes replaced some), and Inductor on some of these graphs: ``inductor`` (the rewrite),
   ``inductor-captured`` (the Inductor a user would otherwise get), ``inductor-<pass>``. Inductor's compile
   is most of a cold compile, so only the Inductor graphs that can win are compiled (``choose_compiles``):
   the graphs differ only in their rec regions, so Inductor compiles the one whose regions ran fastest
   eagerly, and the captured graph (the Inductor a user would otherwise get) only where it can still win: not
   where its library calls alone take longer than the fastest graph eagerly, nor, for an inference graph
   (``build_compiles``), than Inductor on the fastest graph (compiled and timed first) with the regions' kernels
   swapped back for the library calls they replaced (``captured_cannot_win``): one Inductor compile then, as plain
   Inductor's. A graph with static sizes that keeps both, and whose fastest graph's floor leaves the
   captured graph a chance, builds the captured graph's first (plain Inductor's compile) and the fastest graph's
   only where it can beat that by ``ESTIMATE_MARGIN``: estimated from the captured graph's time with the regions'
   code swapped for their kernels (``RewriteEstimate``); a training graph defers this to the first call, where its
   step is timed (``GraphChooser.admit_deferred``). Inference graphs skip the fastest one where Inductor has little
   to fuse around our ops (``inductor_can_win``). Without rec regions: the captured graph eagerly and through
   Inductor (one compile), Inductor kept unless eager wins by ``MARGIN`` (``CAPTURED_FIRST``).
   A second Inductor compile of a graph, other than plain Inductor's (the captured graph's, which parity with plain
   Inductor needs), also needs to fit ``options.compile_budget`` (``CompileBudget``): the graph's cold compile so far
   plus that compile's estimate within that many times plain Inductor's compile of the graph.
   Each candidate's outputs (and input gradients when training) are checked against ``eager`` first;
   a candidate that disagrees is rejected whatever its speed.

The whole-graph race checks and times each candidate as it will run (``GraphChooser.as_installed``): through the
object Dynamo calls (``CompiledGraph``: the seed draw, the size-bucket dispatch, the error path; a training graph
through Inductor runs aot_autograd's runtime wrapper, which is the compiled candidate itself), with the chooser's
``run`` set to the candidate, after an untimed warm-up call: the object timed is the object installed.

Every race runs its candidates interleaved over rounds and compares them round by round (the median of each
candidate's time over the others' in the same round, ``fastest``), so that neither load from other processes
nor one lucky round decides; a graph choice leaves the captured graph (run eagerly, then through Inductor)
only for a candidate faster by more than ``MARGIN``, in rounds that agree (``settled``: a race whose rounds
disagree by more than the margin keeps the safe candidate, the first incumbent or another that its rounds settle
as faster (``safe_choice``), and is not cached; without an incumbent, ``SAFE``).
Every time is read on one clock (``timer``), which load from other processes moves little: the calling thread's CPU
time where the candidates run on it alone, else the wall clock less the thread's waits for a CPU (``clock_name``,
recorded in the decision's ``conditions``).
The decision's ``kernels`` are those chosen for the rewrite's regions; its ``regions`` are the regions of the graph
the kept candidate runs (none for the captured graph, one pass's fewer for an ablation), with their kernels. An
inference graph run eagerly calls the rec ops' Python functions rather than the dispatched ops
(``direct_calls``): without autograd the dispatch is pure cost.

The race is invisible (``Sandbox``, ``docs/determinism.md``): candidates run on aliases of the call's tensors
outside the caller's autograd graph; every input without grad that a run writes into (BatchNorm's running
statistics, ``num_batches_tracked``) is put back after it; the caller's random stream is forked, and the fork put
back after every run. Dropout seeds are lifted out of the graph (``lift_seeds``) and drawn once per call from the
caller's stream, so that every candidate, and Inductor with autotune off, draws the same masks; the captured graph
(eager's masks) is then no candidate. A graph with other random ops, or that writes into an input requiring grad,
is not raced: it runs through Inductor.

A choice other than the captured graph is checked in place on the caller's first calls after it (alternating
with the captured graph; a training call timed with its part of the caller's backward) and gives way when it loses
there. A graph with symbolic sizes takes one decision per size bucket (``Buckets``): the first call in a new bucket
races the candidates compiled for the graph on that call.

The decision is cached on disk (``$RECOMPILE_CACHE_DIR`` or ``~/.cache/recompile``), keyed by the
rewritten graph's code, the input shapes/dtypes, grad mode, target, torch version and the ``conditions`` it
is measured under (CPU model and ISA flags, threads, whether the machine is busy), and the size bucket; a cached decision is
applied without timing (and without compiling candidates it did not keep). It records the seconds each
candidate took to build (``compile_s``).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import operator
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.eval_frame import innermost_fn
from torch._dynamo.exc import RestartAnalysis
from torch._library.custom_ops import OPDEFS

from recompile.lowering import candidates, ops_where
from recompile.lowering.targets import accelerators_started, synchronize
from recompile.passes.utils import input_metas, is_training, meta_value, written
from recompile.pipeline import Fallback, PassContext, concrete_inputs, run_pipeline

BUDGET_S = 0.6  # timing budget of one graph (regions, then the whole graph); compiles excluded
# Real calls of each of the kept candidate and the captured graph (alternated) that check a choice in place; where
# both take under SHORT_CALL_S a call, SHORT_CHECK_CALLS of each (three timings of a short call are mostly jitter:
# RecBole NARM at batch 1 gave way to eager on "0.040 ms against 0.023 ms", TorchRec DLRM_DCN at 2048 on "0.51 ms
# against 0.42 ms" after the race's 0.36 against 0.46 ms, three calls each).
CHECK_CALLS, SHORT_CHECK_CALLS, SHORT_CALL_S = 3, 15, 0.002
# Inductor is compiled only when the nodes it can fuse away take at least this share of a call (see inductor_can_win).
MIN_FUSABLE_SHARE = 0.05
# Calls Inductor leaves as they are (library GEMMs, lookups): its gain is bounded by the time of the other nodes.
LIBRARY_BOUND = frozenset({
    torch._C._nn.linear, torch.nn.functional.linear, torch.addmm, torch.mm, torch.bmm, torch.matmul,
    torch.nn.functional.embedding_bag, torch.nn.functional.embedding,
})
# Of those, the calls Inductor runs as library calls whatever surrounds them (it generates its own gather for
# F.embedding): their eager time bounds an Inductor graph's from below (``inductor_floor_ms``).
KEPT_BY_INDUCTOR = LIBRARY_BOUND - {torch.nn.functional.embedding}
MIN_ROUNDS, MAX_ROUNDS = 3, 50
# Runs of each library call timed alone for ``inductor_floor_ms`` (the fastest counts: it bounds from below).
FLOOR_ROUNDS = 3
# A candidate replaces the graph that runs without us (the captured graph, eagerly, then through Inductor) only
# when faster by more than this share: this machine's run-to-run noise is larger than what is won below it.
MARGIN = 0.04
# What Inductor on the fastest graph must be estimated to win over Inductor on the captured graph, already compiled, for
# a second Inductor compile (``RewriteEstimate.can_win``): the estimate errs by more than ``MARGIN`` (GR HSTU's forward
# at batch 128: estimated 0.636 ms against the captured graph's 0.680, it ran 0.681), and a compile costs about
# plain Inductor's again; where it is skipped, what runs is at least plain Inductor's graph.
ESTIMATE_MARGIN = 2 * MARGIN
INCUMBENTS = ("eager", "inductor-captured")
# The incumbents of a graph without rec regions (its candidates: the captured graph eagerly and through Inductor):
# Inductor, what backend="inductor" runs on it, unless eager runs faster by more than ``MARGIN`` (a few small
# graphs around an unfused nn.GRU, a graph at batch 1 where Inductor's wrapper costs more than it fuses).
CAPTURED_FIRST = ("inductor-captured", "eager")
# The decision's timing of the captured graph's library calls alone (``inductor_floor_ms``), when measured.
FLOOR = "floor:inductor-captured"
# The safe candidate of a race with no incumbent (a graph whose lookups clamp ids has no captured graph): what
# ``autotune=False`` runs, else the rewrite eagerly.
SAFE = ("inductor", "rec+eager")
CACHE_VERSION = 5
# Size buckets a graph with symbolic sizes races in at most; a call in a further bucket runs the nearest one's choice.
MAX_BUCKETS = 8
# Ops whose results are random (matched on the op's base name: in-place ``_`` and ``_like`` forms stripped).
RANDOM_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "randn", "randint", "randperm", "bernoulli", "normal", "multinomial", "uniform", "exponential",
    "poisson", "cauchy", "log_normal", "geometric", "random", "seed", "manual_seed",
})


@dataclass
class Decision:
    choice: str
    regions: dict[str, str] = field(default_factory=dict)  # op node of the graph that runs -> its impl
    timings_ms: dict[str, float] = field(default_factory=dict)  # candidate -> median ms
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why
    mode: str = "inference"
    cached: bool = False
    key: str = ""
    compile_s: dict[str, float] = field(default_factory=dict)  # candidate -> seconds to build (Inductor's compile)
    kernels: dict[str, str] = field(default_factory=dict)  # op node of the rewrite -> fastest correct impl
    conditions: dict = field(default_factory=dict)  # what the timings were measured under (``conditions()``)

    def to_dict(self) -> dict:
        return {"choice": self.choice, "regions": dict(self.regions), "timings_ms": dict(self.timings_ms),
                "rejected": dict(self.rejected), "mode": self.mode, "cached": self.cached, "key": self.key,
                "compile_s": dict(self.compile_s), "kernels": dict(self.kernels), "conditions": dict(self.conditions)}

    @classmethod
    def from_dict(cls, d: dict) -> "Decision":
        return cls(d["choice"], d["regions"], d["timings_ms"], d["rejected"], d["mode"], True, d["key"],
                   d["compile_s"], d["kernels"], d["conditions"])


# ------------------------------------------------------------------------------------------------
# cache


def cache_dir() -> Path:
    return Path(os.environ.get("RECOMPILE_CACHE_DIR") or Path.home() / ".cache" / "recompile") / "autotune"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [[str(s) for s in value.shape], str(value.dtype), value.requires_grad, value.device.type]
    return type(value).__name__


@functools.cache
def _cpu() -> str:
    """The CPU's model and instruction-set flags (Linux), else what ``platform`` says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = dict(line.split(":", 1) for line in info.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", fields.get("Features", ""))
    return f"{fields.get('model name', platform.machine())} isa:{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def conditions() -> dict:
    """What a decision's timings depend on besides the graph: the CPU (model and ISA flags), the threads torch
    uses, whether other work loads the machine (1-minute load average above half its cores), and the clock that
    times the race (``clock_name``). A decision is kept per conditions: one measured under load is not applied on
    a quiet machine, nor on another CPU."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return {"cpu": _cpu(), "threads": torch.get_num_threads(), "busy": load > 0.5 * (os.cpu_count() or 1),
            "clock": clock_name()}


def graph_key(gm: fx.GraphModule, target: str, training: bool) -> str:
    """Key of a rewritten graph, its input signature (from the placeholders' example values) and the
    ``conditions`` the decision is taken under."""
    inputs = [_describe(x) for x in input_metas(gm)]
    blob = json.dumps([CACHE_VERSION, torch.__version__, target, training, gm.code, inputs, conditions()],
                      default=str, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def bucket_key(key: str, size_bucket: int | None) -> str:
    """The cache key of a graph's decision in one size bucket (None: a graph with static sizes has one)."""
    return key if size_bucket is None else f"{key}-{size_bucket}"


def cached_buckets(key: str) -> dict[int, Decision]:
    """Every size bucket of graph ``key`` decided earlier, with its decision."""
    decisions = {}
    for path in cache_dir().glob(f"{key}-*.json"):
        decision = load(path.stem)
        if decision is not None and path.stem.rsplit("-", 1)[1].isdigit():
            decisions[int(path.stem.rsplit("-", 1)[1])] = decision
    return decisions


def load(key: str) -> Decision | None:
    path = cache_dir() / f"{key}.json"
    try:
        return Decision.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(decision: Decision) -> None:
    """Write atomically (a reader never sees half a file); a cache that cannot be written only warns."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(decision.to_dict(), f, indent=1)
        os.replace(tmp, directory / f"{decision.key}.json")
    except OSError as exc:
        warnings.warn(f"recompile: autotune decision not cached in {directory} ({exc}); it will be measured again")


def forget(key: str) -> None:
    """Drop a cached decision: the next compile of its graph races again."""
    (cache_dir() / f"{key}.json").unlink(missing_ok=True)


def cached_decision(rewritten: fx.GraphModule, target: str) -> dict | None:
    """The decision an earlier compile stored for this graph, for reports; None if there is none."""
    decision = load(graph_key(rewritten, target, is_training(rewritten)))
    return None if decision is None else decision.to_dict()


# ------------------------------------------------------------------------------------------------
# running and timing


# Ops that change state the graph does not own, so every timing run would train or fill a table: hash-table
# lookups (they insert, and their backward applies the optimizer) and the fused embedding optimizer.
STATEFUL_NAMESPACES = frozenset({"hkv"})
UPDATES_IN_BACKWARD = ops_where("updates_in_backward")
# Lookups whose bounds_check "warning"/"ignore" clamps or skips ids the captured graph would raise on:
# with those modes the captured graph is no candidate.
BOUNDS_CHECKED = ops_where("bounds_checked")


def _is_random(name: str) -> bool:
    return name.split(".")[0].rstrip("_").removesuffix("_like") in RANDOM_OPS


def _inactive_dropout(node: fx.Node) -> bool:
    """``F.dropout(x, p, training=False)`` (an eval-mode ``nn.Dropout``, or ``p == 0``): the identity, not random."""
    if node.op != "call_function" or "dropout" not in getattr(node.target, "__name__", ""):
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    bound.apply_defaults()
    return bound.arguments.get("training") is False or bound.arguments.get("p") == 0


def _input_written(value: Any) -> fx.Node | None:
    """The placeholder (or attribute) whose memory ``value`` may share: followed back through views, item
    reads and in-place results (ops whose aten schema returns an alias; an op we cannot name counts as one)."""
    node = value
    while isinstance(node, fx.Node):
        if node.op in ("placeholder", "get_attr"):
            return node
        if not (node.target is operator.getitem or written(node) or _may_alias(node)) or not node.args:
            return None
        node = node.args[0]
    return None


def _returns_view(schema: torch.FunctionSchema) -> bool:
    """``Tensor(a)``: a view of an argument (``Tensor(a!)``, an in-place or ``out=`` result, is a write)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


@functools.cache
def _aten_aliases(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return True
    return any(_returns_view(getattr(packet, overload)._schema) for overload in packet.overloads())


def _may_alias(node: fx.Node) -> bool:
    if isinstance(node.target, torch._ops.OpOverload):
        return _returns_view(node.target._schema)
    return _aten_aliases(_name(node))


def _writes_grad_input(node: fx.Node) -> bool:
    """``node`` writes into a graph input that requires grad, or may (an attribute, an input of unknown kind): the
    race runs each input that requires grad as a leaf of its own, which autograd forbids writing into."""
    for value in written(node):
        source = _input_written(value)
        if source is not None and getattr(meta_value(source), "requires_grad", True):
            return True
    return False


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def is_random(node: fx.Node) -> bool:
    """A node that draws random numbers (not our ops: ``recompile::dropout`` is a function of its seed input)."""
    return (node.op in ("call_function", "call_method") and _op_name(node) is None and _is_random(_name(node))
            and not _inactive_dropout(node))


def tunable(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, allow_random: bool = False) -> bool:
    """Repeatable runs only: real inputs, no random ops (unless ``allow_random``), no write into an input that
    requires grad (writes into intermediates, ``l2 += w.norm()``, and into other inputs, which the race restores,
    are fine), no op that changes state outside the graph (``STATEFUL_NAMESPACES``, ``UPDATES_IN_BACKWARD``)."""
    if example_inputs is None or any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
        return False
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if (is_random(node) and not allow_random) or _writes_grad_input(node):
            return False
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in STATEFUL_NAMESPACES:
            return False
        if _op_name(node) in UPDATES_IN_BACKWARD:
            return False
    return True


def _outputs(result: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def run_step(fn: Callable, args: Sequence[Any], training: bool) -> list[torch.Tensor]:
    """Outputs, and when training the gradients of sum(outputs * w) w.r.t. the inputs that require them."""
    outs = _outputs(fn(*args))
    if not training:
        return [o.detach() for o in outs]
    leaves = [a for a in _tensors(args) if a.requires_grad]
    diff = [o for o in outs if o.requires_grad]
    grads = torch.autograd.grad(diff, leaves, [_weights(o) for o in diff], allow_unused=True) if diff else []
    return [o.detach() for o in outs] + [g for g in grads if g is not None]


def _weights(out: torch.Tensor) -> torch.Tensor:
    """Deterministic, non-uniform output weights, so that a wrong gradient cannot hide in a sum."""
    return torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device).view_as(out)


def matches(got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    """None when equal within the dtype's tolerance, else why not."""
    if len(got) != len(want):
        return f"{len(got)} results, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        low = w.dtype in (torch.float16, torch.bfloat16)
        try:
            torch.testing.assert_close(g, w, rtol=2e-2 if low else 1e-3, atol=2e-2 if low else 1e-4, equal_nan=True)
        except AssertionError as exc:
            return f"result {i} differs from the reference: {str(exc).splitlines()[0]}"
    return None


# ------------------------------------------------------------------------------------------------
# the clock


def clock_name() -> str:
    """The clock every timing of the race reads (``timer``): ``"thread cpu"``, the calling thread's CPU time, where
    the candidates run on that thread alone (one torch thread, no accelerator started): a step that the scheduler
    puts aside for another process counts only the time it ran. Else the wall clock, which counts what a step waits
    for (intra-op threads, an accelerator's queue), less the time the calling thread waited for a CPU while it could
    run (``"wall less waits"``: its run-queue delay, Linux's schedstat), or plain ``"wall"`` where the kernel does
    not report that delay. Under load the wall clock alone made a candidate preempted in its rounds look slow: the
    race kept eager for RecBole SASRec's full sort at 0.51x of min(eager, Inductor), 1.25x on a quiet machine."""
    if torch.get_num_threads() == 1 and not accelerators_started():
        return "thread cpu"
    return "wall less waits" if _waited_s() is not None else "wall"


_schedstat = threading.local()  # each thread's open /proc/thread-self/schedstat (its own; read with pread)


def _waited_s() -> float | None:
    """Seconds the calling thread has spent runnable but not running (the second field of its schedstat); None
    where the kernel does not report it."""
    try:
        if not hasattr(_schedstat, "fd"):
            _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(_schedstat.fd, 64, 0).split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


def _wall_less_waits() -> float:
    return time.perf_counter() - _waited_s()


CLOCKS: dict[str, Callable[[], float]] = {
    "thread cpu": time.thread_time, "wall less waits": _wall_less_waits, "wall": time.perf_counter,
}


def timer() -> Callable[[], float]:
    """The reading of the race's clock (``clock_name``), chosen when a timing begins; a time is two readings apart."""
    return CLOCKS[clock_name()]


def race(steps: dict[str, Callable[[], Any]], budget_s: float, min_rounds: int = MIN_ROUNDS,
         clock: Callable[[], float] | None = None, reset: Callable[[], None] = lambda: None
         ) -> dict[str, list[float]]:
    """Seconds per step of each candidate in every round, on ``clock`` (default: ``timer()``; the budget too). A
    round runs every candidate once, each round starting one candidate further (none always runs right after the
    same other), so that load from other processes falls on all of them alike; rounds go on while the budget lasts,
    at least ``min_rounds`` (a median needs three). ``reset`` runs after each step, untimed (``Sandbox.restore``)."""
    clock = clock or timer()
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = clock()
    rounds = 0
    while names and (rounds < min_rounds or (rounds < MAX_ROUNDS and clock() - start < budget_s)):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize()  # an accelerator's queued kernels count, not their launches
            t0 = clock()
            steps[name]()
            synchronize()
            samples[name].append(clock() - t0)
            reset()
        rounds += 1
    return samples


def median_ms(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(statistics.median(times) * 1e3, 4) for name, times in samples.items() if times}


def relative_times(samples: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Each candidate's time over the reference's in the same round, median over rounds: a round slowed by load
    slows the candidates of that round alike, and an outlier round does not move a median."""
    ref = [max(r, 1e-12) for r in samples[reference]]
    return {name: statistics.median(t / r for t, r in zip(times, ref)) for name, times in samples.items() if times}


def fastest(samples: dict[str, list[float]], incumbents: Sequence[str] = (), margin: float = 0.0) -> str | None:
    """The candidate to keep: the fastest relative to the others round by round (``relative_times``), unless an
    incumbent (the first present, in order) is within ``margin`` of it: measured noise must not move a choice
    away from the graph that runs without us. None without candidates."""
    if not samples:
        return None
    relative = relative_times(samples, next(iter(samples)))
    best = min(relative, key=relative.get)
    for name in incumbents:
        if name in relative and relative[name] <= relative[best] * (1 + margin):
            return name
    return best


# ------------------------------------------------------------------------------------------------
# the race is invisible


class Sandbox:
    """What the race runs on instead of a call's inputs, so that timing candidates changes nothing the caller
    sees: each tensor as an alias outside the caller's autograd graph and version counters (``.data``; those
    that require grad as leaves of their own), the value of each tensor that does not require grad kept and put
    back after every run (a graph may write into its inputs without saying so: ``F.batch_norm(training=True)``
    updates the running statistics it is given, ``num_batches_tracked.add_(1)``), and the caller's random stream
    forked; inside, the forked stream is put back where it started after every run, so that every run (the
    oracle, each candidate, each round) draws the same numbers (the dropout seeds the compiled graph draws at each
    call, ``CompiledGraph``). ``seeds``: values of the dropout seeds lifted out of the graph (``lift_seeds``) for
    graphs run on their own, the same for every candidate."""

    def __init__(self, args: Sequence[Any], seeds: Sequence[torch.Tensor] = ()):
        self.saved = [(t, t.detach().clone()) for t in _tensors(args) if not t.requires_grad]
        alias = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.data.requires_grad_(t.requires_grad),
                                                  list(args))
        self.args = (*alias, *seeds)
        self._rng, self._rng_state = torch.random.fork_rng(), None

    def restore(self) -> None:
        for tensor, value in self.saved:
            tensor.data.copy_(value)
        if self._rng_state is not None:  # inside the fork only: the caller's stream is never set
            _set_rng_state(self._rng_state)

    def __enter__(self) -> "Sandbox":
        self._rng.__enter__()
        self._rng_state = _rng_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
        self._rng_state = None
        self._rng.__exit__(*exc)


def _rng_state() -> list[torch.Tensor]:
    """The states of the random streams a run draws from: the CPU's and the current accelerator's (those
    ``torch.random.fork_rng`` forks)."""
    accelerator = torch.accelerator.current_accelerator()
    device = [torch.get_device_module(accelerator.type).get_rng_state()] if accelerator is not None else []
    return [torch.get_rng_state(), *device]


def _set_rng_state(state: list[torch.Tensor]) -> None:
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.get_device_module(torch.accelerator.current_accelerator().type).set_rng_state(state[1])


def _is_seed(node: fx.Node) -> bool:
    """A ``torch.randint`` whose only users take it as their dropout seed (``passes/dropout.py``)."""
    return (node.op == "call_function" and node.target is torch.randint and bool(node.users)
            and all(u.target is torch.ops.recompile.dropout.default and u.args[2] is node for u in node.users))


def lift_seeds(gm: fx.GraphModule) -> list[tuple[tuple, dict]]:
    """Turn each dropout seed drawn in ``gm`` into a trailing input; returns the ``torch.randint`` arguments that
    draw them (``drawing_seeds``). The seed is then drawn once per call outside every candidate, from the
    caller's random stream, so that eager ATen and Inductor (whose ``randint`` draws from its own generator)
    run the same masks."""
    seeds = [node for node in gm.graph.nodes if _is_seed(node)]
    last = list(gm.graph.find_nodes(op="placeholder"))[-1] if seeds else None
    draws = []
    for i, node in enumerate(seeds):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"dropout_seed_{i}")
        last.meta.update(node.meta)
        node.replace_all_uses_with(last)
        gm.graph.erase_node(node)
        draws.append((node.args, dict(node.kwargs)))
    gm.recompile()
    return draws


def seed_examples(draws: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """Fixed seeds for the race and the compiles (any value would do: the race must not draw from the caller)."""
    return [torch.tensor([12345, 678], dtype=kwargs.get("dtype"), device=kwargs.get("device")) for _, kwargs in draws]


def draw_seeds(draws: Sequence[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """The lifted seeds, drawn from the caller's random stream as the graph drew them."""
    return [torch.randint(*args, **kwargs) for args, kwargs in draws]


def drawing_seeds(fn: Callable, draws: list[tuple[tuple, dict]]) -> Callable:
    """``fn`` (a graph that is not raced) with the lifted seeds drawn at each call."""
    if not draws:
        return fn
    fn = inductor_call(fn)

    def call(*args: Any) -> Any:
        return fn(*args, *draw_seeds(draws))

    return call


# ------------------------------------------------------------------------------------------------
# per-region kernels


def _op_name(node: fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target.name().replace(".default", "") if target.namespace == "recompile" else None


class _ArgRecorder(fx.Interpreter):
    """Runs the graph and keeps the real arguments of every node ``keep`` selects (default: the recompile ops)."""

    def __init__(self, gm: fx.GraphModule, keep: Callable[[fx.Node], bool] = lambda n: _op_name(n) is not None):
        super().__init__(gm)
        self.keep, self.recorded = keep, {}

    def run_node(self, n: fx.Node) -> Any:
        if self.keep(n):
            self.recorded[n.name] = self.fetch_args_kwargs_from_env(n)
        return super().run_node(n)


def _call_impl(packet, impl: str, kwargs: dict, *args: Any) -> Any:
    return packet(*args, impl, **kwargs)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    """Every tensor among ``args``, also inside lists (a grouped lookup's tables)."""
    return [a for a in torch.utils._pytree.tree_leaves(list(args)) if isinstance(a, torch.Tensor)]


def _fresh(args: tuple, training: bool) -> tuple:
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda a: a.detach().requires_grad_(training and a.is_floating_point()), args
    )


def tune_regions(gm: fx.GraphModule, sandbox: Sandbox, target, training: bool, decision: Decision,
                 clock: Callable[[], float], deadline: float) -> None:
    """Pick each rec op node's fastest correct kernel; rewrite its ``impl`` argument. ``deadline``: on ``clock``."""
    recorder = _ArgRecorder(gm)
    with torch.no_grad():
        recorder.run(*sandbox.args)
    sandbox.restore()
    for node in gm.graph.nodes:
        op = _op_name(node)
        if op is None or node.name not in recorder.recorded:
            continue
        impls = [impl.impl for impl in candidates(op, target)]
        call_args, kwargs = recorder.recorded[node.name]
        inputs = _fresh(call_args[:-1], training)
        packet = node.target
        want = run_step(functools.partial(_call_impl, packet, "reference", kwargs), inputs, training)
        steps = {}
        for impl in impls:
            fn = functools.partial(_call_impl, packet, impl, kwargs)
            try:
                why = matches(run_step(fn, inputs, training), want)
            except Exception as exc:  # a kernel that cannot run these inputs is not a candidate
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                steps[impl] = functools.partial(run_step, fn, inputs, training)
            else:
                decision.rejected[f"{node.name}:{impl}"] = why
        budget = max(deadline - clock(), 0.0) / (2 * max(len(recorder.recorded), 1))
        samples = race(steps, budget, clock=clock)
        decision.timings_ms.update({f"{node.name}:{impl}": ms for impl, ms in median_ms(samples).items()})
        decision.kernels[node.name] = fastest(samples) or node.args[-1]
    apply_regions(gm, decision.kernels)


def apply_regions(gm: fx.GraphModule, regions: dict[str, str]) -> None:
    for node in gm.graph.nodes:
        if node.name in regions and _op_name(node) is not None:
            node.args = (*node.args[:-1], regions[node.name])
    gm.recompile()


# ------------------------------------------------------------------------------------------------
# whole graph


class _NodeTimer(fx.Interpreter):
    """Runs the graph eagerly and adds up the time (``timer``) of all nodes and of those ``fixed`` says Inductor
    keeps, each ``fixed(node)`` times."""

    def __init__(self, gm: fx.GraphModule, fixed: Callable[[fx.Node], bool]):
        super().__init__(gm)
        self.is_fixed, self.fixed, self.total, self.clock = fixed, 0.0, 0.0, timer()

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        synchronize()
        t0 = self.clock()
        result = super().run_node(n)
        synchronize()
        elapsed = self.clock() - t0
        self.total += elapsed
        self.fixed += elapsed * self.is_fixed(n)  # a weight: a node counted twice bounds its backward too
        return result


def timed_nodes(gm: fx.GraphModule, sandbox: Sandbox, fixed: Callable[[fx.Node], bool]) -> _NodeTimer:
    """One eager run of ``gm`` on the sandbox's inputs timed node by node, after a warm-up run."""
    timer = _NodeTimer(gm, fixed)
    with torch.no_grad():
        for _ in range(2):
            timer.fixed = timer.total = 0.0
            timer.run(*sandbox.args)
            sandbox.restore()
    return timer


def _left_alone(node: fx.Node) -> bool:
    return node.target in LIBRARY_BOUND or _op_name(node) is not None or node.op == "call_module"


def inductor_can_win(rewritten: fx.GraphModule, sandbox: Sandbox) -> bool:
    """Whether Inductor is worth compiling for this inference graph: it keeps GEMMs, lookups and our ops as
    they are, so it can save at most the time of the other nodes (pointwise work, copies, per-op dispatch);
    when those take under ``MIN_FUSABLE_SHARE`` of an eager call, it cannot beat running the graph eagerly.
    Training graphs always compile it: Inductor's backward (e.g. of lookups) can win where the forward cannot."""
    timer = timed_nodes(rewritten, sandbox, _left_alone)
    return timer.total - timer.fixed >= MIN_FUSABLE_SHARE * timer.total


def calls_alone_ms(gm: fx.GraphModule, sandbox: Sandbox, weight: Callable[[fx.Node], int]) -> float:
    """The ms of the calls of ``gm`` that ``weight`` counts, each timed alone on its real arguments (recorded in one
    eager run) and counted ``weight(node)`` times: the fastest of ``FLOOR_ROUNDS`` runs, called directly. (Timed
    inside a run of the graph, node by node through ``fx.Interpreter``, each call also carries the interpreter's
    few microseconds: on TorchRec's DeepFM at batch 128 its 8 lookups and GEMMs took 0.08 ms that way, 0.04 ms
    alone, as long as the whole graph run eagerly.)"""
    recorder = _ArgRecorder(gm, lambda n: n.op == "call_function" and weight(n) > 0)
    with torch.no_grad():
        recorder.run(*sandbox.args)
        sandbox.restore()
        nodes = {n.name: n for n in gm.graph.nodes if n.name in recorder.recorded}
        calls = {name: functools.partial(node.target, *recorder.recorded[name][0], **recorder.recorded[name][1])
                 for name, node in nodes.items()}
        samples = race(calls, 0.0, min_rounds=FLOOR_ROUNDS)
    return 1e3 * sum(weight(nodes[name]) * min(times) for name, times in samples.items())


def inductor_floor_ms(gm: fx.GraphModule, sandbox: Sandbox, training: bool) -> float:
    """A lower bound of the time of ``gm`` compiled by Inductor: the calls it hands to a library whatever
    surrounds them (``KEPT_BY_INDUCTOR``), timed eagerly, each alone (``calls_alone_ms``); in training, a call whose
    output needs a gradient counts twice (the backward of a product or a lookup has at least one call of the
    forward's size per input needing one)."""
    def times(node: fx.Node) -> int:
        if node.target not in KEPT_BY_INDUCTOR:
            return 0
        return 2 if training and getattr(node.meta.get("example_value"), "requires_grad", False) else 1
    return calls_alone_ms(gm, sandbox, times)


def rewrite_floor_ms(gm: fx.GraphModule, sandbox: Sandbox, decision: Decision, training: bool = True) -> float:
    """A lower bound of ``gm`` (a graph with rec regions) compiled by Inductor, a training step (forward and backward)
    or an inference call: its library calls alone (``inductor_floor_ms``) plus its regions' chosen kernels as
    ``tune_regions`` timed them (Inductor calls our ops as they are); a region not timed counts nothing."""
    return inductor_floor_ms(gm, sandbox, training) + kernels_ms(gm, decision)


def kernels_ms(gm: fx.GraphModule, decision: Decision) -> float:
    """The ms of ``gm``'s regions' chosen kernels as ``tune_regions`` timed them (a region not timed counts nothing)."""
    return sum(decision.timings_ms.get(f"{node}:{impl}", 0.0) for node, impl in graph_regions(gm).items())


@dataclass(frozen=True)
class RewriteEstimate:
    """What Inductor on the graph that ran fastest eagerly (G: the captured graph with some regions' code replaced by
    our kernels) would take, given what Inductor on the captured graph takes: the captured graph's time, less
    Inductor's time on the code the regions replace, plus the kernels. That code's eager time is the captured graph's
    eagerly less G's plus the kernels; its library calls (the captured graph's less G's, ``inductor_floor_ms``) count
    as they are, the rest sped up as much as Inductor sped up the captured graph's other calls. Never below G's floor
    (``floor_ms``: its library calls and kernels alone). Without the eager times (one graph raced eagerly), the floor.
    From the corpus' decisions, the estimate tells apart where Inductor on G won and lost by more than ``MARGIN``
    (FM / NFM predict and loss, HSTU forward: lost; SASRec full sort, cross nets' forward: won)."""
    floor_ms: float
    kernels_ms: float
    eager_ms: float | None = None
    captured_eager_ms: float | None = None
    captured_floor_ms: float = 0.0

    def ms(self, captured_ms: float) -> float:
        if self.eager_ms is None or self.captured_eager_ms is None:
            return self.floor_ms
        replaced = max(self.captured_eager_ms - self.eager_ms + self.kernels_ms, 0.0)
        replaced_library = self.replaced_library_ms()
        rest = self.captured_eager_ms - self.captured_floor_ms
        speedup = min(max((captured_ms - self.captured_floor_ms) / rest, 0.0), 1.0) if rest > 0 else 1.0
        inductor_replaced = replaced_library + speedup * (replaced - replaced_library)
        return max(captured_ms - inductor_replaced + self.kernels_ms, self.floor_ms)

    def can_win(self, captured_ms: float) -> bool:
        """Whether Inductor on G is estimated to beat Inductor on the captured graph (which the race keeps unless
        another candidate runs faster by ``MARGIN``) by ``ESTIMATE_MARGIN``: the estimate's error besides the race's."""
        return self.ms(captured_ms) * (1 + ESTIMATE_MARGIN) < captured_ms

    def why_not(self, name: str, captured_ms: float) -> str:
        return (f"not compiled: inductor-captured ran {captured_ms:.3f} ms, {name} would take about "
                f"{self.ms(captured_ms):.3f} ms (its library calls and regions alone {self.floor_ms:.3f} ms)")

    def replaced_library_ms(self) -> float:
        """The captured graph's library calls that G's regions replaced (its ``inductor_floor_ms`` less G's, at most
        the code they replaced), as they run alone: Inductor runs them as they are. 0 without the eager times."""
        if self.eager_ms is None or self.captured_eager_ms is None:
            return 0.0
        replaced = max(self.captured_eager_ms - self.eager_ms + self.kernels_ms, 0.0)
        return min(max(self.captured_floor_ms - max(self.floor_ms - self.kernels_ms, 0.0), 0.0), replaced)

    def captured_least_ms(self, ms: float) -> float:
        """The least Inductor on the captured graph can take where Inductor on G took ``ms``: G's time with its kernels
        swapped back for the library calls they replaced, the other code they replaced counted as nothing (as if
        Inductor fused it away). Unlike ``ms``, no speed-up is assumed: it does not hold the captured graph back where
        Inductor fuses a region's code better than our kernel runs it (a short softmax)."""
        if self.eager_ms is None or self.captured_eager_ms is None:
            return 0.0
        return ms - self.kernels_ms + self.replaced_library_ms()


@dataclass
class CompileBudget:
    """What a graph's cold compile may take (``options.compile_budget``): ``ratio`` x plain Inductor's, which is
    Dynamo's tracing before the backend (``traced_s``) and Inductor's compile of the captured graph:
    inductor-captured's ``compile_s`` where it was compiled (a training graph's with its backward's, compiled at its
    first step: ``GraphChooser.admit``), else the first Inductor compile's seconds. The compile so far counts
    Dynamo's tracing, then from the backend's call (passes, races, compiles) to its return (``pause``), then the
    first call's race (``resume``): a training graph's deferred compile is part of that call. A further Inductor
    candidate's compile is estimated from what this process measured: the first Inductor compile's seconds times
    the candidate's graph's nodes over that graph's. ``ratio`` None: no limit (``mode="max-autotune"``)."""
    ratio: float | None
    graphs: dict[str, Callable[[], fx.GraphModule]]
    since: float | None = field(default_factory=time.perf_counter)
    spent_s: float = 0.0
    traced_s: float = 0.0

    def pause(self) -> None:
        self.spent_s, self.since = self.elapsed_s(), None

    def resume(self) -> None:
        self.since = time.perf_counter()

    def elapsed_s(self) -> float:
        return self.spent_s + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def why_not(self, name: str, decision: Decision) -> str | None:
        """Why candidate ``name`` is not compiled (the compile so far and its estimate exceed the budget), or None."""
        first = next((n for n in decision.compile_s if n.startswith("inductor")), None)
        if self.ratio is None or first is None:
            return None
        plain_s = self.traced_s + decision.compile_s.get("inductor-captured", decision.compile_s[first])
        nodes = {n: len(self.graphs[graph_of(n)]().graph.nodes) for n in (first, name)}
        estimate_s, spent_s = decision.compile_s[first] * nodes[name] / nodes[first], self.traced_s + self.elapsed_s()
        if spent_s + estimate_s <= self.ratio * plain_s:
            return None
        return (f"not compiled: compile budget {self.ratio:g}x plain Inductor's {plain_s:.2f} s: {spent_s:.2f} s "
                f"spent, about {estimate_s:.2f} s more")


class BackwardClock:
    """A training call's part in the caller's backward: from the first gradient of the call's outputs to the last
    gradient it computes for the call's inputs (autograd hooks on each; removed by ``stop``). Timed to the last
    input reached, not the first: the captured graph run eagerly gives its inputs their gradients one autograd node
    after another, a compiled graph all at once, and stopping at the first under-timed the former. ``done`` is
    called once every input has its gradient; a caller's backward that reaches only some (``torch.autograd.grad``
    of a few of them) is read at the call after."""

    def __init__(self, name: str, forward_s: float, outs: list[torch.Tensor], ins: list[torch.Tensor],
                 done: Callable[["BackwardClock"], None]):
        self.name, self.forward_s, self.waiting, self.done = name, forward_s, len(ins), done
        self.clock = timer()  # read in the thread that runs the backward: the caller's on CPU
        self.began: float | None = None
        self.last: float | None = None
        self.handles = [o.register_hook(self.begin) for o in outs] + [a.register_hook(self.reached) for a in ins]

    def begin(self, grad: torch.Tensor) -> None:
        if self.began is None:
            synchronize()
            self.began = self.clock()

    def reached(self, grad: torch.Tensor) -> None:
        synchronize()
        self.last, self.waiting = self.clock(), self.waiting - 1
        if self.waiting == 0:
            self.done(self)

    def stop(self) -> float | None:
        """Seconds of the call's forward and backward; None when its backward did not run."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.began is None or self.last is None:
            return None
        return self.forward_s + self.last - self.began


class GraphChooser:
    """The compiled graph's choice: its first call races the candidates on that call's inputs (outside the compile,
    so that no timing run touches Dynamo's shape environment, and in a ``Sandbox``, so that none touches the
    caller's tensors, autograd graph or random stream), keeps the fastest correct one (``fastest``: the first of
    ``incumbents`` unless another wins by ``MARGIN`` in rounds that agree, ``settled``) and stores the decision,
    with the regions of the graph the kept candidate runs (``graphs``: by eager candidate name); from then on
    ``run`` is that candidate itself.

    Every candidate is checked and timed as it will run (``as_installed``): through ``entry``, the object Dynamo
    calls (``CompiledGraph``: the seed draw, the size-bucket dispatch, the error path), with ``run`` set to it, the
    very object kept afterwards. ``draws``: the dropout seeds ``entry`` draws and appends to each call."""

    def __init__(self, candidates: dict[str, Callable], oracle: Callable, decision: Decision, budget_s: float,
                 chosen: Callable | None = None, graphs: dict[str, Callable[[], fx.GraphModule]] | None = None,
                 incumbents: Sequence[str] = INCUMBENTS, eager: Callable | None = None, rec: Callable | None = None,
                 draws: Sequence[tuple[tuple, dict]] = (),
                 deferred: dict[str, tuple[Callable, RewriteEstimate]] | None = None,
                 compile_budget: CompileBudget | None = None):
        self.candidates, self.oracle, self.decision, self.budget_s = candidates, oracle, decision, budget_s
        self.deferred = dict(deferred or {})  # name -> (builder, its estimate): built at the first call if it can win
        self.compile_budget = compile_budget  # what the deferred compile may take
        self.graphs, self.incumbents, self.eager, self.stored = graphs, incumbents, eager, False
        # Runs a call that fails, for its error: the rec ops name the table or op at fault.
        self.rec = rec or candidates.get("rec+eager")
        self.run: Callable = self.first_call if chosen is None else self.checked(chosen)
        self.draws, self.racing = tuple(draws), False
        # What Dynamo calls: ``run`` itself until a ``CompiledGraph`` installs this chooser.
        self.entry: Callable = lambda *args: self.run(*args)

    def as_installed(self, fn: Callable) -> Callable:
        """``fn`` called as it runs once it is the choice: ``entry`` called with the call's own arguments (without
        the seeds: ``entry`` draws them, from the sandbox's stream), this chooser's ``run`` being ``fn`` for the
        call. ``entry`` dispatches to this chooser: a chooser is first called in its own size bucket."""
        def call(*args: Any) -> Any:
            previous, self.run, self.racing = self.run, fn, True
            try:
                return self.entry(*args)
            finally:
                self.run, self.racing = previous, False
        return call

    @torch._dynamo.disable
    def first_call(self, *args: Any) -> Any:
        own = args[:len(args) - len(self.draws)]  # the seeds are drawn again by ``entry`` at each run
        with Sandbox(own) as sandbox:
            try:
                want = run_step(self.as_installed(self.oracle), sandbox.args, self.decision.mode == "training")
            except Exception:
                want = None
            sandbox.restore()
            if want is not None:
                self.run = self.choose(sandbox, want)
        if want is not None:
            return self.run(*args)
        # Bad input (the rec ops' error names what is wrong), or a graph that runs on the caller's tensors only:
        # the choice waits for a call that runs.
        return (self.rec or self.oracle)(*args)

    def admit(self, name: str, sandbox: Sandbox, want: list[torch.Tensor], steps: dict[str, Callable]) -> None:
        """Candidate ``name`` checked against ``want`` (rejected with why where it fails or differs), else its step
        added to ``steps`` after a second untimed call: it is timed as it runs from then on. An Inductor candidate of
        a training graph compiles its backward in its first step: in the graph's first race, what that step takes
        over the second goes into its ``compile_s``."""
        training = self.decision.mode == "training"
        installed = self.as_installed(self.candidates[name])
        start = time.perf_counter()
        try:
            why = matches(run_step(installed, sandbox.args, training), want)
        except Exception as exc:  # a candidate that fails to run is not kept
            why = f"{type(exc).__name__}: {exc}"
        finally:
            sandbox.restore()
        if why is not None:
            self.decision.rejected[name] = why
            return
        first_s, start = time.perf_counter() - start, time.perf_counter()
        steps[name] = functools.partial(run_step, installed, sandbox.args, training)
        steps[name]()
        second_s = time.perf_counter() - start
        sandbox.restore()
        if training and self.compile_budget is not None and name in self.decision.compile_s:  # the graph's compile
            self.decision.compile_s[name] = round(self.decision.compile_s[name] + max(first_s - second_s, 0.0), 3)

    def admit_deferred(self, sandbox: Sandbox, want: list[torch.Tensor], steps: dict[str, Callable]) -> None:
        """Build a deferred candidate (Inductor on the fastest graph of a training graph, ``build_compiles``) only
        where it can still win: not where the captured graph through Inductor, timed here (its backward compiled
        by its first step), runs within ``ESTIMATE_MARGIN`` of what the deferred graph is estimated to take through
        Inductor (``RewriteEstimate``: never below its floor, its library calls and regions alone), nor where it
        would take the graph's cold compile, this call's race included, past the ``compile_budget``. Then one Inductor
        compile, as plain Inductor's."""
        for name, (builder, estimate) in self.deferred.items():
            if "inductor-captured" in steps:
                ms = median_ms(race({"inductor-captured": steps["inductor-captured"]}, 0.0, reset=sandbox.restore))
                self.decision.timings_ms[f"before compiling {name}:inductor-captured"] = ms["inductor-captured"]
                if not estimate.can_win(ms["inductor-captured"]):
                    self.decision.rejected[name] = estimate.why_not(name, ms["inductor-captured"])
                    continue
            self.candidates.update(build_within(self.compile_budget, {name: builder}, self.decision))
            if name in self.candidates:
                self.admit(name, sandbox, want, steps)
        self.deferred = {}

    def choose(self, sandbox: Sandbox, want: list[torch.Tensor]) -> Callable:
        decision = self.decision
        if self.compile_budget is not None:
            self.compile_budget.resume()  # the first call's race is part of the cold compile
        steps: dict[str, Callable] = {}
        for name in list(self.candidates):
            self.admit(name, sandbox, want, steps)
        self.admit_deferred(sandbox, want, steps)
        samples = race(steps, self.budget_s, reset=sandbox.restore)
        decision.timings_ms.update(median_ms(samples))
        safe = safe_choice(samples, self.incumbents)
        decision.choice = fastest(samples, self.incumbents, MARGIN) or safe or "eager"
        if safe is not None and not settled(samples, decision.choice, safe):
            decision.rejected[decision.choice] = f"its rounds disagree by more than {MARGIN:.0%}: {safe} kept, not cached"
            decision.choice = safe
        elif decision.choice in steps:
            if self.graphs is not None:
                decision.regions = graph_regions(self.graphs[graph_of(decision.choice)]())
            store(decision)
            self.stored = True
        if decision.choice not in self.candidates:  # none correct: the captured graph
            return self.oracle or self.rec
        return self.checked(self.candidates[decision.choice])

    def checked(self, pick: Callable) -> Callable:
        """``pick``, after its check in place (``check_call``) when it is a choice other than the captured graph run
        eagerly (``eager``; None where that is no candidate: random graphs, clamped ids)."""
        if self.eager is None or self.decision.choice == "eager":
            return pick
        self.pick, self.check_s, self.check_calls, self.clocks = pick, {self.decision.choice: [], "eager": []}, 0, []
        return self.check_call

    def check_call(self, *args: Any) -> Any:
        """One of the first real calls after a choice (raced or cached): the pick and the captured graph run
        eagerly take turns on the caller's inputs (both are correct), each timed as Dynamo calls it, a training
        call with its part of the caller's backward (``BackwardClock``); once each has ``checks_needed`` times, or
        after four times as many calls (a backward that does not come), ``settle_check``."""
        self.read_clocks(finished=True)
        if self.settle_when_checked():
            return self.run(*args)
        choice, times = self.decision.choice, self.check_s
        name = choice if self.check_calls % 2 == 0 else "eager"
        self.check_calls += 1
        clock = timer()
        synchronize()
        start = clock()
        out = (self.pick if name == choice else self.eager)(*args)
        synchronize()
        forward_s = clock() - start
        if self.decision.mode != "training" or not self.time_backward(name, out, args, forward_s):
            times[name].append(forward_s)
        self.settle_when_checked()
        return out

    def checks_needed(self) -> int:
        medians = [statistics.median(times) for times in self.check_s.values() if times]
        return SHORT_CHECK_CALLS if medians and max(medians) < SHORT_CALL_S else CHECK_CALLS

    def settle_when_checked(self) -> bool:
        if not self.check_s:
            return False
        needed = self.checks_needed()
        if min(map(len, self.check_s.values())) >= needed or self.check_calls >= 4 * needed:
            self.run = self.settle_check()
            return True
        return False

    def time_backward(self, name: str, out: Any, args: Sequence[Any], forward_s: float) -> bool:
        """Start a ``BackwardClock`` on the call, read once its backward has reached every input needing a gradient
        or, at the next call, as far as the caller's backward went. False when the call has no backward."""
        outs = [o for o in _outputs(out) if o.requires_grad]
        ins = list({id(a): a for a in _tensors(args) if a.requires_grad}.values())
        if not outs or not ins:
            return False
        self.clocks.append(BackwardClock(name, forward_s, outs, ins, self.clock_done))
        return True

    def clock_done(self, clock: "BackwardClock") -> None:
        if clock in self.clocks:
            self.clocks.remove(clock)
            self.add_clock(clock)
            self.settle_when_checked()

    def add_clock(self, clock: "BackwardClock") -> None:
        seconds = clock.stop()
        if seconds is not None and clock.name in self.check_s:
            self.check_s[clock.name].append(seconds)

    def read_clocks(self, finished: bool) -> None:
        """Add the clocks whose backward began (``finished``: the caller's backward is over, a new call has come);
        all of them, and stop the rest, when not ``finished``."""
        keep = []
        for clock in self.clocks:
            if clock.began is None and finished:
                keep.append(clock)  # its backward has not come yet (a graph called twice before one backward)
            else:
                self.add_clock(clock)
        self.clocks = keep

    def settle_check(self) -> Callable:
        """The pick, unless the captured graph ran faster in place by more than ``MARGIN`` (round by round): then
        the captured graph, and the decision says why; a cached decision is dropped (raced again at the next
        compile), a fresh one stored as ``eager``."""
        decision, choice = self.decision, self.decision.choice
        self.read_clocks(finished=False)
        samples, self.check_s = self.check_s, {}
        decision.timings_ms.update({f"in place:{name}": ms for name, ms in median_ms(samples).items()})
        if not all(samples.values()) or fastest(samples, (choice,), MARGIN) == choice:
            return self.pick
        ms = median_ms(samples)
        decision.rejected[choice] = f"slower in place than eager: {ms[choice]} ms against {ms['eager']} ms a call"
        decision.choice, decision.regions = "eager", {}
        if decision.cached:
            forget(decision.key)
        elif self.stored:
            store(decision)
        return self.eager

    def rerun_for_error(self, args: Sequence[Any]) -> Any:
        """After the chosen candidate raised: run the call through the rec ops, whose errors name the table,
        feature or op at fault (the captured graph's ATen errors do not); re-raise when that is what failed."""
        if self.racing or self.rec is None or self.run is self.rec or self.run == self.first_call:
            raise
        return self.rec(*args)


def safe_choice(samples: dict[str, list[float]], incumbents: Sequence[str]) -> str | None:
    """What an unsettled race keeps: the first incumbent present (else the first of ``SAFE``), or another
    incumbent whose rounds settle it as faster (``settled``): where eager and Inductor on the captured graph are
    both raced, the faster of the two graphs that run without us (TorchRec DeepFM's forward at batch 2048 kept eager
    at 0.82x of Inductor when its rounds disagreed under load)."""
    first = next((name for name in (*incumbents, *SAFE) if name in samples), None)
    faster = fastest({name: samples[name] for name in incumbents if name in samples})
    return faster if faster is not None and settled(samples, faster, first) else first


def settled(samples: dict[str, list[float]], choice: str, safe: str) -> bool:
    """Whether the rounds agree that ``choice`` beats ``safe``: no more than a quarter of them has it slower by
    more than ``MARGIN`` (a machine whose load changes mid-race moves the rounds apart)."""
    if choice == safe or choice not in samples:
        return True
    ratios = [t / max(r, 1e-12) for t, r in zip(samples[choice], samples[safe])]
    return sum(r > 1 + MARGIN for r in ratios) <= len(ratios) / 4


def size_slots(gm: fx.GraphModule) -> list[tuple[int, int | None]]:
    """Where a call carries each of the graph's symbolic sizes: (input, dim) of a tensor input, or (input, None)
    for a size Dynamo passes as an int; one place per symbol. Empty for a graph with static sizes."""
    slots, seen = [], set()
    for i, value in enumerate(input_metas(gm)):
        if isinstance(value, torch.SymInt):
            sizes = [(None, value)]
        else:
            sizes = list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else []
        for dim, size in sizes:
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr not in seen:
                seen.add(expr)
                slots.append((i, dim))
    return slots


def size_bucket(slots: Sequence[tuple[int, int | None]], args: Sequence[Any]) -> int:
    """The call's size bucket: the power of two of the product of its symbolic sizes (the work it carries, to a
    factor of two: batch 128 and 200 share one, 2048 has its own)."""
    n = 1
    for i, dim in slots:
        n *= args[i] if dim is None else args[i].shape[dim]
    return int(n).bit_length()


class Buckets:
    """The GraphChooser of each size bucket of a graph with symbolic sizes (Dynamo compiles a stream of batches
    once with a dynamic batch): every bucket races the candidates compiled for the graph on its own first call
    (``make``), so that a choice taken on small batches is not applied to large ones, and dispatches to its
    choice afterwards. Past ``MAX_BUCKETS`` a bucket takes the nearest decided bucket's choice."""

    def __init__(self, slots: Sequence[tuple[int, int | None]], first: int, chooser: GraphChooser,
                 make: Callable[[int], GraphChooser]):
        self.slots, self.make, self.first, self.choosers = tuple(slots), make, chooser, {first: chooser}

    def __call__(self, args: Sequence[Any]) -> GraphChooser:
        bucket = size_bucket(self.slots, args)
        chooser = self.choosers.get(bucket)
        if chooser is None:
            if len(self.choosers) < MAX_BUCKETS:
                chooser = self.make(bucket)
                chooser.entry = self.first.entry  # raced through what Dynamo calls, as the first bucket
            else:
                chooser = self.choosers[min(self.choosers, key=lambda b: abs(b - bucket))]
            self.choosers[bucket] = chooser
        return chooser


class CompiledGraph:
    """What Dynamo calls for a raced graph, and what the race calls each candidate through (``as_installed``): the
    dropout seeds drawn from the caller's stream (``draws``), then the chooser's current ``run`` (the candidate once
    chosen; its check in place first), and the rec ops on error; with ``buckets`` (a graph with symbolic sizes),
    the chooser of the call's size bucket."""

    def __init__(self, chooser: GraphChooser, buckets: Buckets | None = None):
        self.chooser, self.buckets, self.draws = chooser, buckets, chooser.draws
        chooser.entry = self

    def __call__(self, *args: Any) -> Any:
        if self.draws:
            args = (*args, *draw_seeds(self.draws))
        chooser = self.chooser if self.buckets is None else self.buckets(args)
        try:
            return chooser.run(*args)
        except Exception:
            return chooser.rerun_for_error(args)


def without_pass(original: fx.GraphModule, ctx, name: str, regions: dict[str, str]) -> fx.GraphModule:
    """The captured graph rewritten by every pass but ``name``, with the kernels chosen for its regions: the passes
    after ``name`` run on the graph ``name`` started from (``ctx``'s stage before it: the passes before it ran
    alike), not the whole pipeline again."""
    options = replace(ctx.options, passes={**ctx.options.passes, name: False}, verify=False, dump_dir=None)
    names = [stage.name for stage in ctx.stages]
    start, after = (ctx.stages[names.index(name) - 1].gm, name) if name in names else (original, None)
    gm = run_pipeline(start, PassContext(options, ctx.target, ctx.example_inputs, graph_id=ctx.graph_id), after)
    apply_regions(gm, regions)
    return gm


def candidate_graphs(original: fx.GraphModule, rewritten: fx.GraphModule, ctx, regions: dict[str, str] | None,
                     captured: bool = True) -> dict[str, Callable[[], fx.GraphModule]]:
    """The graphs the whole-graph candidates run, unbuilt, by the name of their eager candidate: ``rec+eager``
    (the rewrite), ``eager`` (the captured graph) and, given the kernels chosen for the regions, ``rec+eager-<pass>``
    for each pass that replaced regions when several did, so that one pass's gain is kept when another's regions
    measure slower than what they replaced. Without rec regions the rewrite is the captured graph (normalized).
    With lookups whose bounds_check clamps or skips ids the captured graph would raise on, no graph keeps the
    captured lookups. Not ``captured``: the captured graph draws other random numbers than the rewrite (its
    dropout draws eager's masks), so it is no candidate."""
    graphs = {"rec+eager": lambda: rewritten, "eager": lambda: original}
    if not captured:
        del graphs["eager"]
    ops = {_op_name(node) for node in rewritten.graph.nodes} - {None}
    if not ops:
        del graphs["rec+eager"]
    clamped = ops & BOUNDS_CHECKED and ctx.options.bounds_check != "fatal"
    if clamped:
        del graphs["eager"]
    passes = list(dict.fromkeys(region.pass_name for region in ctx.regions))
    if regions is not None and len(passes) > 1:
        keeps_lookups = {r.pass_name for r in ctx.regions if r.op in BOUNDS_CHECKED} if clamped else set()
        graphs.update({f"rec+eager-{name}": functools.cache(functools.partial(without_pass, original, ctx, name, regions))
                       for name in passes if name not in keeps_lookups})
    return graphs


def inductor_of(name: str) -> str:
    """The Inductor candidate compiling the graph of eager candidate ``name``: ``inductor`` (the rewrite),
    ``inductor-captured`` (the captured graph: the Inductor a user would otherwise get), ``inductor-<pass>``."""
    return "inductor-captured" if name == "eager" else name.replace("rec+eager", "inductor")


def graph_of(candidate: str) -> str:
    """The eager candidate whose graph ``candidate`` runs (the inverse of ``inductor_of``)."""
    if candidate == "inductor-captured":
        return "eager"
    return candidate.replace("inductor", "rec+eager", 1) if candidate.startswith("inductor") else candidate


def graph_regions(gm: fx.GraphModule) -> dict[str, str]:
    """The rec op nodes of ``gm`` and the kernel each runs (its ``impl`` argument)."""
    return {node.name: node.args[-1] for node in gm.graph.nodes if _op_name(node) is not None}


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` calling each rec op's Python function (argument checks, then the kernel) instead of the op (a copy
    when it has rec ops): run eagerly without autograd, the op adds only its dispatch, about 10 us a call plus
    a few percent on the MKL GEMMs run inside a dispatched Python kernel (measured on this CPU)."""
    functions = {node: OPDEFS[node.target._schema.name]._init_fn for node in gm.graph.nodes
                 if _op_name(node) is not None and node.target._schema.name in OPDEFS}
    if not functions:
        return gm
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if node in functions:
            env[node].target = functions[node]
    return fx.GraphModule(gm, graph)


def eager_forward(gm: fx.GraphModule, training: bool) -> Callable:
    """``gm`` run eagerly: through the rec ops when training (their autograd), else calling their functions."""
    return gm.forward if training else direct_calls(gm).forward


def graph_builders(graphs: dict[str, Callable[[], fx.GraphModule]], compile_inductor: Callable[[fx.GraphModule], Callable],
                   training: bool) -> dict[str, Callable[[], Callable]]:
    """Every whole-graph candidate, unbuilt: each graph run eagerly and through Inductor (compiled when built).

    An Inductor candidate is its compile without the ``torch._dynamo.disable`` wrapper AOT autograd returns it in
    (``inductor_call``)."""
    builders = {}
    for name, graph in graphs.items():
        builders[name] = lambda graph=graph: eager_forward(graph(), training)
        builders[inductor_of(name)] = lambda graph=graph: inductor_call(compile_inductor(graph()))
    return builders


def inductor_call(compiled: Callable) -> Callable:
    """Inductor's compile without the ``torch._dynamo.disable`` wrapper AOT autograd returns it in: rec_ascend's
    compiled graph is called inside Dynamo's own (around what a backend returns: ``CompiledGraph``,
    ``drawing_seeds``' call), which covers the whole call, so a call passes one such wrapper, as plain Inductor's
    does (Dynamo unwraps AOT's before wrapping); each costs 0.3-0.4 us a call (measured under load). The race calls
    a candidate inside ``GraphChooser.first_call``, itself disabled, or inside the compile, where Dynamo does not
    trace either."""
    return innermost_fn(compiled)


def fastest_eagerly(graphs: dict[str, Callable[[], fx.GraphModule]], sandbox: Sandbox, training: bool,
                    decision: Decision, budget_s: float) -> str:
    """The graph that runs fastest eagerly (timed only); a graph that fails here is left out (it fails again in
    the race, which keeps its error)."""
    steps, args = {}, sandbox.args
    for name, graph in graphs.items():
        fn = eager_forward(graph(), training)
        try:
            run_step(fn, args, training)
        except Exception:
            continue
        finally:
            sandbox.restore()
        steps[name] = functools.partial(run_step, fn, args, training)
    samples = race(steps, budget_s, reset=sandbox.restore)
    decision.timings_ms.update({f"eagerly:{name}": ms for name, ms in median_ms(samples).items()})
    return fastest(samples, INCUMBENTS, MARGIN) or next(iter(graphs))


def choose_compiles(graphs: dict[str, Callable[[], fx.GraphModule]], builders: dict, sandbox: Sandbox,
                    decision: Decision, training: bool, budget_s: float,
                    static: bool = False) -> tuple[str, RewriteEstimate | None]:
    """Leave in ``builders`` only the Inductor candidates that can win: Inductor compiles what the graphs share
    alike, so it compiles the graph that ran fastest eagerly (its regions are the fastest), and the captured graph
    (the Inductor a user would otherwise get: it can win where it fuses what a region does eagerly, e.g. a short
    softmax) unless its library calls alone (``inductor_floor_ms``) take longer than the fastest graph eagerly;
    inference graphs skip the fastest one where Inductor has little to fuse around our ops (``inductor_can_win``).
    No graph holding ATen's GRU / LSTM / RNN is compiled (``unrolls``): it runs eagerly. A graph that keeps both, with
    static sizes (``static``) or not training, has the floor of Inductor on the fastest graph measured
    (``rewrite_floor_ms``) and its estimate built (``RewriteEstimate``), with which ``build_compiles`` compiles one of
    them only where it can beat the other. Returns the graph that ran fastest eagerly and the estimate (None where not
    made)."""
    fastest = fastest_eagerly(graphs, sandbox, training, decision, budget_s) if len(graphs) > 1 else next(iter(graphs))
    why = f"{fastest} ran fastest eagerly"
    if unrolls(graphs[fastest]()) and (compilable := compilable_fastest(graphs, decision)) is not None:
        fastest, why = compilable, f"{compilable} ran fastest eagerly of the graphs Inductor compiles without unrolling"
    keep = {inductor_of(fastest)}
    floor_ms = 0.0
    if "eager" in graphs:
        best_ms = decision.timings_ms.get(f"eagerly:{fastest}")
        floor_ms = inductor_floor_ms(graphs["eager"](), sandbox, training) if fastest != "eager" and best_ms else 0.0
        if floor_ms:
            decision.timings_ms[FLOOR] = round(floor_ms, 4)
        if best_ms and floor_ms > best_ms * (1 + MARGIN):
            decision.rejected["inductor-captured"] = (f"not compiled: its library calls alone take {floor_ms:.3f} ms, "
                                                      f"{fastest} eagerly {best_ms:.3f} ms")
        else:
            keep.add("inductor-captured")
    if not training and fastest != "eager":
        if not inductor_can_win(graphs[fastest](), sandbox):
            keep.discard(inductor_of(fastest))
            decision.rejected[inductor_of(fastest)] = (f"not compiled: the nodes it could fuse take under "
                                                       f"{MIN_FUSABLE_SHARE:.0%} of a call")
    for name in {inductor_of(name) for name, graph in graphs.items() if unrolls(graph())} & keep:
        keep.discard(name)
        decision.rejected[name] = "not compiled: Inductor would unroll its recurrent call step by step"
    estimate = None
    if fastest != "eager" and {"inductor-captured", inductor_of(fastest)} <= keep and (static or not training):
        graph = graphs[fastest]()
        timings = decision.timings_ms
        estimate = RewriteEstimate(rewrite_floor_ms(graph, sandbox, decision, training), kernels_ms(graph, decision),
                                   timings.get(f"eagerly:{fastest}"), timings.get("eagerly:eager"), floor_ms)
        decision.timings_ms[f"floor:{inductor_of(fastest)}"] = round(estimate.floor_ms, 4)
    for name in {inductor_of(name) for name in graphs} - keep:
        del builders[name]
        decision.rejected.setdefault(name, f"not compiled: {why}")
    return fastest, estimate


RECURRENT = (torch.gru, torch.lstm, torch.rnn_tanh, torch.rnn_relu)


def compilable_fastest(graphs: dict[str, Callable[[], fx.GraphModule]], decision: Decision) -> str | None:
    """The graph that ran fastest eagerly (``eagerly:`` timings) among those Inductor compiles without unrolling a
    recurrent call, None where none: the captured graph holding ATen's GRU that ties the rewrite eagerly (RecBole
    GRU4Rec's loss at batch 2048) must not leave the rewrite, which plain Inductor's breaks let it beat, uncompiled."""
    timed = [name for name in graphs if f"eagerly:{name}" in decision.timings_ms and not unrolls(graphs[name]())]
    return min(timed, key=lambda name: decision.timings_ms[f"eagerly:{name}"], default=None)


def unrolls(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls ATen's GRU, LSTM or RNN (traced under rec_ascend's ``allow_rnn``), which AOT autograd
    decomposes into ops per step: Inductor's compile of it takes several times a plain compile's, where plain
    Inductor breaks the graph there and runs it eagerly (``docs/recurrent.md``)."""
    return any(node.op == "call_function" and node.target in RECURRENT for node in gm.graph.nodes)


def build_compiles(builders: dict[str, Callable[[], Callable]], fastest: str, estimate: RewriteEstimate | None,
                   sandbox: Sandbox, decision: Decision, training: bool, budget_s: float, static: bool = True,
                   compile_budget: CompileBudget | None = None
                   ) -> tuple[dict[str, Callable], dict[str, tuple[Callable, RewriteEstimate]]]:
    """The candidates, built, each Inductor graph only where it can win. Where both Inductor graphs are kept, one
    is compiled first and the other only where the first's time leaves it a chance:

    - Inductor on the captured graph first (plain Inductor's compile), where the graph has ``static`` sizes and an
      ``estimate`` and, for an inference graph, the order below could not skip it (the fastest graph's floor is
      above the captured graph's library calls alone). The fastest graph's Inductor is then compiled only where
      its ``RewriteEstimate`` beats the captured graph's time by ``ESTIMATE_MARGIN``: an inference graph's is timed
      here (``inductor_ms``); a training graph is not timed inside Dynamo's compile (its backward would compile
      there), so its fastest graph's compile is deferred to the first call (``GraphChooser.admit_deferred``).
    - Else Inductor on the fastest graph first; an inference graph's is timed (``inductor_ms``) and the captured
      graph not compiled where that time is within ``MARGIN`` of the least it can take (``captured_cannot_win``: its
      library calls alone, and given the ``estimate`` that time with the regions' kernels swapped back for the
      library calls they replaced). A graph with symbolic sizes takes this order: its buckets race what is built.
      (Inductor on the rewrite running ahead of the rewrite eagerly says nothing of plain Inductor: on RecBole's SASRec
      under no_grad it fuses the short softmax the rewrite replaced, 0.66 vs 0.94 ms.)

    The fastest graph's compile, second in the first order, also needs to fit the ``compile_budget``
    (``CompileBudget.why_not``); the captured graph's, second in the other, does not: it is plain Inductor's graph,
    without which rec_ascend could run slower than plain Inductor (RecBole PNN's predict at batch 2048 kept the
    rewrite through Inductor at 0.60x of plain Inductor's when the budget held the captured graph back).

    Returns the candidates built and those deferred (name -> builder, estimate)."""
    first = inductor_of(fastest)
    both = first != "inductor-captured" and first in builders and "inductor-captured" in builders
    captured_floor_ms = decision.timings_ms.get(FLOOR, 0.0)
    if both and static and estimate is not None and (training or estimate.floor_ms > captured_floor_ms * (1 + MARGIN)):
        rewrite = builders.pop(first)
        built = build(builders, decision)
        if training:
            return built, {first: (rewrite, estimate)}
        captured_ms = None
        if "inductor-captured" in built:
            captured_ms = inductor_ms(built["inductor-captured"], built["eager"], sandbox, decision, budget_s,
                                      "inductor-captured", first)
        if captured_ms is not None and not estimate.can_win(captured_ms):
            decision.rejected[first] = estimate.why_not(first, captured_ms)
            return built, {}
        return {**built, **build_within(compile_budget, {first: rewrite}, decision)}, {}
    captured = builders.pop("inductor-captured") if both and not training else None
    built = build(builders, decision)
    if captured is None:
        return built, {}
    if first not in built:  # Inductor failed on it (named in the decision): the captured graph may still compile
        return {**built, **build({"inductor-captured": captured}, decision)}, {}
    first_ms = inductor_ms(built[first], built[fastest], sandbox, decision, budget_s, first)
    why = None if first_ms is None else captured_cannot_win(first, first_ms, estimate, decision.timings_ms.get(FLOOR))
    if why is not None:
        decision.rejected["inductor-captured"] = why
        return built, {}
    return {**built, **build({"inductor-captured": captured}, decision)}, {}


def captured_cannot_win(name: str, ms: float, estimate: RewriteEstimate | None, floor_ms: float | None) -> str | None:
    """Why Inductor on the captured graph cannot beat ``name`` (Inductor on the graph fastest eagerly, which ran ``ms``)
    by ``MARGIN``, or None where it can: not where ``ms`` is within the margin of the least the captured graph takes,
    its library calls alone (``inductor_floor_ms``) or, given the estimate (an inference graph's), ``ms`` with the
    regions' kernels swapped back for the library calls they replaced (``RewriteEstimate.captured_least_ms``)."""
    floor_ms = floor_ms or 0.0
    least = estimate.captured_least_ms(ms) if estimate is not None else 0.0
    if ms > max(least, floor_ms) * (1 + MARGIN):
        return None
    if least > floor_ms:
        return (f"not compiled: {name} ran {ms:.3f} ms, inductor-captured would take at least {least:.3f} ms (its "
                f"library calls alone {floor_ms:.3f} ms)")
    return f"not compiled: {name} ran {ms:.3f} ms, its library calls alone take {floor_ms:.3f} ms"


def inductor_ms(compiled: Callable, eager: Callable, sandbox: Sandbox, decision: Decision, budget_s: float,
                name: str = "inductor", before: str = "inductor-captured") -> float | None:
    """The median ms of ``compiled`` (an inference graph through Inductor, candidate ``name``) raced round by round
    against ``eager`` (its graph run eagerly, candidate ``graph_of(name)``) on the sandbox's inputs after a first
    untimed call of each, recorded under both names as timed before compiling candidate ``before``; None where it
    fails or does not give ``eager``'s results."""
    steps = {graph_of(name): functools.partial(run_step, eager, sandbox.args, False),
             name: functools.partial(run_step, compiled, sandbox.args, False)}
    try:
        results = []
        for step in steps.values():
            results.append(step())
            sandbox.restore()
    except Exception:  # the race rejects it, with its error
        return None
    if matches(results[1], results[0]) is not None:
        return None
    ms = median_ms(race(steps, budget_s, reset=sandbox.restore))
    decision.timings_ms.update({f"before compiling {before}:{step}": t for step, t in ms.items()})
    return ms[name]


def build(builders: dict[str, Callable[[], Callable]], decision: Decision) -> dict[str, Callable]:
    """The candidates, built; seconds spent compiling each go into the decision. A candidate that fails to compile
    (Inductor raises on some graphs that run eagerly) is left out of the race, its error in ``decision.rejected``:
    the eager candidates, which always build, remain."""
    built = {}
    for name, builder in builders.items():
        start = time.perf_counter()
        try:
            built[name] = builder()
        except RestartAnalysis:  # Dynamo's signal to trace the frame again (a float specialized), not a failure
            raise
        except Exception as exc:  # noqa: BLE001  (whatever the compiler raises, eager still runs the graph)
            decision.rejected[name] = f"failed to compile: {compile_error(exc)}"
        decision.compile_s[name] = round(time.perf_counter() - start, 3)
    return built


def build_within(compile_budget: CompileBudget | None, builders: dict[str, Callable[[], Callable]],
                 decision: Decision) -> dict[str, Callable]:
    """``build`` of the candidates whose compile fits the ``compile_budget``; each other's reason in the decision."""
    fits = {}
    for name, builder in builders.items():
        if compile_budget is not None and (why := compile_budget.why_not(name, decision)):
            decision.rejected[name] = why
        else:
            fits[name] = builder
    return build(fits, decision)


def compile_error(exc: Exception) -> str:
    """``exc`` in one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"


def compiled_or_eager(compile_inductor: Callable[[fx.GraphModule], Callable], gm: fx.GraphModule, ctx) -> Callable:
    """Inductor's compile of ``gm``, or, where Inductor fails on it, ``gm`` run eagerly, the failure recorded as a
    fallback (``recompile.explain`` lists it) and warned about: rec_ascend never fails where eager runs."""
    try:
        return compile_inductor(gm)
    except RestartAnalysis:  # Dynamo's signal to trace the frame again (a float specialized), not a failure
        raise
    except Exception as exc:  # noqa: BLE001
        reason = f"Inductor failed to compile graph {ctx.graph_id}, which runs eagerly: {compile_error(exc)}"
        ctx.fallbacks.append(Fallback("inductor", reason))
        warnings.warn(f"recompile: {reason}", stacklevel=2)
        return gm.forward


def autotune(original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any], ctx,
             compile_inductor: Callable[..., Callable]) -> Callable:
    """The compiled callable for ``rewritten`` (``compile_inductor(graph[, inputs])`` compiles a graph through
    Inductor): the dropout seeds lifted out (``lift_seeds``) so that every candidate draws the same masks,
    then, with ``options.autotune`` and a graph the race can run invisibly (``tunable``), the cached decision
    or a GraphChooser over the candidates; else Inductor on the rewrite. A graph with random ops other than
    the lifted seeds is not raced: its candidates would draw other numbers. A graph without rec regions races the
    captured graph eagerly against Inductor on it (one compile, ``CAPTURED_FIRST``); where it cannot be raced, it
    is Inductor's compile, returned as it is."""
    if not ctx.regions and not (ctx.options.autotune and tunable(original, example_inputs)):
        return compiled_or_eager(compile_inductor, original, ctx)  # what backend="inductor" runs
    draws = lift_seeds(rewritten)
    inputs = [*example_inputs, *seed_examples(draws)]
    compile_graph = functools.partial(compile_inductor, inputs=inputs) if draws else compile_inductor
    if (not ctx.options.autotune or not tunable(rewritten, inputs, allow_random=True)
            or any(is_random(node) for node in rewritten.graph.nodes)):
        return drawing_seeds(compiled_or_eager(compile_graph, rewritten, ctx), draws)
    return choose_graph(original, rewritten, inputs, ctx, compile_graph, draws)


def choose_graph(original: fx.GraphModule, rewritten: fx.GraphModule, inputs: Sequence[Any], ctx,
                 compile_inductor: Callable[[fx.GraphModule], Callable], draws: list[tuple[tuple, dict]]) -> Callable:
    """The cached decision (taken under these ``conditions``), or a GraphChooser over the candidates; for a graph
    with symbolic sizes, one per size bucket (``Buckets``), the first for the bucket of the compile's inputs.

    ``draws``: the rewrite's lifted dropout seeds (``lift_seeds``), drawn at each call by the compiled graph. With
    them, the rewrite draws dropout masks that the captured graph does not: the candidates are the rewrite's alone
    (eagerly and through Inductor, which is then the incumbent), with no ablations."""
    training, random = is_training(rewritten), bool(draws)
    key = graph_key(rewritten, ctx.target.name, training)
    slots = size_slots(rewritten)
    first = size_bucket(slots, concrete_inputs(inputs)) if slots else None
    cached = load(bucket_key(key, first))
    graphs = candidate_graphs(original, rewritten, ctx, None if random else (cached.kernels if cached else {}),
                              captured=not random)
    builders = graph_builders(graphs, compile_inductor, training)
    oracle = eager_forward(rewritten, training) if random else original.forward
    incumbents = ("inductor",) if random else INCUMBENTS if ctx.regions else CAPTURED_FIRST
    eager = original.forward if "eager" in graphs else None  # checks a choice in place
    if cached is not None and cached.choice in builders:
        apply_regions(rewritten, cached.kernels)
        ctx.tuning = cached.to_dict()
        # The choices of the graph's other buckets decided earlier, and the candidates built without a compile.
        names = {cached.choice}
        if slots:
            names |= {d.choice for d in cached_buckets(key).values()} | {"rec+eager", "eager"}
        built = {name: builders[name]() for name in builders if name in names}
        chooser = GraphChooser(built, oracle, cached, 0.0, chosen=built[cached.choice], eager=eager,
                               rec=rewritten.forward if "rec+eager" in graphs else None, draws=draws)
        budget = BUDGET_S / 2
    else:
        decision = Decision("eager", mode="training" if training else "inference", key=bucket_key(key, first),
                            conditions=conditions())
        clock = timer()  # the budgets, on the race's clock
        start = clock()
        with Sandbox(concrete_inputs(inputs)) as sandbox:
            if ctx.regions:
                tune_regions(rewritten, sandbox, ctx.target, training, decision, clock, start + BUDGET_S / 2)
            if not random:
                graphs = candidate_graphs(original, rewritten, ctx, decision.kernels)
                builders = graph_builders(graphs, compile_inductor, training)
            fastest_graph, estimate = choose_compiles(graphs, builders, sandbox, decision, training, BUDGET_S / 8,
                                                      static=not slots)
            budget = max(BUDGET_S - (clock() - start), BUDGET_S / 4)
            compile_budget = CompileBudget(ctx.options.compile_budget, graphs, ctx.started, traced_s=ctx.traced_s)
            built, deferred = build_compiles(builders, fastest_graph, estimate, sandbox, decision, training,
                                              BUDGET_S / 8, static=not slots, compile_budget=compile_budget)
        compile_budget.pause()  # until the first call's race
        ctx.tuning = decision.to_dict()
        cached = decision
        chooser = GraphChooser(built, oracle, decision, budget, graphs=graphs, incumbents=incumbents, eager=eager,
                               draws=draws, deferred=deferred, compile_budget=compile_budget)
    if not slots:
        return CompiledGraph(chooser)

    def make(bucket: int) -> GraphChooser:
        """The chooser of a size bucket first called now: its cached decision if what it chose is built, else a
        race of the built candidates on this call."""
        decision = load(bucket_key(key, bucket))
        if decision is not None and decision.choice in built:
            return GraphChooser(built, oracle, decision, 0.0, chosen=built[decision.choice], eager=eager,
                                rec=chooser.rec, draws=draws)
        decision = Decision("eager", mode=cached.mode, key=bucket_key(key, bucket), conditions=conditions(),
                            kernels=dict(cached.kernels), compile_s=dict(cached.compile_s),
                            rejected={k: v for k, v in cached.rejected.items() if v.startswith("not compiled")})
        return GraphChooser(built, oracle, decision, budget, graphs=graphs, incumbents=incumbents, eager=eager,
                            rec=chooser.rec, draws=draws)

    return CompiledGraph(chooser, Buckets(slots, first, chooser, make))
