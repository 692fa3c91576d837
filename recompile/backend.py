"""The ``rec_ascend`` torch.compile backend: rec passes on the Dynamo graph, then Inductor."""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._inductor.async_compile import maybe_warm_pool
from torch._inductor.compile_fx import compile_fx
from torch._dynamo.repro.after_dynamo import WrapBackendDebug
from torch._inductor.decomposition import select_decomp_table

import recompile.passes  # noqa: F401  (registers the passes)
import runtime  # noqa: F401  (defines torch.ops.recompile.*)
from recompile import autotune
from recompile.lowering import Target, detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline

_graph_ids = itertools.count()

# Inductor decompositions that guard on sizes (a matmul on few elements becomes pointwise): on
# batch-sized dims they make a stream of batches recompile once the batch crosses the threshold.
SIZE_GUARDING_DECOMPOSITIONS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@functools.cache
def inductor_decompositions() -> dict:
    table = select_decomp_table()
    return {op: fn for op, fn in table.items() if op not in SIZE_GUARDING_DECOMPOSITIONS}


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
    opts = RecompileOptions.coerce(options)
    # As Inductor's own backend does: its kernel-compile workers start now, while our passes and races run.
    maybe_warm_pool()
    ctx = PassContext(opts, resolve_target(opts), example_inputs, graph_id=next(_graph_ids))
    rewritten = run_pipeline(gm, ctx)
    config_patches = torch._inductor.list_mode_options(mode) if mode else None

    def inductor(graph: fx.GraphModule, inputs: Sequence[Any] = example_inputs):
        return compile_fx(graph, inputs, config_patches=config_patches, decompositions=inductor_decompositions())

    return autotune.autotune(gm, rewritten, example_inputs, ctx, inductor)


# The Dynamo settings rec_ascend traces under, and why (``recompile.report.BREAK_REMEDIES`` names them to
# users whose graph breaks anyway): they hold only while Dynamo traces for this backend.
TRACING_CONFIG = {
    # offsets -> (row, position): repeat_interleave, nonzero, masked_select, boolean-mask indexing
    "capture_dynamic_output_shape_ops": True,
    # a max length or a total read with .item() / int(tensor)
    "capture_scalar_outputs": True,
    # TorchRec's modules are traced, not skipped, so that their lookups reach the embedding pass
    "skip_torchrec": False,
}


def tracing_config() -> contextlib.AbstractContextManager:
    """Dynamo's config patched to ``TRACING_CONFIG`` (the ``backend_ctx_ctor`` of rec_ascend)."""
    return torch._dynamo.config.patch(TRACING_CONFIG)


rec_ascend.backend_ctx_ctor = tracing_config


def _backend_ctx_ctor(self: WrapBackendDebug):
    """The ``backend_ctx_ctor`` of the backend a ``WrapBackendDebug`` wraps, looking through the wrapper
    ``torch.compile`` puts around a backend given by name or with options (which drops the attribute)."""
    backend = self._torchdynamo_orig_backend
    if isinstance(backend, torch._TorchCompileWrapper):
        backend = backend.compiler_fn
    ctor = getattr(backend, "backend_ctx_ctor", None)
    if ctor is None:
        raise AttributeError("backend_ctx_ctor")
    return ctor


def forward_backend_context() -> None:
    """Make ``torch.compile(model, backend=...)`` honour the backend's ``backend_ctx_ctor``, as
    ``torch._dynamo.optimize(backend)`` does: Dynamo reads the attribute on the debug wrapper of
    ``torch.compile``'s own wrapper, where it is absent. Backends without the attribute are unaffected."""
    if not hasattr(WrapBackendDebug, "backend_ctx_ctor"):
        WrapBackendDebug.backend_ctx_ctor = property(_backend_ctx_ctor)


forward_backend_context()


def register_name() -> None:
    """``backend="rec_ascend"`` from a source checkout too: an installed package registers the name by its
    entry point, a checkout on ``sys.path`` when ``recompile`` is imported."""
    if "rec_ascend" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(rec_ascend, "rec_ascend")
