"""TensorFlow front end without TensorFlow: hand-written GraphDefs against TF's documented semantics."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.frontends import graph_proto
from recompile.frontends.tensorflow import TFImportError, UnsupportedOpError, import_graph

TF_INT = {torch.int32: 3, torch.int64: 9}


def graph_def(*nodes):
    """``nodes``: (name, op, inputs, attrs) with attrs {name: int | str | bool | torch.Tensor}."""
    g = graph_proto.GraphDef()
    for name, op, inputs, attrs in nodes:
        node = g.node.add(name=name, op=op, input=inputs)
        for key, value in attrs.items():
            if isinstance(value, torch.Tensor):
                tensor = node.attr[key].tensor
                tensor.dtype = TF_INT[value.dtype]
                tensor.tensor_shape.dim.extend([graph_proto.message_class("TensorShapeProto.Dim")(size=s)
                                                for s in value.shape])
                tensor.tensor_content = value.numpy().tobytes()
            elif isinstance(value, bool):
                node.attr[key].b = value
            else:
                node.attr[key].i = value
    return g


def sparse_segment_reference(data, indices, segment_ids, combiner, num_segments):
    """TF's SparseSegment{Sum,Mean,SqrtN}: reduce data[indices[i]] into row segment_ids[i]."""
    out = np.zeros((num_segments, data.shape[1]), dtype=np.float64)
    counts = np.zeros(num_segments)
    for index, segment in zip(indices, segment_ids):
        out[segment] += data[index]
        counts[segment] += 1
    scale = {"Sum": np.ones_like(counts), "Mean": counts, "SqrtN": np.sqrt(counts)}[combiner]
    return torch.from_numpy(np.divide(out, scale[:, None], out=np.zeros_like(out), where=scale[:, None] > 0))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    trailing_empty=st.integers(0, 2),
    combiner=st.sampled_from(["Sum", "Mean", "SqrtN"]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    with_num_segments=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sparse_segment_reductions_are_embedding_bags(lengths, trailing_empty, combiner, dtype, with_num_segments,
                                                      seed):
    if not with_num_segments and (sum(lengths) == 0 or lengths[-1] == 0):
        lengths = lengths + [1]  # without num_segments TF has last id + 1 segments
    gen = torch.Generator().manual_seed(seed)
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dtype)
    indices = torch.randint(0, 7, (len(segment_ids),), generator=gen).to(dtype)
    data = torch.randn(7, 3, generator=gen)
    num_segments = len(lengths) + trailing_empty if with_num_segments else len(lengths)
    nodes = [("data", "Placeholder", [], {}), ("indices", "Placeholder", [], {}), ("segments", "Placeholder", [], {})]
    op = f"SparseSegment{combiner}"
    if with_num_segments:
        nodes.append(("n", "Const", [], {"value": torch.tensor(num_segments, dtype=torch.int32)}))
        nodes.append(("out", op + "WithNumSegments", ["data", "indices", "segments", "n"], {}))
    else:
        nodes.append(("out", op, ["data", "indices", "segments"], {}))
    gm = import_graph(graph_def(*nodes))
    assert [n.target for n in gm.graph.nodes if n.target is F.embedding_bag] == [F.embedding_bag]
    expected = sparse_segment_reference(data.double().numpy(), indices.numpy(), segment_ids.numpy(), combiner,
                                        num_segments)
    torch.testing.assert_close(gm(data, indices, segment_ids).double(), expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-3, 5), min_size=1, max_size=12), st.sampled_from([torch.int32, torch.int64]))
def test_unique_keeps_first_occurrence_order(values, out_idx):
    nodes = [("x", "Placeholder", [], {}), ("u", "Unique", ["x"], {})]
    g = graph_def(*nodes)
    g.node[1].attr["out_idx"].type = TF_INT[out_idx]
    gm = import_graph(g, outputs=["u:0", "u:1"])
    y, idx = gm(torch.tensor(values))
    first = list(dict.fromkeys(values))
    assert y.tolist() == first and idx.dtype == out_idx
    assert idx.tolist() == [first.index(v) for v in values]


@pytest.mark.parametrize(
    "begin, end, strides, masks, index",
    [
        ([1], [3], [1], {}, np.s_[1:3]),
        ([0, 1], [0, 3], [1, 2], {"begin_mask": 1, "end_mask": 1}, np.s_[:, 1:3:2]),
        ([-1], [0], [1], {"shrink_axis_mask": 1}, np.s_[-1]),
        ([0, 0], [0, 0], [1, 1], {"ellipsis_mask": 1, "new_axis_mask": 2}, np.s_[..., None]),
        ([1, 0], [2, 0], [1, 1], {"shrink_axis_mask": 1, "end_mask": 2}, np.s_[1, 0:]),
    ],
)
def test_strided_slice_masks(begin, end, strides, masks, index):
    consts = [(name, "Const", [], {"value": torch.tensor(v, dtype=torch.int32)})
              for name, v in (("b", begin), ("e", end), ("s", strides))]
    gm = import_graph(graph_def(("x", "Placeholder", [], {}), *consts,
                                ("y", "StridedSlice", ["x", "b", "e", "s"], masks)))
    x = torch.arange(24.0).reshape(4, 6)
    torch.testing.assert_close(gm(x), torch.from_numpy(x.numpy()[index]))


# --- errors ----------------------------------------------------------------------------------------

def graph(*nodes):
    return graph_def(*[(name, op, inputs, {}) for name, op, inputs in nodes])


def test_unsupported_op_names_op_node_and_supported_set():
    g = graph(("x", "Placeholder", []), ("scan", "Cumprod", ["x"]))
    with pytest.raises(UnsupportedOpError, match=r"op 'Cumprod' \(node 'scan'\) is not supported; "
                                                 r"supported ops: .*MatMul.*SparseSegmentSqrtN"):
        import_graph(g)
    with pytest.raises(UnsupportedOpError, match="VarHandleOp.*not frozen"):
        import_graph(graph(("v", "VarHandleOp", [])), outputs=["v"])


@pytest.mark.parametrize(
    "source, kwargs, message",
    [
        (b"\x0a\xff\xff\xff", {}, "not a valid GraphDef protobuf"),
        (b"", {}, "not a GraphDef"),
        ("/nonexistent/model.pb", {}, "no such GraphDef file"),
        (42, {}, "cannot import a int"),
        (graph(("x", "Placeholder", []), ("y", "Relu", ["x"])), {"inputs": ["z"]},
         r"input 'z' is not a node of the graph; its placeholders are \['x'\]"),
        (graph(("x", "Placeholder", []), ("y", "Relu", ["x"])), {"outputs": ["w"]}, "output 'w' is not a node"),
        (graph(("x", "Placeholder", []), ("y", "Relu", ["missing"])), {}, "node 'y' reads 'missing'"),
        (graph(("x", "Placeholder", []), ("y", "Relu", ["x:3"])), {}, "reads output 3 of 'x'"),
    ],
)
def test_bad_sources_get_clear_errors(source, kwargs, message):
    with pytest.raises(TFImportError, match=message):
        import_graph(source, **kwargs)


def test_saved_model_directory_errors(tmp_path):
    with pytest.raises(TFImportError, match="must contain saved_model.pb"):
        import_graph(tmp_path)
    saved = graph_proto.SavedModel()
    meta = saved.meta_graphs.add()
    meta.meta_info_def.tags.append("serve")
    meta.graph_def.CopyFrom(graph(("x", "Placeholder", []), ("call", "StatefulPartitionedCall", ["x"])))
    (tmp_path / "saved_model.pb").write_bytes(saved.SerializeToString())
    with pytest.raises(TFImportError, match="keeps its variables or functions outside the graph"):
        import_graph(tmp_path)
