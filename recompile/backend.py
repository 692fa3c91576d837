"""The ``rec_ascend`` torch.compile backend: rec passes on the Dynamo graph, then Inductor."""
from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import itertools
import os
import time
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._inductor.async_compile import maybe_warm_pool
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.decomposition import select_decomp_table
from torch.fx._lazy_graph_module import _LazyGraphModule

import recompile.passes  # noqa: F401  (registers the passes)
from recompile import runtime  # noqa: F401  (defines torch.ops.recompile.*)
from recompile import autotune, tracing
from recompile.lowering import Target, detect_target
from recompile.narrow_gemm import NarrowGemm
from recompile.options import RecompileOptions
from recompile.conv_gemm import convs_as_gemms
from recompile.dot_linear import linears_as_dots
from recompile.gather_linear import gathers_after_linears
from recompile.legacy_constructors import legacy_constructors_as_tensor
from recompile.split_padding import pad_split_once
from recompile.pipeline import PassContext, run_pipeline
from recompile.repeated_layers import layer_config_patches, outline_repeated_layers
from recompile.tracing import TRACING_CONFIG, TracingCalls, forward_backend_context  # noqa: F401  (TRACING_CONFIG: re-exported)

_graph_ids = itertools.count()

# Inductor decompositions that guard on sizes (a matmul on few elements becomes pointwise): on
# batch-sized dims they make a stream of batches recompile once the batch crosses the threshold.
SIZE_GUARDING_DECOMPOSITIONS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

# Inductor's checks, on every call of a compiled graph, that its inputs have the sizes and strides it was compiled
# for: Dynamo's guards already hold them (a call with other strides recompiles) and AOT autograd gives the backward
# the tangents' layout it traced, so they only cost time: 14 checks, 6-7 us of a 60 us call of RecBole FM's predict
# at batch 1 (measured interleaved, CPU time, under load).
CALL_CONFIG = {"size_asserts": False}

# The steps on every graph rec_ascend hands to Inductor, in order: legacy tensor types called on data as
# torch.tensor, which AOT autograd's cache admits (recompile.legacy_constructors); one padding of a split's pieces
# (recompile.split_padding), one-channel convolutions as GEMMs (recompile.conv_gemm), linears of gathered rows as
# gathers of linears (recompile.gather_linear), one-column linears as dots (recompile.dot_linear); then each stack
# of identical layers calls one subgraph, compiled once (recompile.repeated_layers).
BEFORE_INDUCTOR = (legacy_constructors_as_tensor, pad_split_once, convs_as_gemms, gathers_after_linears, linears_as_dots,
                   outline_repeated_layers)

# torch.compile modes under which a graph's cold compile has no budget by default (``options_for_mode``).
MAX_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")

# The packages that define the custom ops a graph rec_ascend compiles may call (``OpDefinitions``).
OP_PACKAGES = ("recompile.runtime", "hkv", "recompile.lowering")


class OpDefinitions(CustomGraphPass):
    """Inductor's caches key a graph by its ops' names, where AOT autograd traces a custom op's fake and autograd
    formula (Python in runtime/, hkv/ and recompile.lowering; C++ autograd kernels in their native libraries): set
    beside ``NarrowGemm`` as a post-grad pass that changes nothing, its uuid, the hash of those files, keys both
    caches, so that a warm cache replays no trace of an op edited since (``OP_PACKAGES``)."""

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> bytes:
        return op_definitions_hash()


@functools.cache
def op_definitions_hash() -> bytes:
    """The hash of the files defining the custom ops: every module and native library of ``OP_PACKAGES``."""
    folders = [os.path.dirname(importlib.import_module(name).__file__) for name in OP_PACKAGES]
    files = [f for d in folders for pattern in ("**/*.py", "_C*.so") for f in glob.glob(os.path.join(d, pattern),
                                                                                     recursive=True)]
    return get_hash_for_files(tuple(sorted(files)))


class DecompositionTable(dict):
    """Inductor's decompositions without the ops named ``without`` ("aten.mm.default"), pickled as how it is made:
    Inductor's FX graph cache keys a compile by its pickled arguments, where the table's functions and ops (pybind11
    objects) do not pickle, so a plain dict made every rec_ascend compile bypass it, and the AOT autograd cache with
    it (an entry names the FX graph cache's). The AOT autograd key holds no table: ``without`` follows from the
    graph's symbolic sizes (``inductor_decompositions``), which it holds."""

    def __init__(self, without: tuple[str, ...] = ()):
        super().__init__({op: fn for op, fn in select_decomp_table().items() if str(op) not in without})
        self.without = without

    def __reduce__(self):
        return type(self), (self.without,)


@functools.cache
def inductor_decompositions(dynamic: bool = True) -> DecompositionTable:
    """Inductor's decompositions, for a graph with symbolic sizes without ``SIZE_GUARDING_DECOMPOSITIONS``. A graph
    with static sizes has no size to guard on and keeps them, as plain Inductor does: at batch 1 (always a static
    graph: Dynamo specializes sizes 0 and 1) they turn a matrix-vector product into a fused reduction (DeepFM predict
    at batch 1: 64.5 us a call without them, 57.2 us with them, measured under load)."""
    return DecompositionTable(tuple(map(str, SIZE_GUARDING_DECOMPOSITIONS)) if dynamic else ())


def resolve_target(options: RecompileOptions) -> Target:
    """The target to compile for; it must be present on this machine to run."""
    target = detect_target(options.target)
    if not target.available:
        raise RuntimeError(
            f"recompile: target {target.name!r} is not present on this machine, so a graph for it cannot run; "
            f"recompile.explain(model, *inputs, options={{'target': {target.name!r}}}) or "
            f"`recompile inspect --target {target.name}` shows the plan it would run"
        )
    return target


def rec_ascend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: RecompileOptions | Mapping[str, Any] | None = None,
    mode: str | None = None,
):
    """Run the rec pass pipeline on ``gm`` (torch-level, before autograd) and compile the result with Inductor.

    With ``options.autotune`` the result is instead the fastest correct of the rewritten and the captured graph
    (and the rewrite without one pass), run eagerly or through Inductor where that can win; either way the
    dropout seeds are drawn outside the graph, so that every candidate draws the same masks (``recompile.autotune``).
    """
    started, traced_s = time.perf_counter(), tracing.traced_s()  # the cold compile its budget counts
    opts = options_for_mode(options, mode)
    # As Inductor's own backend does: its kernel-compile workers start now, while our passes and races run.
    maybe_warm_pool()
    ctx = PassContext(opts, resolve_target(opts), example_inputs, graph_id=next(_graph_ids), started=started,
                      traced_s=traced_s)
    # Dynamo's graph module generates its code on first use; the race calls it directly (the captured graph run
    # eagerly is a candidate), so generate it now rather than route each of those calls through that check.
    _LazyGraphModule.force_recompile(gm)
    rewritten = run_pipeline(gm, ctx)
    # After AOT autograd, before Inductor's own post-grad passes: CPU matrix products with a few output columns
    # computed transposed (recompile.narrow_gemm), forward and backward; then the user's own pass, if any. Then
    # OpDefinitions, which changes nothing: its uuid keys Inductor's caches by the custom ops' definitions.
    graph_config = {"post_grad_custom_pre_pass": (NarrowGemm(torch._inductor.config.post_grad_custom_pre_pass),
                                                  OpDefinitions())}
    config_patches = {**CALL_CONFIG, **graph_config, **(torch._inductor.list_mode_options(mode) if mode else {})}

    def inductor(graph: fx.GraphModule, inputs: Sequence[Any] = example_inputs):
        decompositions = inductor_decompositions(bool(autotune.size_slots(graph)))
        for step in BEFORE_INDUCTOR:
            graph = step(graph)
        patches = {**config_patches, **layer_config_patches(graph)}
        return compile_fx(graph, inputs, config_patches=patches, decompositions=decompositions)

    return autotune.autotune(gm, rewritten, example_inputs, ctx, inductor)


def options_for_mode(options: RecompileOptions | Mapping[str, Any] | None, mode: str | None) -> RecompileOptions:
    """The options, with no compile budget under ``MAX_AUTOTUNE_MODES`` (the user asked for compile time spent on
    speed) unless the options set one: a dict naming ``compile_budget``, or a ``RecompileOptions``."""
    opts = RecompileOptions.coerce(options)
    explicit = isinstance(options, RecompileOptions) or "compile_budget" in (options or {})
    return dataclasses.replace(opts, compile_budget=None) if mode in MAX_AUTOTUNE_MODES and not explicit else opts


rec_ascend.backend_ctx_ctor = TracingCalls
forward_backend_context()

