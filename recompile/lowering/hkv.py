"""Lowering of the hkv table ops: the kernel that probes the hash table; and, for exported programs, the lookups
as ops on tables bound by name (below).

hkv (usable without recompile) keeps its probe kernels by name in ``hkv.kernels`` (``LOCATE``, ``FIND``, ``CLAIM``);
they are registered here as ``hkv::lookup``'s kernels in the one kernel table (``recompile.runtime.kernels``), each
supporting the tables on the devices where ``hkv.kernels.runs_on`` says it runs.
"""
import weakref

import torch

from hkv import kernels
from hkv.embedding import DynamicTable
from hkv.ops import get_table
from recompile.lowering.registry import Impl, bind, declare_facts, has_triton, reference, register_lowering
from recompile.runtime.kernels import register_kernel


def probes(name: str):
    """``supports`` of probe kernel ``name``: it runs on the device of the table ``table_id`` holds."""

    def supports(table_id, **_) -> bool | str:
        return kernels.supports(name, get_table(table_id).table)

    return supports


for _name in kernels.KERNEL_NAMES:
    register_kernel("hkv::lookup", _name, supports=probes(_name))(kernels.LOCATE[_name])


def cpu_kernel_runs(target) -> bool:
    return target.name == "cpu" and kernels.runs_on("cpu", target.device)


register_lowering(
    "hkv::lookup",
    Impl("triton", "triton", has_triton, "hkv.triton_kernels: probe, then (eval lookups) the row read out in the "
         "same launch, int8 / int4 rows dequantized to fp32 in the kernel"),
    Impl("cpu", "cpu_kernel", cpu_kernel_runs,
         "hkv/csrc/probe.h: one pass per key (hash, probe, claim, score, row; int8 / int4 rows dequantized to fp32 "
         "as they are copied out), threads over bucket ranges"),
    reference("hkv.table: vectorised torch probing (any device; quantized rows dequantized after the gather)"),
)
# Lookups insert missing ids and their backward applies the optimizer to the table: all change the table.
for op in ("hkv::lookup", "hkv::embedding_lookup", "hkv::update"):
    declare_facts(op, stateful=True)


# ---------------------------------------------------------------------------------------------
# Serving: tables by name in exported programs
#
# A graph names an hkv table by the process's table id (``hkv.embedding.TABLES``), which means nothing in the
# process that loads a package. ``recompile.export`` rewrites each lookup into an op on a table bound by name
# (the table's module path in the model): ``hkv::unique(ids, on_host, table_id)`` ->
# ``recompile::hkv_served_unique(ids, on_host, table)`` and ``hkv::lookup(weight, unique_ids, num_unique,
# grouping, table_id, train, impl)`` -> ``recompile::hkv_served_lookup(unique_ids, num_unique, grouping, table,
# impl)`` (inference: never inserts). The serving process binds each name to a table object (a restored
# checkpoint, or the live module) with ``serve_table`` before it runs the program.

# name -> hkv.embedding.DynamicTable; weak, as hkv's own registry: a binding does not keep a dropped table alive
SERVED_TABLES: "weakref.WeakValueDictionary[str, DynamicTable]" = weakref.WeakValueDictionary()


def serve_table(name: str, table) -> None:
    """Bind ``name`` (as an exported program calls it) to ``table``: an ``hkv.embedding.DynamicTable``, or an hkv
    embedding module (its ``runtime``)."""
    SERVED_TABLES[name] = getattr(table, "runtime", table)


def served(name: str):
    try:
        return SERVED_TABLES[name]
    except KeyError:
        raise KeyError(f"hkv table {name!r}: the program looks it up but no table is bound to that name here "
                       f"(bound: {sorted(SERVED_TABLES)}); call recompile.lowering.hkv.serve_table({name!r}, table) "
                       "or recompile.export.load(path, tables={...})") from None


def _served_unique(ids: torch.Tensor, on_host: bool, table: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """``hkv::unique`` of the table bound to ``table``."""
    return torch.ops.hkv.unique(ids, on_host, served(table).id)


def _served_lookup(unique_ids: torch.Tensor, num_unique: torch.Tensor, grouping: torch.Tensor, table: str,
                   impl: str = "reference") -> torch.Tensor:
    """``hkv::lookup`` for inference (ids not in the table get its eval initializer's rows, nothing is inserted)
    of the table bound to ``table``."""
    runtime = served(table)
    weight = unique_ids.new_empty(0, dtype=runtime.table.dtype)
    return torch.ops.hkv.lookup(weight, unique_ids, num_unique, grouping, runtime.id, False, impl)


# Their fakes are the same functions: under a fake mode the hkv ops they call run hkv's fakes.
for _name, _fn in (("hkv_served_unique", _served_unique), ("hkv_served_lookup", _served_lookup)):
    torch.library.custom_op(f"recompile::{_name}", _fn, mutates_args=()).register_fake(_fn)

# hkv op -> (its served op, the arguments it keeps before the table's name; ``impl`` follows where it has one)
SERVED_OPS = {"hkv::unique": ("hkv_served_unique", ("ids", "on_host")),
              "hkv::lookup": ("hkv_served_lookup", ("unique_ids", "num_unique", "grouping"))}


def table_names(model: torch.nn.Module) -> dict[int, str]:
    """``{table id: the path of its module in model}`` of every hkv table ``model`` holds."""
    return {module.runtime.id: path for path, module in model.named_modules()
            if isinstance(getattr(module, "runtime", None), DynamicTable)}


def name_tables(gm: torch.fx.GraphModule, names: dict[int, str]) -> list[str]:
    """Rewrite ``gm``'s hkv lookups into the served ops on tables by name (``names``: table id -> name, e.g.
    ``table_names(model)``), each table bound with ``serve_table`` (the served ops' fakes read it); returns the
    names the graph now calls."""
    used = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
                or node.target.namespace != "hkv":
            continue
        op = node.target._schema.name
        if op not in SERVED_OPS:
            raise ValueError(f"{node.name}: {op} names its hkv table by this process's id; export serves only "
                             f"{', '.join(SERVED_OPS)} by name (was the dynamic_embedding pass off?)")
        arguments = bind(op, node.args, node.kwargs)
        if arguments.get("train"):
            raise ValueError(f"{node.name}: a training lookup (it inserts ids) cannot be served: export in eval mode")
        name = names.get(arguments["table_id"])
        if name is None:
            raise ValueError(f"{node.name}: hkv table {arguments['table_id']} is not a module of the exported model")
        serve_table(name, get_table(arguments["table_id"]))
        served_op, keep = SERVED_OPS[op]
        node.target = getattr(torch.ops.recompile, served_op).default
        node.args = (*(arguments[a] for a in keep), name, *((arguments["impl"],) if "impl" in arguments else ()))
        node.kwargs = {}
        used.append(name)
    gm.recompile()
    return sorted(set(used))
