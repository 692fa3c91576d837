"""The GraphDef and SavedModel protobuf messages, built from TensorFlow's .proto field numbers.

Only ``protobuf`` is needed, not TensorFlow (or TensorBoard's copies of its protos): the messages
below keep the field names and numbers of ``tensorflow/core/framework/{graph,node_def,attr_value,
tensor,tensor_shape,versions}.proto`` and ``tensorflow/core/protobuf/{saved_model,meta_graph}.proto``
for the fields an importer reads. Fields not listed (function libraries, debug info) are kept as
unknown fields by the parser, so the wire format of any TensorFlow 2.x GraphDef parses.
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
SCALARS = {
    "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32, "uint64": _F.TYPE_UINT64, "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}
PACKAGE = "recompile.tensorflow"

# message -> [(field, number, type, repeated?, oneof)]; DataType enums are read as int32 (same wire format).
# A type "map:X" is map<string, X>.
MESSAGES: dict[str, list[tuple]] = {
    "TensorShapeProto": [("dim", 2, "TensorShapeProto.Dim", True), ("unknown_rank", 3, "bool")],
    "TensorShapeProto.Dim": [("size", 1, "int64"), ("name", 2, "string")],
    "TensorProto": [
        ("dtype", 1, "int32"), ("tensor_shape", 2, "TensorShapeProto"), ("version_number", 3, "int32"),
        ("tensor_content", 4, "bytes"), ("float_val", 5, "float", True), ("double_val", 6, "double", True),
        ("int_val", 7, "int32", True), ("string_val", 8, "bytes", True), ("int64_val", 10, "int64", True),
        ("bool_val", 11, "bool", True), ("half_val", 13, "int32", True), ("uint32_val", 16, "uint32", True),
        ("uint64_val", 17, "uint64", True),
    ],
    "AttrValue": [
        ("list", 1, "AttrValue.ListValue", False, "value"), ("s", 2, "bytes", False, "value"),
        ("i", 3, "int64", False, "value"), ("f", 4, "float", False, "value"), ("b", 5, "bool", False, "value"),
        ("type", 6, "int32", False, "value"), ("shape", 7, "TensorShapeProto", False, "value"),
        ("tensor", 8, "TensorProto", False, "value"), ("placeholder", 9, "string", False, "value"),
        ("func", 10, "NameAttrList", False, "value"),
    ],
    "AttrValue.ListValue": [
        ("s", 2, "bytes", True), ("i", 3, "int64", True), ("f", 4, "float", True), ("b", 5, "bool", True),
        ("type", 6, "int32", True), ("shape", 7, "TensorShapeProto", True), ("tensor", 8, "TensorProto", True),
        ("func", 9, "NameAttrList", True),
    ],
    "NameAttrList": [("name", 1, "string"), ("attr", 2, "map:AttrValue")],
    "NodeDef": [
        ("name", 1, "string"), ("op", 2, "string"), ("input", 3, "string", True), ("device", 4, "string"),
        ("attr", 5, "map:AttrValue"),
    ],
    "VersionDef": [("producer", 1, "int32"), ("min_consumer", 2, "int32"), ("bad_consumers", 3, "int32", True)],
    "GraphDef": [("node", 1, "NodeDef", True), ("versions", 4, "VersionDef")],
    "MetaGraphDef": [
        ("meta_info_def", 1, "MetaGraphDef.MetaInfoDef"), ("graph_def", 2, "GraphDef"),
        ("signature_def", 5, "map:SignatureDef"),
    ],
    "MetaGraphDef.MetaInfoDef": [("meta_graph_version", 1, "string"), ("tags", 4, "string", True)],
    "SignatureDef": [("inputs", 1, "map:TensorInfo"), ("outputs", 2, "map:TensorInfo"), ("method_name", 3, "string")],
    "TensorInfo": [("name", 1, "string", False, "encoding")],
    "SavedModel": [("saved_model_schema_version", 1, "int64"), ("meta_graphs", 2, "MetaGraphDef", True)],
}


def _add_field(message: descriptor_pb2.DescriptorProto, spec: tuple, oneofs: dict[str, int]) -> None:
    name, number, type_name, repeated, oneof = spec + (False, None)[len(spec) - 3:]
    field = message.field.add(name=name, number=number, label=REPEATED if repeated else OPTIONAL)
    if type_name.startswith("map:"):
        entry = message.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, label=OPTIONAL, type=_F.TYPE_STRING)
        entry.field.add(name="value", number=2, label=OPTIONAL, type=_F.TYPE_MESSAGE,
                        type_name=f".{PACKAGE}.{type_name[4:]}")
        field.label, field.type = REPEATED, _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{message.name}.{entry.name}"
    elif type_name in SCALARS:
        field.type = SCALARS[type_name]
    else:
        field.type, field.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{type_name}"
    if oneof is not None:
        if oneof not in oneofs:
            oneofs[oneof] = len(message.oneof_decl)
            message.oneof_decl.add(name=oneof)
        field.oneof_index = oneofs[oneof]


def _build_pool() -> descriptor_pool.DescriptorPool:
    file = descriptor_pb2.FileDescriptorProto(name="recompile/tensorflow_graph.proto", package=PACKAGE,
                                              syntax="proto3")
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full_name in MESSAGES:  # parents are listed before their nested messages
        parent, _, name = full_name.rpartition(".")
        container = protos[parent].nested_type if parent else file.message_type
        protos[full_name] = container.add(name=name)
    for full_name, fields in MESSAGES.items():
        oneofs: dict[str, int] = {}
        for spec in fields:
            _add_field(protos[full_name], spec, oneofs)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


_POOL = _build_pool()


def message_class(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


GraphDef = message_class("GraphDef")
NodeDef = message_class("NodeDef")
SavedModel = message_class("SavedModel")
