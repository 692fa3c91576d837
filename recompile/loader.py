"""Resolve a model named on the command line to ``(model, example_inputs)``.

A target is one of:
- ``path/to/file.py:factory`` or ``package.module:factory``: ``factory()`` returns ``(model, example_inputs)``;
- a model name of the zoo: ``models.zoo.MODELS[name]`` is such a factory;
- a TensorFlow GraphDef ``.pb``: imported by ``recompile.frontends.tensorflow.import_graph``, with example
  inputs made from its placeholders' example values.
Anything wrong with the target raises ``TargetError`` with a one-line message.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from recompile.cli import UsageError
from recompile.passes.utils import meta_value

# The model zoo: ``models/`` of a checkout, installed as ``recompile.models``; its MODELS maps a name to a factory.
ZOO_MODULES = ("models.zoo", "recompile.models.zoo")
TF_FRONTEND = "recompile.frontends.tensorflow"
# Size given to a placeholder dimension that is not a concrete number (a symbolic batch).
UNKNOWN_DIM = 4


class TargetError(UsageError):
    """The model target cannot be loaded: missing file or module, failing factory, wrong return value."""


@dataclass
class LoadedModel:
    name: str
    model: Callable
    example_inputs: tuple


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _module_from_file(path: str):
    if not os.path.isfile(path):
        raise TargetError(f"{path}: no such file")
    name = "recompile_target_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise TargetError(f"{path}: importing it raised {_one_line(exc)}") from exc
    return module


def _module_by_name(name: str):
    if os.getcwd() not in sys.path:  # like `python -m`: modules of the working directory resolve
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise TargetError(f"{name}: no such module ({exc.name} not found)") from exc
    except Exception as exc:
        raise TargetError(f"{name}: importing it raised {_one_line(exc)}") from exc


def _call_factory(where: str, factory: Any) -> LoadedModel:
    if not callable(factory):
        raise TargetError(f"{where} is not callable; it must be a function returning (model, example_inputs)")
    try:
        result = factory()
    except Exception as exc:
        raise TargetError(f"{where}() raised {_one_line(exc)}") from exc
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TargetError(f"{where}() returned {type(result).__name__}; expected a tuple (model, example_inputs)")
    model, inputs = result
    if not callable(model):
        raise TargetError(f"{where}() returned a model of type {type(model).__name__}, which is not callable")
    if not isinstance(inputs, (tuple, list)):
        raise TargetError(f"{where}() returned example_inputs of type {type(inputs).__name__}; expected a tuple or list")
    return LoadedModel(where, model, tuple(inputs))


def _load_factory(target: str) -> LoadedModel:
    source, _, attr = target.rpartition(":")
    module = _module_from_file(source) if source.endswith(".py") else _module_by_name(source)
    if not hasattr(module, attr):
        raise TargetError(f"{source} has no attribute {attr!r}")
    return _call_factory(target, getattr(module, attr))


def _optional_module(name: str):
    """The module ``name``, or None when it (or a package above it) does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        parts = name.split(".")
        if exc.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise  # the module exists but one of its own imports is missing
        return None


def _load_zoo(name: str) -> LoadedModel:
    zoo = next(filter(None, map(_optional_module, ZOO_MODULES)), None)
    if zoo is None:
        raise TargetError(
            f"{name!r} is not a file, a module:factory or a .pb, and there is no model zoo ({' or '.join(ZOO_MODULES)}) to look it up in"
        )
    if name not in zoo.MODELS:
        raise TargetError(f"unknown model {name!r}; the zoo has: {', '.join(sorted(zoo.MODELS))}")
    return _call_factory(f"{zoo.__name__}.MODELS[{name!r}]", zoo.MODELS[name])


def _example_tensor(value: Any, placeholder: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TargetError(f"imported graph input {placeholder!r} has no tensor example value to make an input from")
    shape = [s if isinstance(s, int) else UNKNOWN_DIM for s in value.shape]
    if value.dtype.is_floating_point:
        return torch.randn(shape, dtype=value.dtype)
    return torch.zeros(shape, dtype=value.dtype)  # zero is a valid id and index for every table


def _load_graphdef(path: str) -> LoadedModel:
    if not os.path.isfile(path):
        raise TargetError(f"{path}: no such file")
    frontend = _optional_module(TF_FRONTEND)
    if frontend is None:
        raise TargetError(f"{path}: TensorFlow graphs need the front end {TF_FRONTEND}, which is not installed here")
    try:
        gm = frontend.import_graph(path)
    except Exception as exc:
        raise TargetError(f"{path}: import failed: {_one_line(exc)}") from exc
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = tuple(_example_tensor(meta_value(n), n.name) for n in placeholders)
    return LoadedModel(path, gm, inputs)


def load_target(target: str) -> LoadedModel:
    """``(model, example_inputs)`` for a command-line target; see the module docstring for the forms."""
    if target.endswith(".pb"):
        return _load_graphdef(target)
    if ":" in target:
        return _load_factory(target)
    if os.path.exists(target):
        raise TargetError(f"{target}: name the factory too, as {target}:factory")
    return _load_zoo(target)
