"""``recompile import-tf``: import a TensorFlow graph and show what it became.

``register(subparsers)`` adds the subcommand to the ``recompile`` CLI's argparse subparsers.
"""
from __future__ import annotations

import argparse
import collections
from recompile.cli import UsageError
from recompile.frontends.tensorflow import TFImportError, import_graph


def _names(values: list[str] | None) -> list[str] | None:
    """``--inputs a b`` and ``--inputs a,b`` alike."""
    if values is None:
        return None
    return [name for value in values for name in value.split(",") if name]


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "import-tf", help="import a frozen TensorFlow GraphDef or SavedModel as an FX graph",
        description="Import a frozen TensorFlow GraphDef (.pb) or a SavedModel directory with its variables "
                    "folded in, and summarize (or --print) the FX graph rec_ascend compiles.",
    )
    parser.add_argument("model", help="frozen GraphDef .pb file or SavedModel directory")
    parser.add_argument("--inputs", nargs="+", help="input node names, in forward's argument order "
                                                    "(default: every Placeholder)")
    parser.add_argument("--outputs", nargs="+", help="output node names or name:index (default: the graph's sinks)")
    parser.add_argument("--print", dest="print_graph", action="store_true", help="print the imported graph's code")
    parser.set_defaults(run=import_tf)
    return parser


def import_tf(args: argparse.Namespace) -> int:
    try:
        gm = import_graph(args.model, _names(args.inputs), _names(args.outputs))
    except TFImportError as exc:
        raise UsageError(str(exc)) from None
    calls = collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"
    )
    params = sum(p.numel() for p in gm.parameters())
    buffers = sum(b.numel() for b in gm.buffers())
    print(f"inputs:  {', '.join(gm.tf_inputs)}")
    print(f"outputs: {', '.join(gm.tf_outputs)}")
    print(f"nodes: {len(gm.graph.nodes)}; parameters: {params} values; buffers: {buffers} values")
    print("calls: " + ", ".join(f"{name} x{count}" for name, count in calls.most_common()))
    if args.print_graph:
        print(gm.code)
    return 0
