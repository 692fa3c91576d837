"""TensorFlow front end: a frozen GraphDef (or SavedModel) as a ``torch.fx.GraphModule``.

``import_graph`` reads the protobuf without TensorFlow (``graph_proto``), walks the nodes the
outputs need in topological order and converts each through ``CONVERTERS`` (TF op type ->
converter). The result calls torch-level functions, the same kind of graph Dynamo captures, so
``torch.compile(gm, backend="rec_ascend")`` (``compile_tf``) runs every rec pass on it: embedding
lookups come out as ``F.embedding`` (GatherV2 on a table) and ``F.embedding_bag`` with offsets
(the SparseSegmentSum/Mean/SqrtN that ``tf.nn.embedding_lookup_sparse`` emits).

A TF tensor is held during conversion as one of
- a ``torch.Tensor``: a value known at import time (a Const, or an op folded over Consts);
- an ``fx.Node``: a tensor computed at run time;
- a ``Host``: a run-time Python int or list of ints, what TF computes as small int32 tensors from
  ``Shape`` (Keras' Tensordot and attention masks): reshape and fill take them as sizes, so batch
  sizes stay symbolic under Dynamo instead of becoming data.
Constants become buffers; a floating-point constant that was a variable before freezing (read
through a ``ReadVariableOp``, or gathered from as an embedding table) becomes a parameter.
"""
from __future__ import annotations

import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from google.protobuf.message import DecodeError

from recompile.frontends import graph_proto


class TFImportError(ValueError):
    """The GraphDef cannot be imported: malformed, a missing node, or a value the importer cannot use."""


class UnsupportedOpError(TFImportError):
    """A node's op type has no converter."""


# TF DataType enum -> torch dtype (tensorflow/core/framework/types.proto).
DTYPES = {
    1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16, 6: torch.int8,
    9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 17: torch.uint16, 19: torch.float16,
    22: torch.uint32, 23: torch.uint64,
}
# TensorProto's typed value field per dtype (when tensor_content is empty).
VALUE_FIELDS = {
    torch.float32: "float_val", torch.float64: "double_val", torch.int32: "int_val", torch.uint8: "int_val",
    torch.int16: "int_val", torch.int8: "int_val", torch.int64: "int64_val", torch.bool: "bool_val",
    torch.bfloat16: "half_val", torch.float16: "half_val", torch.uint16: "int_val",
    torch.uint32: "uint32_val", torch.uint64: "uint64_val",
}
NUMPY_DTYPES = {torch.bfloat16: np.int16, torch.float16: np.float16}
# Ops of a graph that was not frozen (variables or functions outside the graph).
NOT_FROZEN = ("VarHandleOp", "VariableV2", "ReadVariableOp", "PartitionedCall", "StatefulPartitionedCall")


@dataclass(frozen=True)
class Host:
    """A run-time Python int or list of ints (a shape or a size), computed by ``node``."""

    node: fx.Node
    dtype: torch.dtype = torch.int32


Value = Any  # torch.Tensor | fx.Node | Host
Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}


def converter(*op_types: str) -> Callable[[Converter], Converter]:
    """Register ``fn(ctx, node, *inputs) -> value | list of values`` for TF op types."""

    def wrap(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
        return fn

    return wrap


def supported_ops() -> list[str]:
    return sorted(CONVERTERS)


# --- reading the protobuf ---------------------------------------------------------------------

@dataclass
class Signature:
    """A SavedModel signature's inputs (node names) and outputs (tensor refs), ordered by their keys."""

    inputs: list[str]
    outputs: list[str]


def load_graph_def(source) -> tuple[Any, Signature | None]:
    """The GraphDef of a ``.pb`` path, a SavedModel directory, serialized bytes or a GraphDef message,
    and the SavedModel's serving signature (None for a bare GraphDef)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return _saved_model_graph(path)
        if not os.path.isfile(path):
            raise TFImportError(f"{path}: no such GraphDef file or SavedModel directory")
        with open(path, "rb") as f:
            return _parse(graph_proto.GraphDef, f.read(), path), None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(graph_proto.GraphDef, bytes(source), "bytes"), None
    if hasattr(source, "SerializeToString") and hasattr(source, "node"):
        return _parse(graph_proto.GraphDef, source.SerializeToString(), type(source).__name__), None
    raise TFImportError(
        f"cannot import a {type(source).__name__}: pass a frozen GraphDef (.pb path, bytes or message) "
        "or a SavedModel directory"
    )


def _parse(message_class, data: bytes, what: str):
    message = message_class()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise TFImportError(f"{what}: not a valid {message_class.DESCRIPTOR.name} protobuf ({exc})") from None
    nodes = message.node if message_class is graph_proto.GraphDef else message.meta_graphs
    if not nodes or any(not n.name or not n.op for n in getattr(message, "node", [])):
        raise TFImportError(f"{what}: not a {message_class.DESCRIPTOR.name} (no nodes, or nodes without name/op)")
    return message


def _saved_model_graph(path: str):
    pb = os.path.join(path, "saved_model.pb")
    if not os.path.isfile(pb):
        raise TFImportError(f"{path}: a SavedModel directory must contain saved_model.pb")
    with open(pb, "rb") as f:
        saved = _parse(graph_proto.SavedModel, f.read(), pb)
    meta = ([m for m in saved.meta_graphs if "serve" in m.meta_info_def.tags] or list(saved.meta_graphs))[0]
    graph = meta.graph_def
    kept = sorted({n.op for n in graph.node if n.op in NOT_FROZEN})
    if kept:
        raise TFImportError(
            f"{path}: the SavedModel keeps its variables or functions outside the graph ({', '.join(kept)}); "
            "fold them in first (tf.python.framework.convert_to_constants.convert_variables_to_constants_v2) "
            "and save the frozen graph"
        )
    return graph, _serving_signature(meta)


def _serving_signature(meta) -> Signature | None:
    signatures = meta.signature_def
    key = "serving_default" if "serving_default" in signatures else next(iter(signatures), None)
    if key is None or len(signatures) > 1 and key != "serving_default":
        return None
    signature = signatures[key]
    return Signature([split_ref(signature.inputs[k].name)[0] for k in sorted(signature.inputs)],
                     [signature.outputs[k].name for k in sorted(signature.outputs)])


def tensor_from_proto(proto) -> torch.Tensor:
    dtype = DTYPES.get(proto.dtype)
    if dtype is None:
        raise TFImportError(f"constant of TF dtype enum {proto.dtype} is not supported")
    shape = [d.size for d in proto.tensor_shape.dim]
    numel = math.prod(shape)
    np_dtype = NUMPY_DTYPES.get(dtype, torch.empty((), dtype=dtype).numpy().dtype)
    if proto.tensor_content:
        array = np.frombuffer(proto.tensor_content, dtype=np_dtype).copy()
    else:
        values = np.array(getattr(proto, VALUE_FIELDS[dtype]))
        if dtype in NUMPY_DTYPES:  # half_val holds the 16-bit patterns
            values = values.astype(np.uint16).view(np_dtype)
        array = np.zeros(numel, dtype=np_dtype)
        if len(values):  # TF repeats the last value to fill the shape
            array[: len(values)] = values[:numel]
            array[len(values):] = values[-1]
    tensor = torch.from_numpy(array.reshape(shape))
    return tensor.view(dtype) if dtype in NUMPY_DTYPES else tensor


def attr_value(value) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "list":
        lst = value.list
        for field in ("i", "f", "b", "s", "type", "shape"):
            items = list(getattr(lst, field))
            if items:
                return [_attr_scalar(field, x) for x in items]
        return []
    return _attr_scalar(kind, getattr(value, kind))


def _attr_scalar(kind: str, x) -> Any:
    if kind == "s":
        return x.decode()
    if kind == "type":
        return DTYPES.get(x, x)
    if kind == "shape":
        return [d.size for d in x.dim]
    if kind == "tensor":
        return tensor_from_proto(x)
    return x


def attr(node, name: str, default: Any = None) -> Any:
    return attr_value(node.attr[name]) if name in node.attr else default


def split_ref(ref: str) -> tuple[str, int]:
    """``"name:1"`` -> ``("name", 1)``; ``"name"`` -> ``("name", 0)``."""
    name, _, index = ref.partition(":")
    return name, int(index) if index else 0


def attr_name(tf_name: str) -> str:
    name = re.sub(r"\W", "_", tf_name)
    return name if name and not name[0].isdigit() else f"_{name}"


# --- the import -----------------------------------------------------------------------------

class GraphImporter:
    """Converts one GraphDef: holds the FX graph, the TF value of every converted output, the constants."""

    def __init__(self, graph_def, inputs: Sequence[str] | None, outputs: Sequence[str] | None):
        self.nodes = {n.name: n for n in graph_def.node}
        self.consumers: dict[str, list] = {}
        for n in graph_def.node:
            for ref in n.input:
                if not ref.startswith("^"):
                    self.consumers.setdefault(split_ref(ref)[0], []).append(n)
        self.inputs = list(inputs) if inputs is not None else [n.name for n in graph_def.node
                                                                 if n.op == "Placeholder"]
        self.outputs = list(outputs) if outputs is not None else self._sinks(graph_def)
        for name in self.inputs:
            self._check_node(name, "input")
        for ref in self.outputs:
            self._check_node(split_ref(ref)[0], "output")
        self.root = torch.nn.Module()
        self.graph = fx.Graph()
        self.values: dict[tuple[str, int], Value] = {}
        self.const_nodes: dict[int, tuple[torch.Tensor, fx.Node]] = {}
        self.const_owner: dict[int, str] = {}
        self.device_node: fx.Node | None = None
        self.current = ""

    def _sinks(self, graph_def) -> list[str]:
        return [n.name for n in graph_def.node
                if n.name not in self.consumers and n.op not in ("Placeholder", "Const", "NoOp")]

    def _check_node(self, name: str, role: str) -> None:
        if name not in self.nodes:
            placeholders = [n for n, d in self.nodes.items() if d.op == "Placeholder"]
            raise TFImportError(f"{role} {name!r} is not a node of the graph; its placeholders are {placeholders}")

    def run(self) -> fx.GraphModule:
        for name in self.inputs:
            placeholder = self.graph.placeholder(attr_name(name))
            placeholder.meta["tf_node"] = name
            self.values[(name, 0)] = placeholder
        for node in self._topological_order():
            self._convert(node)
        results = fx.node.map_aggregate([self.tensor(self.value(ref)) for ref in self.outputs], self._graph_arg)
        self.graph.output(results[0] if len(results) == 1 else tuple(results))
        self.graph.eliminate_dead_code()
        gm = fx.GraphModule(self.root, self.graph, class_name="ImportedTFGraph")
        gm.tf_inputs, gm.tf_outputs = list(self.inputs), list(self.outputs)
        return gm

    def _topological_order(self) -> list:
        """Nodes the outputs need, producers first; declared inputs cut the graph."""
        order, state = [], {name: "done" for name in self.inputs}
        stack = [(split_ref(ref)[0], False, "the outputs") for ref in reversed(self.outputs)]
        while stack:
            name, expanded, reader = stack.pop()
            if expanded:
                state[name] = "done"
                order.append(self.nodes[name])
                continue
            if state.get(name) == "done":
                continue
            if state.get(name) == "open":
                raise TFImportError(f"the graph has a cycle through node {name!r} (control flow is not supported)")
            if name not in self.nodes:
                raise TFImportError(f"node {reader!r} reads {name!r}, which is not a node of the graph")
            state[name] = "open"
            stack.append((name, True, reader))
            for ref in reversed(self.nodes[name].input):
                if not ref.startswith("^") and state.get(split_ref(ref)[0]) != "done":
                    stack.append((split_ref(ref)[0], False, name))
        return order

    def _convert(self, node) -> None:
        fn = CONVERTERS.get(node.op)
        if fn is None:
            frozen = node.op not in NOT_FROZEN
            hint = "" if frozen else " (the graph is not frozen: fold its variables into constants first)"
            raise UnsupportedOpError(
                f"TensorFlow op {node.op!r} (node {node.name!r}) is not supported{hint}; "
                f"supported ops: {', '.join(supported_ops())}"
            )
        self.current = node.name
        inputs = [self.value(ref) for ref in node.input if not ref.startswith("^")]
        try:
            result = fn(self, node, *inputs)
        except TFImportError as exc:
            if repr(node.name) in str(exc):
                raise
            raise TFImportError(f"node {node.name!r} ({node.op}): {exc}") from None
        except Exception as exc:
            raise TFImportError(f"cannot convert node {node.name!r} ({node.op}): {type(exc).__name__}: {exc}") from exc
        outputs = result if isinstance(result, list) else [result]
        for index, value in enumerate(outputs):
            if isinstance(value, torch.Tensor):
                self.const_owner.setdefault(id(value), node.name)
            self.values[(node.name, index)] = value

    def value(self, ref: str) -> Value:
        key = split_ref(ref)
        if key not in self.values:
            raise TFImportError(f"node {self.current!r} reads output {key[1]} of {key[0]!r}, which has no such output")
        return self.values[key]

    # Values as the converters need them.
    def tensor(self, value: Value) -> fx.Node | torch.Tensor:
        """A tensor: a Host becomes an int tensor; a constant stays a tensor (folded) until a node uses it."""
        if isinstance(value, Host):
            return self.call(torch.tensor, value.node, dtype=value.dtype, device=self.device())
        return value

    def device(self) -> fx.Node | None:
        """The device tensors the graph creates go to: its first input's (None: the default device)."""
        if self.device_node is None and self.inputs:
            self.device_node = self.graph.call_function(getattr, (self.values[(self.inputs[0], 0)], "device"))
        return self.device_node

    def static(self, value: Value, what: str = "this input") -> Any:
        """A Python value known at import time (an axis, a mask, an equation)."""
        if not isinstance(value, torch.Tensor):
            raise TFImportError(f"node {self.current!r}: {what} must be a constant, it is computed at run time")
        return value.tolist()

    def ints(self, value: Value) -> Any:
        """Sizes (a shape, a begin index): Python ints now, or a run-time Python value."""
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, Host):
            return value.node
        return self.call(torch.Tensor.tolist, value)

    def constant(self, tensor: torch.Tensor, trainable: bool = False) -> fx.Node:
        """The get_attr node of a constant (registered once, named after its TF node)."""
        if id(tensor) not in self.const_nodes:
            name = attr_name(self.const_owner.get(id(tensor), self.current))
            while hasattr(self.root, name):
                name += "_"
            if trainable:
                self.root.register_parameter(name, torch.nn.Parameter(tensor.clone()))
            else:
                self.root.register_buffer(name, tensor.clone())
            # Keyed by id: the tensor is kept alive with its node so that no other tensor takes its id.
            self.const_nodes[id(tensor)] = (tensor, self.graph.get_attr(name))
        return self.const_nodes[id(tensor)][1]

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args)`` now when every argument is known, else a graph node calling it (constants as buffers)."""
        if not _has_runtime(args, kwargs):
            return fn(*args, **kwargs)
        args, kwargs = fx.node.map_aggregate((args, kwargs), self._graph_arg)
        node = self.graph.create_node("call_function", fn, args, kwargs, name=attr_name(self.current))
        node.meta["tf_node"] = self.current
        return node

    def const_tensor(self, value: Value) -> torch.Tensor | None:
        """The tensor of a constant or a parameter, else None."""
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, fx.Node) and value.op == "get_attr":
            return getattr(self.root, value.target)
        return None

    def method(self, name: str, *args) -> Any:
        return self.call(getattr(torch.Tensor, name), *args)

    def _graph_arg(self, arg: Any) -> Any:
        if isinstance(arg, torch.Tensor):
            return self.constant(arg)
        if isinstance(arg, Host):
            return arg.node
        return arg

    def trainable(self, node) -> bool:
        """Was this floating-point Const a variable before freezing (see the module docstring)?"""
        readers = self.consumers.get(node.name, [])
        return any(
            (r.op == "Identity" and r.name.endswith("ReadVariableOp"))
            or (r.op in ("GatherV2", "ResourceGather") and split_ref(r.input[0])[0] == node.name)
            for r in readers
        )

    def producer(self, ref: str):
        """The NodeDef behind ``ref``, looking through Identity nodes."""
        node = self.nodes[split_ref(ref)[0]]
        while node.op == "Identity" and node.name not in self.inputs:
            ref = node.input[0]
            node = self.nodes[split_ref(ref)[0]]
        return node, split_ref(ref)[1]


def _has_runtime(args, kwargs) -> bool:
    found = []
    fx.node.map_aggregate((args, kwargs), lambda a: found.append(a) if isinstance(a, (fx.Node, Host)) else a)
    return bool(found)


def _on_host(values: Iterable[Value], scalars: bool = False) -> bool:
    """Whether the op computes on Python ints: some value is a Host, none a run-time tensor, and the
    constants are integers (integer scalars where ``scalars``)."""
    values = list(values)
    consts = [v for v in values if isinstance(v, torch.Tensor)]
    return (
        any(isinstance(v, Host) for v in values)
        and not any(isinstance(v, fx.Node) for v in values)
        and all(not c.is_floating_point() and (c.dim() == 0 or not scalars) for c in consts)
    )


def import_graph(source, inputs: Sequence[str] | None = None, outputs: Sequence[str] | None = None) -> fx.GraphModule:
    """Import a frozen TensorFlow graph as a ``torch.fx.GraphModule``.

    ``source``: a frozen GraphDef (``.pb`` path, bytes or message) or a SavedModel directory whose
    variables were folded into constants. ``inputs``: node names fed by ``forward``'s arguments, in
    that order (default: every Placeholder, in graph order). ``outputs``: node names or ``name:index``
    refs returned (default: the nodes nothing reads). A SavedModel's serving signature, ordered by
    its keys, gives the defaults instead. Constants become buffers, variables parameters.
    """
    graph_def, signature = load_graph_def(source)
    if signature is not None:
        inputs = signature.inputs if inputs is None else inputs
        outputs = signature.outputs if outputs is None else outputs
    return GraphImporter(graph_def, inputs, outputs).run()


def compile_tf(source, inputs: Sequence[str] | None = None, outputs: Sequence[str] | None = None,
               options: Any = None, **compile_kwargs):
    """``import_graph(source, inputs, outputs)`` compiled with ``torch.compile(backend="rec_ascend")``."""
    gm = import_graph(source, inputs, outputs)
    compiled = torch.compile(gm, backend="rec_ascend", options=options, **compile_kwargs)
    # TF sizes can depend on data (a bag count is the last segment id + 1, Unique's length): trace them
    # as symbolic ints rather than breaking the graph at each, so all lookups of a model stay in one graph.
    data_dependent = torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
    compiled.forward = data_dependent(compiled.forward)
    return compiled


# --- run-time helpers the imported graphs call ---------------------------------------------------

def shape_of(x: torch.Tensor) -> list:
    return list(x.shape)


def _index(x, index: tuple):
    if isinstance(x, (list, tuple)):  # a shape: one dimension
        (item,) = index
        return x[item]
    return x[index]


def strided_slice(x, begin, end, strides, begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0,
                  shrink_axis_mask=0):
    index = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        bit = 1 << i
        if ellipsis_mask & bit:
            index.append(Ellipsis)
        elif new_axis_mask & bit:
            index.append(None)
        elif shrink_axis_mask & bit:
            index.append(b)
        else:
            index.append(slice(None if begin_mask & bit else b, None if end_mask & bit else e, s))
    return _index(x, tuple(index))


def slice_(x, begin, size):
    return _index(x, tuple(slice(b, None if s == -1 else b + s) for b, s in zip(begin, size)))


HOST_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
    "mod": operator.mod, "max": max, "min": min,
}


def host_binary(op: str, a, b):
    fn = HOST_BINARY[op]
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        n = len(a) if isinstance(a, (list, tuple)) else len(b)
        a = list(a) if isinstance(a, (list, tuple)) else [a] * n
        b = list(b) if isinstance(b, (list, tuple)) else [b] * n
        return [fn(x, y) for x, y in zip(a, b)]
    return fn(a, b)


def host_list(*items) -> list:
    out = []
    for item in items:
        out.extend(item if isinstance(item, (list, tuple)) else [item])
    return out


def host_gather(params, indices):
    return [params[i] for i in indices] if isinstance(indices, (list, tuple)) else params[indices]


def host_prod(x, keep_dims: bool):
    p = math.prod(x) if isinstance(x, (list, tuple)) else x
    return [p] if keep_dims else p


def gather(params: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    axis = axis % params.dim()
    picked = torch.index_select(params, axis, indices.reshape((-1,)))
    return picked.reshape(params.shape[:axis] + indices.shape + params.shape[axis + 1:])


def squared_difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    diff = torch.sub(x, y)
    return torch.mul(diff, diff)


def div_no_nan(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.where(y == 0, torch.zeros_like(torch.div(x, y)), torch.div(x, y))


def bias_add_nchw(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.add(x, bias.reshape([-1] + [1] * (x.dim() - 2)))


def select_v1(cond: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """TF1 Select: a 1-D condition picks whole rows."""
    cond = cond.reshape(tuple(cond.shape) + (1,) * (x.dim() - cond.dim()))
    return torch.where(cond, x, y)


def band_part(x: torch.Tensor, num_lower: int, num_upper: int) -> torch.Tensor:
    rows, cols = x.shape[-2], x.shape[-1]
    i = torch.arange(rows, device=x.device).unsqueeze(-1)
    j = torch.arange(cols, device=x.device)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=x.device)
    if num_lower >= 0:
        keep = keep & (i - j <= num_lower)
    if num_upper >= 0:
        keep = keep & (j - i <= num_upper)
    return torch.where(keep, x, torch.zeros_like(x))


def reduce_prod(x: torch.Tensor, dims: list, keepdim: bool) -> torch.Tensor:
    for dim in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, dim, keepdim=keepdim)
    return x


def unique(x: torch.Tensor, out_idx: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TF Unique: the distinct values in order of first occurrence, and each element's index among them."""
    values, inverse = torch.unique(x, sorted=True, return_inverse=True)
    positions = torch.arange(x.numel(), device=x.device)
    first = torch.full_like(values, x.numel(), dtype=torch.long).scatter_reduce(0, inverse, positions, "amin")
    order = torch.argsort(first)
    rank = torch.argsort(order)
    return values[order], rank[inverse].to(out_idx)


def segment_offsets(segment_ids: torch.Tensor, like: torch.Tensor, num_segments=None) -> torch.Tensor:
    """Bag offsets of sorted segment ids (TF: without ``num_segments`` there are last id + 1 segments)."""
    if num_segments is None:
        num_segments = segment_ids[-1].item() + 1
        torch._check(num_segments >= 0)
    starts = torch.arange(num_segments, device=segment_ids.device, dtype=segment_ids.dtype)
    return torch.searchsorted(segment_ids.contiguous(), starts).to(like.dtype)


def sqrtn_weights(offsets: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-id weights 1/sqrt(bag length), so a sum bag gives TF's SqrtN combiner."""
    ends = torch.cat([offsets[1:], offsets.new_full((1,), indices.numel())])
    lengths = (ends - offsets).to(weight.dtype)
    return torch.repeat_interleave(torch.rsqrt(lengths), ends - offsets, output_size=indices.numel())


def segment_sum(data: torch.Tensor, segment_ids: torch.Tensor, num_segments=None) -> torch.Tensor:
    if num_segments is None:
        num_segments = segment_ids.max().item() + 1 if segment_ids.numel() else 0
        torch._check(num_segments >= 0)
    rows = data.reshape((-1,) + tuple(data.shape[segment_ids.dim():]))
    out = torch.zeros((num_segments,) + tuple(rows.shape[1:]), dtype=data.dtype, device=data.device)
    return torch.index_add(out, 0, segment_ids.reshape((-1,)), rows)


# --- converters ----------------------------------------------------------------------------------

@converter("Placeholder")
def _placeholder(ctx: GraphImporter, node):
    raise TFImportError(f"placeholder {node.name!r} is needed by the outputs but is not among the inputs {ctx.inputs}")


@converter("PlaceholderWithDefault")
def _placeholder_with_default(ctx, node, default):
    return default


@converter("Const")
def _const(ctx: GraphImporter, node):
    tensor = attr(node, "value")
    if tensor.is_floating_point() and ctx.trainable(node):
        ctx.const_owner[id(tensor)] = node.name
        return ctx.constant(tensor, trainable=True)
    return tensor


@converter("Identity", "StopGradient", "Snapshot", "PreventGradient", "EnsureShape")
def _identity(ctx, node, x, *rest):
    return x


@converter("IdentityN")
def _identity_n(ctx, node, *xs):
    return list(xs)


@converter("NoOp")
def _no_op(ctx, node):
    return []


UNARY = {
    "Relu": torch.relu, "Relu6": F.relu6, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp,
    "Log": torch.log, "Log1p": torch.log1p, "Sqrt": torch.sqrt, "Rsqrt": torch.rsqrt, "Square": torch.square,
    "Neg": torch.neg, "Abs": torch.abs, "Erf": torch.erf, "Softplus": F.softplus, "Elu": F.elu, "Selu": F.selu,
    "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign,
    "Reciprocal": torch.reciprocal, "Sin": torch.sin, "Cos": torch.cos, "LogicalNot": torch.logical_not,
    "ZerosLike": torch.zeros_like, "OnesLike": torch.ones_like,
}


@converter(*UNARY)
def _unary(ctx, node, x):
    return ctx.call(UNARY[node.op], ctx.tensor(x))


@converter("Softmax", "LogSoftmax")
def _softmax(ctx, node, x):
    return ctx.call(torch.softmax if node.op == "Softmax" else torch.log_softmax, ctx.tensor(x), -1)


@converter("LeakyRelu")
def _leaky_relu(ctx, node, x):
    return ctx.call(F.leaky_relu, ctx.tensor(x), attr(node, "alpha", 0.2))


# TF binary op -> (torch function, host op name or None).
BINARY = {
    "Add": (torch.add, "add"), "AddV2": (torch.add, "add"), "Sub": (torch.sub, "sub"), "Mul": (torch.mul, "mul"),
    "RealDiv": (torch.div, None), "Div": (torch.div, None), "FloorDiv": (torch.floor_divide, "floordiv"),
    "FloorMod": (torch.remainder, "mod"), "Maximum": (torch.maximum, "max"), "Minimum": (torch.minimum, "min"),
    "Pow": (torch.pow, None), "SquaredDifference": (squared_difference, None), "DivNoNan": (div_no_nan, None),
    "Less": (torch.lt, None), "LessEqual": (torch.le, None), "Greater": (torch.gt, None),
    "GreaterEqual": (torch.ge, None), "Equal": (torch.eq, None), "NotEqual": (torch.ne, None),
    "LogicalAnd": (torch.logical_and, None), "LogicalOr": (torch.logical_or, None),
}


@converter(*BINARY)
def _binary(ctx, node, x, y):
    fn, host_op = BINARY[node.op]
    if host_op is not None and _on_host([x, y]):
        dtype = x.dtype if isinstance(x, Host) else y.dtype
        return Host(ctx.call(host_binary, host_op, ctx.ints(x), ctx.ints(y)), dtype)
    return ctx.call(fn, ctx.tensor(x), ctx.tensor(y))


@converter("AddN")
def _add_n(ctx, node, *xs):
    total = ctx.tensor(xs[0])
    for x in xs[1:]:
        total = ctx.call(torch.add, total, ctx.tensor(x))
    return total


@converter("BiasAdd")
def _bias_add(ctx, node, x, bias):
    fn = bias_add_nchw if attr(node, "data_format", "NHWC") == "NCHW" else torch.add
    return ctx.call(fn, x, bias)


def _matmul(ctx, a, b, transpose_a: bool, transpose_b: bool):
    if transpose_a:
        a = ctx.call(torch.transpose, a, -2, -1)
    if transpose_b:
        b = ctx.call(torch.transpose, b, -2, -1)
    return ctx.call(torch.matmul, a, b)


@converter("MatMul")
def _mat_mul(ctx, node, a, b):
    return _matmul(ctx, a, b, attr(node, "transpose_a", False), attr(node, "transpose_b", False))


@converter("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_mat_mul(ctx, node, a, b):
    out = _matmul(ctx, a, b, attr(node, "adj_x", False), attr(node, "adj_y", False))
    dtype = attr(node, "Tout")
    return ctx.method("to", out, dtype) if node.op == "BatchMatMulV3" and dtype is not None else out


@converter("Einsum")
def _einsum(ctx, node, *xs):
    return ctx.call(torch.einsum, attr(node, "equation"), *xs)


@converter("ConcatV2")
def _concat(ctx, node, *inputs):
    *xs, axis = inputs
    if _on_host(xs):
        return Host(ctx.call(host_list, *[ctx.ints(x) for x in xs]), next(x.dtype for x in xs if isinstance(x, Host)))
    return ctx.call(torch.cat, [ctx.tensor(x) for x in xs], ctx.static(axis, "the concat axis"))


@converter("Pack")
def _pack(ctx, node, *xs):
    if _on_host(xs, scalars=True) and attr(node, "axis", 0) == 0:
        return Host(ctx.call(host_list, *[ctx.ints(x) for x in xs]), next(x.dtype for x in xs if isinstance(x, Host)))
    return ctx.call(torch.stack, [ctx.tensor(x) for x in xs], attr(node, "axis", 0))


@converter("Unpack")
def _unpack(ctx, node, x):
    parts = ctx.call(torch.unbind, ctx.tensor(x), attr(node, "axis", 0))
    return [ctx.call(operator.getitem, parts, i) for i in range(attr(node, "num"))]


# TF op (x, sizes) -> torch function taking the sizes as ints (a shape, a permutation, repeats).
SIZED = {"Reshape": torch.reshape, "Transpose": torch.permute, "Tile": torch.tile, "BroadcastTo": torch.broadcast_to}


@converter(*SIZED)
def _sized(ctx, node, x, sizes):
    return ctx.call(SIZED[node.op], ctx.tensor(x), ctx.ints(sizes))


@converter("ExpandDims")
def _expand_dims(ctx, node, x, axis):
    dim = ctx.static(axis, "the axis")
    return ctx.call(torch.unsqueeze, ctx.tensor(x), dim[0] if isinstance(dim, list) else dim)


@converter("Squeeze")
def _squeeze(ctx, node, x):
    dims = attr(node, "squeeze_dims", [])
    return ctx.call(torch.squeeze, ctx.tensor(x), tuple(dims)) if dims else ctx.call(torch.squeeze, ctx.tensor(x))


@converter("StridedSlice")
def _strided_slice(ctx, node, x, begin, end, strides):
    masks = {k: attr(node, k, 0) for k in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                           "shrink_axis_mask")}
    out = ctx.call(strided_slice, x, ctx.ints(begin), ctx.ints(end), ctx.ints(strides), **masks)
    return Host(out, x.dtype) if isinstance(x, Host) else out


@converter("Slice")
def _slice(ctx, node, x, begin, size):
    out = ctx.call(slice_, x, ctx.ints(begin), ctx.ints(size))
    return Host(out, x.dtype) if isinstance(x, Host) else out


@converter("Shape")
def _shape(ctx, node, x):
    dtype = attr(node, "out_type", torch.int32)
    if isinstance(x, torch.Tensor):
        return torch.tensor(list(x.shape), dtype=dtype)
    if isinstance(x, Host):
        return Host(ctx.call(host_list, ctx.call(len, x.node)), dtype)
    return Host(ctx.call(shape_of, x), dtype)


@converter("Size")
def _size(ctx, node, x):
    return Host(ctx.method("numel", ctx.tensor(x)), attr(node, "out_type", torch.int32))


@converter("Fill")
def _fill(ctx, node, dims, value):
    if isinstance(value, torch.Tensor):
        return ctx.call(torch.full, ctx.ints(dims), value.item(), dtype=value.dtype, device=ctx.device())
    return ctx.method("clone", ctx.method("expand", ctx.tensor(value), ctx.ints(dims)))


@converter("Cast")
def _cast(ctx, node, x):
    dtype = attr(node, "DstT")
    if isinstance(x, Host) and not dtype.is_floating_point and dtype != torch.bool:
        return Host(x.node, dtype)
    return ctx.method("to", ctx.tensor(x), dtype)


REDUCTIONS = {
    "Sum": torch.sum, "Mean": torch.mean, "Max": torch.amax, "Min": torch.amin, "All": torch.all,
    "Any": torch.any, "Prod": reduce_prod,
}


@converter(*REDUCTIONS)
def _reduce(ctx, node, x, axes):
    keep = attr(node, "keep_dims", False)
    if isinstance(x, Host) and node.op == "Prod":
        return Host(ctx.call(host_prod, x.node, keep), x.dtype)
    dims = ctx.static(axes, "the reduction axes")
    dims = [dims] if isinstance(dims, int) else dims
    if not dims:  # TF reduces over no axis: the input unchanged
        return x
    return ctx.call(REDUCTIONS[node.op], ctx.tensor(x), dims if node.op == "Prod" else tuple(dims), keep)


def _gather(ctx: GraphImporter, params, indices, axis: int):
    if isinstance(params, Host):
        return Host(ctx.call(host_gather, params.node, ctx.ints(indices)), params.dtype)
    table = ctx.const_tensor(params)
    if axis == 0 and table is not None and table.dim() == 2 and table.is_floating_point():
        return ctx.call(F.embedding, ctx.tensor(indices), params)
    return ctx.call(gather, ctx.tensor(params), ctx.tensor(indices), axis)


@converter("GatherV2")
def _gather_v2(ctx, node, params, indices, axis):
    if attr(node, "batch_dims", 0):
        raise TFImportError(f"node {node.name!r}: GatherV2 with batch_dims != 0 is not supported")
    return _gather(ctx, params, indices, ctx.static(axis, "the gather axis"))


@converter("ResourceGather")
def _resource_gather(ctx, node, params, indices):
    if attr(node, "batch_dims", 0):
        raise TFImportError(f"node {node.name!r}: ResourceGather with batch_dims != 0 is not supported")
    return _gather(ctx, params, indices, 0)


SPARSE_SEGMENT_MODES = {"SparseSegmentSum": "sum", "SparseSegmentMean": "mean", "SparseSegmentSqrtN": "sqrtn"}


@converter(*SPARSE_SEGMENT_MODES, *(op + "WithNumSegments" for op in SPARSE_SEGMENT_MODES))
def _sparse_segment(ctx: GraphImporter, node, data, indices, segment_ids, num_segments=None):
    """``out[s] = reduce(data[indices[i]] for i with segment_ids[i] == s)``: an embedding bag over ``data``.

    ``tf.nn.embedding_lookup_sparse`` gathers the table at ``unique(ids)`` and reduces at the unique
    indices; that is the bag over the table at ``ids`` itself, so the Unique and the gather are skipped.
    """
    data, indices = _through_unique(ctx, node, data, indices)
    mode = SPARSE_SEGMENT_MODES[node.op.removesuffix("WithNumSegments")]
    indices = ctx.tensor(indices)
    count = None if num_segments is None else ctx.ints(num_segments)
    offsets = ctx.call(segment_offsets, ctx.tensor(segment_ids), indices, count)
    weights = ctx.call(sqrtn_weights, offsets, indices, data) if mode == "sqrtn" else None
    return ctx.call(F.embedding_bag, indices, data, offsets, mode="sum" if mode == "sqrtn" else mode,
                    per_sample_weights=weights)


def _through_unique(ctx: GraphImporter, node, data, indices):
    gathered, _ = ctx.producer(node.input[0])
    index_node, index_output = ctx.producer(node.input[1])
    if gathered.op not in ("GatherV2", "ResourceGather") or index_node.op != "Unique" or index_output != 1:
        return data, indices
    unique_node, unique_output = ctx.producer(gathered.input[1])
    axis = 0 if gathered.op == "ResourceGather" else ctx.value(gathered.input[2])
    axis_is_zero = not isinstance(axis, (fx.Node, Host)) and int(axis) == 0
    if unique_node.name != index_node.name or unique_output != 0 or not axis_is_zero or attr(gathered, "batch_dims", 0):
        return data, indices
    return ctx.value(gathered.input[0]), ctx.value(unique_node.input[0])


@converter("Unique")
def _unique(ctx, node, x):
    both = ctx.call(unique, ctx.tensor(x), attr(node, "out_idx", torch.int32))
    return [ctx.call(operator.getitem, both, 0), ctx.call(operator.getitem, both, 1)]


@converter("SegmentSum", "UnsortedSegmentSum")
def _segment_sum(ctx, node, data, segment_ids, num_segments=None):
    count = None if num_segments is None else ctx.ints(num_segments)
    return ctx.call(segment_sum, ctx.tensor(data), ctx.tensor(segment_ids), count)


@converter("Select")
def _select(ctx, node, cond, x, y):
    return ctx.call(select_v1, ctx.tensor(cond), ctx.tensor(x), ctx.tensor(y))


@converter("SelectV2")
def _select_v2(ctx, node, cond, x, y):
    return ctx.call(torch.where, ctx.tensor(cond), ctx.tensor(x), ctx.tensor(y))


@converter("MatrixBandPart")
def _matrix_band_part(ctx, node, x, num_lower, num_upper):
    return ctx.call(band_part, ctx.tensor(x), ctx.static(num_lower, "num_lower"), ctx.static(num_upper, "num_upper"))


@converter("Range")
def _range(ctx, node, start, limit, delta):
    return ctx.call(torch.arange, ctx.ints(start), ctx.ints(limit), ctx.ints(delta), dtype=attr(node, "Tidx"),
                    device=ctx.device())
