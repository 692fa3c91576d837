"""``recompile inspect`` and ``recompile dump``: what the pipeline does to a model, as text, JSON, HTML and dumps."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os

import torch

from recompile.cli import UsageError
from recompile.dump import write_file
from recompile.explain import explain
from recompile.html_report import render_html
from recompile.loader import load_target
from recompile.lowering.targets import TARGETS
from recompile.profile import profile_regions
from recompile.report import Report

TARGET_HELP = (
    "path/to/file.py:factory, package.module:factory (factory() returns (model, example_inputs)), "
    "a model name of the zoo, or a TensorFlow .pb"
)


def _explain(args: argparse.Namespace, dump_dir: str | None) -> tuple[str, Report]:
    loaded = load_target(args.model)
    options = {"target": args.target, "dump_dir": dump_dir}
    try:
        with _quiet_torch_logs():
            return loaded.name, explain(loaded.model, *loaded.example_inputs, options=options)
    except Exception as exc:
        failing = _failing_module(loaded.model, loaded.example_inputs)
        if failing is None:
            raise  # the model runs eagerly: the failure is the compiler's, its traceback is the report
        where, error = failing
        raise UsageError(f"{loaded.name}: the model's forward fails in {where}: {error}") from exc


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch's own error logs while tracing a failing forward (the report and the error say what failed)."""
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        torch_logger.setLevel(level)


def _failing_module(model, inputs) -> tuple[str, str] | None:
    """(the innermost module whose forward raised, the error in one line) when ``model`` fails eagerly on
    ``inputs``; None when it runs. Pre-hooks push each module entered, hooks pop each one that returned."""
    if not isinstance(model, torch.nn.Module):
        return None
    entered: list[tuple[str, torch.nn.Module]] = []

    def returned(module, args, output) -> None:
        entered.pop()

    handles = []
    for qualname, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, q=qualname: entered.append((q, m))))
        handles.append(module.register_forward_hook(returned))
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as exc:
        qualname, module = entered[-1] if entered else ("", model)
        kind = type(module).__name__
        where = f"module {qualname!r} ({kind})" if qualname else f"its top module ({kind})"
        lines = str(exc).strip().splitlines()
        return where, f"{type(exc).__name__}: {lines[0] if lines else ''}"
    finally:
        for handle in handles:
            handle.remove()
    return None


def _write(path: str, text: str) -> None:
    try:
        write_file(path, text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def run_inspect(args: argparse.Namespace) -> int:
    name, report = _explain(args, args.dump_dir)
    if args.profile:
        profile_regions(report)
    print(f"model: {name}")
    print(report.to_text())
    if args.json or args.html:
        data = report.to_dict()
        if args.json:
            _write(args.json, json.dumps(data, indent=1))
        if args.html:
            _write(args.html, render_html(data, title=name))
    return 0


def run_dump(args: argparse.Namespace) -> int:
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise UsageError(f"{args.dir} exists and is not a directory")
    name, report = _explain(args, args.dir)
    _write(os.path.join(args.dir, "report.json"), json.dumps(report.to_dict(), indent=1))
    stages = sum(len(g.ctx.stages) for g in report.graphs)
    print(f"{name}: {len(report.graphs)} graph(s), {stages} stage(s) written to {args.dir} as .py and .json")
    return 0


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="TARGET", help=TARGET_HELP)
    parser.add_argument(
        "--target", choices=TARGETS, default="auto",
        help="device to compile for; one not present here is planned for, not executed (default: best present)",
    )


def register(subparsers) -> None:
    inspect = subparsers.add_parser(
        "inspect", help="what the pipeline does to a model: graphs, passes, regions, kernels, fallbacks"
    )
    _add_model_arguments(inspect)
    inspect.add_argument("--json", metavar="FILE", help="write the report as JSON")
    inspect.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    inspect.add_argument("--dump-dir", metavar="DIR", help="also write every stage's graph as Python and JSON")
    inspect.add_argument("--profile", action="store_true", help="time each region fused and eager on the example inputs")
    inspect.set_defaults(run=run_inspect)

    dump = subparsers.add_parser("dump", help="write every stage's graph as readable Python and JSON")
    _add_model_arguments(dump)
    dump.add_argument("dir", metavar="DIR")
    dump.set_defaults(run=run_dump)
