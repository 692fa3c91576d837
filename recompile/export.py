"""Serving: ``recompile.export`` (a ``torch.export`` program with the rec regions already replaced) and
``recompile.package`` (an AOTInductor package of it that runs without the rec passes).

``export``: Dynamo captures the model whole (``torch._dynamo.export``, torch-level graph, parameters as
attributes, the model's input and output structure kept), the rec pipeline rewrites its regions into
``torch.ops.recompile.*`` calls exactly as ``backend="rec_ascend"`` does, and ``torch.export`` turns the rewritten
module into an ``ExportedProgram`` (ATen ops plus our custom ops, through their fake implementations). Dynamic
dims (a batch, a jagged total) are declared with ``dynamic_shapes`` as ``torch.export`` takes them.

``package``: ``torch._inductor.aoti_compile_and_package`` of that program. Loading it needs none of the
passes, only the operator library: ``from recompile import runtime`` (which defines ``torch.ops.recompile.*`` and loads
fbgemm) before ``torch._inductor.aoti_load_package`` (``load`` below does both). The custom ops are Python
ops, so the process that runs the package needs Python with ``recompile.runtime`` importable.

hkv tables: a graph names a table by this process's table id; ``export`` rewrites its lookups into ops on a
table bound by name (its module path in the model, ``recompile.lowering.hkv``), and the serving process binds
each name to a table object (``load(path, tables={...})``).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from recompile.backend import resolve_target
from recompile.lowering.hkv import name_tables, table_names
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline


def rewrite(model: nn.Module, example_inputs: Sequence[Any], dynamic_shapes=None,
            options: RecompileOptions | Mapping[str, Any] | None = None):
    """``(module, ctx)``: the model captured whole by Dynamo with its rec regions replaced, and the pipeline's
    record of what it replaced (``ctx.regions``, ``ctx.fallbacks``)."""
    captured, _ = torch._dynamo.export(model, aten_graph=False, dynamic_shapes=dynamic_shapes)(*example_inputs)
    opts = RecompileOptions.coerce(options)
    ctx = PassContext(opts, resolve_target(opts), list(example_inputs))
    rewritten = run_pipeline(captured, ctx)
    # The pipeline copies graphs without the captured pytree codegen: restore the model's signature and outputs.
    rewritten.graph._codegen = copy.deepcopy(captured.graph._codegen)
    rewritten.recompile()
    return rewritten, ctx


def export(model: nn.Module, example_inputs: Sequence[Any], dynamic_shapes=None,
           options: RecompileOptions | Mapping[str, Any] | None = None) -> torch.export.ExportedProgram:
    """A ``torch.export`` program of ``model`` whose rec regions are ``torch.ops.recompile.*`` calls.

    ``dynamic_shapes`` as ``torch.export.export`` takes it (e.g. ``({0: Dim("total")}, {0: Dim("batch")})``);
    the program records what the pipeline did under ``program.graph_module.meta["recompile_regions"]``, and the
    hkv tables it looks up, by name (their module paths), under ``meta["hkv_tables"]``.
    """
    rewritten, ctx = rewrite(model, example_inputs, dynamic_shapes, options)
    tables = name_tables(rewritten, table_names(model))
    program = torch.export.export(rewritten, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
    program.graph_module.meta["recompile_regions"] = [r.to_dict() for r in ctx.regions]
    program.graph_module.meta["hkv_tables"] = tables
    return program


def package(model_or_program: nn.Module | torch.export.ExportedProgram, example_inputs: Sequence[Any], path: str,
            dynamic_shapes=None, options: RecompileOptions | Mapping[str, Any] | None = None,
            inductor_configs: Optional[dict] = None) -> str:
    """An AOTInductor package (``.pt2``) at ``path`` of a model (exported first with ``export``) or of an
    exported program; returns the path. Run it with ``load(path)``."""
    program = model_or_program
    if not isinstance(program, torch.export.ExportedProgram):
        program = export(program, example_inputs, dynamic_shapes, options)
    return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=inductor_configs)


def load(path: str, tables: Optional[Mapping[str, Any]] = None):
    """A package from ``package``, ready to call: defines the ops it calls (``import runtime``), binds each hkv
    table it looks up by name (``tables``: name -> ``hkv`` table or embedding module, e.g. restored from its
    checkpoint), then loads it."""
    from recompile import runtime  # noqa: F401  (torch.ops.recompile.*, torch.ops.fbgemm.*)

    if tables:
        from recompile.lowering.hkv import serve_table

        for name, table in tables.items():
            serve_table(name, table)
    return torch._inductor.aoti_load_package(path)
