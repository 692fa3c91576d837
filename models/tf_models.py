"""Rec models written in TensorFlow: built, frozen, and written as GraphDefs with inputs and TF's outputs.

Run in its own process, by path (``python models/tf_models.py OUT_DIR [--batch N] [--time-iters K]``,
so that no package ``__init__`` loads torch next to it): TensorFlow and triton load conflicting LLVM
builds, so the tests and the benchmark never import TensorFlow themselves. For each model it writes ``<name>.pb`` (frozen GraphDef), ``<name>.npz``
(inputs ``in:<i>`` and TF's outputs ``out:<i>``) and an entry in ``models.json`` with the input
and output node names (and, with ``--time-iters``, TensorFlow's forward time in ms).
"""
import argparse
import json
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2  # noqa: E402

rng = np.random.default_rng(0)


def dense_layer(units, activation=None):
    return tf.keras.layers.Dense(units, activation=activation, kernel_initializer="glorot_normal",
                                 bias_initializer="random_normal")


def sparse_batch(rows, batch, max_len):
    """A SparseTensor-shaped batch (indices, values, dense_shape) with 1..max_len ids per row."""
    lengths = rng.integers(1, max_len + 1, size=batch)
    indices = np.array([[b, j] for b in range(batch) for j in range(lengths[b])], dtype=np.int64)
    values = rng.integers(0, rows, size=len(indices)).astype(np.int64)
    return [indices, values, np.array([batch, max_len], dtype=np.int64)]


def dense_and_ids(batch, width, rows, dtype):
    """Inputs of a model fed dense features [batch, width] and one id per table [batch, len(rows)]."""
    ids = np.stack([rng.integers(0, r, size=batch) for r in rows], axis=1)
    return [rng.normal(size=(batch, width)).astype(np.float32), ids.astype(dtype)]


def dense_and_ids_signature(width, tables, dtype):
    return [tf.TensorSpec([None, width], tf.float32, name="dense"), tf.TensorSpec([None, tables], dtype, name="ids")]


class WideDeep(tf.Module):
    """Wide & Deep: a linear model over one-hot ids and dense features, plus an MLP over embeddings."""

    rows, dim = (20, 30, 40), 8

    def __init__(self):
        self.deep_tables = [tf.keras.layers.Embedding(r, self.dim) for r in self.rows]
        self.wide_tables = [tf.keras.layers.Embedding(r, 1) for r in self.rows]
        self.wide_dense = tf.Variable(rng.normal(size=(5, 1)).astype(np.float32))
        self.mlp = [dense_layer(16, "relu"), dense_layer(8, "relu"), dense_layer(1)]

    def inputs(self, batch):
        return dense_and_ids(batch, 5, self.rows, np.int32)

    def signature(self):
        return dense_and_ids_signature(5, len(self.rows), tf.int32)

    def __call__(self, dense, ids):
        columns = tf.unstack(ids, axis=1)
        deep = tf.concat([dense] + [t(c) for t, c in zip(self.deep_tables, columns)], axis=1)
        for layer in self.mlp:
            deep = layer(deep)
        wide = tf.add_n([t(c) for t, c in zip(self.wide_tables, columns)]) + tf.matmul(dense, self.wide_dense)
        return tf.sigmoid(wide + deep)


class DLRM(tf.Module):
    """DLRM: bottom MLP, tf.nn.embedding_lookup_sparse tables (sum, mean, sqrtn), dot interaction, top MLP."""

    rows, dim, combiners = (25, 35, 45), 8, ("sum", "mean", "sqrtn")

    def __init__(self):
        self.tables = [tf.Variable(rng.normal(size=(r, self.dim)).astype(np.float32)) for r in self.rows]
        self.bottom = [dense_layer(16, "relu"), dense_layer(self.dim, "relu")]
        self.top = [dense_layer(16, "relu"), dense_layer(1, "sigmoid")]
        features = len(self.rows) + 1
        self.pairs = [i * features + j for i in range(features) for j in range(i + 1, features)]

    def inputs(self, batch):
        out = [rng.normal(size=(batch, 4)).astype(np.float32)]
        for r in self.rows:
            out += sparse_batch(r, batch, 4)
        return out

    def signature(self):
        spec = [tf.TensorSpec([None, 4], tf.float32, name="dense")]
        for t in range(len(self.rows)):
            spec += [tf.TensorSpec([None, 2], tf.int64, name=f"indices{t}"),
                     tf.TensorSpec([None], tf.int64, name=f"values{t}"),
                     tf.TensorSpec([2], tf.int64, name=f"shape{t}")]
        return spec

    def __call__(self, dense, *sparse):
        x = dense
        for layer in self.bottom:
            x = layer(x)
        features = [x]
        for t, (table, combiner) in enumerate(zip(self.tables, self.combiners)):
            ids = tf.SparseTensor(*sparse[3 * t:3 * t + 3])
            features.append(tf.nn.embedding_lookup_sparse(table, ids, None, combiner=combiner))
        stacked = tf.stack(features, axis=1)
        dots = tf.matmul(stacked, stacked, transpose_b=True)
        flat = tf.reshape(dots, [-1, stacked.shape[1] * stacked.shape[1]])
        z = tf.concat([x, tf.gather(flat, self.pairs, axis=1)], axis=1)
        for layer in self.top:
            z = layer(z)
        return z


class DCN(tf.Module):
    """DCN: embeddings and dense features, three cross layers x0 * (x w) + b + x, a deep tower, a logit."""

    rows, dim = (15, 25), 6

    def __init__(self):
        self.tables = [tf.keras.layers.Embedding(r, self.dim) for r in self.rows]
        width = 3 + self.dim * len(self.rows)
        self.cross = [(tf.Variable(rng.normal(size=(width, 1)).astype(np.float32) * 0.3),
                       tf.Variable(rng.normal(size=(width,)).astype(np.float32))) for _ in range(3)]
        self.deep = [dense_layer(12, "relu"), dense_layer(12, "relu")]
        self.logit = dense_layer(1)

    def inputs(self, batch):
        return dense_and_ids(batch, 3, self.rows, np.int64)

    def signature(self):
        return dense_and_ids_signature(3, len(self.rows), tf.int64)

    def __call__(self, dense, ids):
        embs = [tf.reshape(t(ids[:, i]), [-1, self.dim]) for i, t in enumerate(self.tables)]
        x0 = tf.concat([dense] + embs, axis=-1)
        x = x0
        for w, b in self.cross:
            x = x0 * tf.matmul(x, w) + b + x
        deep = x0
        for layer in self.deep:
            deep = layer(deep)
        return self.logit(tf.concat([x, deep], axis=-1))


class Transformer(tf.Module):
    """A Keras transformer block over item-id sequences: Embedding, causal MultiHeadAttention, LayerNorm, FFN."""

    items, length, dim = 50, 5, 16

    def __init__(self):
        ids = tf.keras.Input((self.length,), dtype="int32")
        x = tf.keras.layers.Embedding(self.items, self.dim)(ids)
        attn = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x, use_causal_mask=True)
        x = tf.keras.layers.LayerNormalization()(x + attn)
        ffn = dense_layer(self.dim)(dense_layer(32, "relu")(x))
        x = tf.keras.layers.LayerNormalization()(x + ffn)
        out = tf.keras.layers.Dense(1)(tf.keras.layers.GlobalAveragePooling1D()(x))
        self.model = tf.keras.Model(ids, out)

    def inputs(self, batch):
        return [rng.integers(0, self.items, size=(batch, self.length)).astype(np.int32)]

    def signature(self):
        return [tf.TensorSpec([None, self.length], tf.int32, name="ids")]

    def __call__(self, ids):
        return self.model(ids)


class Ops(tf.Module):
    """One graph over the rest of the op table: slicing, reductions, segments, masks, shapes."""

    def inputs(self, batch):
        return [rng.normal(size=(batch, 4, 3)).astype(np.float32),
                np.sort(rng.integers(0, 4, size=8)).astype(np.int32),
                rng.integers(0, 5, size=8).astype(np.int64)]

    def signature(self):
        return [tf.TensorSpec([None, 4, 3], tf.float32, name="x"), tf.TensorSpec([8], tf.int32, name="segments"),
                tf.TensorSpec([8], tf.int64, name="ids")]

    def __call__(self, x, segments, ids):
        pos = tf.abs(x) + 0.5
        rows = tf.reshape(x[:2], [8, 3])
        unique_ids, unique_idx = tf.unique(ids)
        scores = tf.reduce_sum(x, axis=[1, 2]) + tf.reduce_max(x, axis=1)[:, 0] - tf.reduce_min(x, axis=-1)[:, 1]
        return (
            tf.tile(tf.expand_dims(x[:, 0, :], 1), [1, 2, 1]),
            tf.squeeze(tf.slice(x, [0, 1, 0], [-1, 1, 2]), axis=1),
            tf.transpose(x, [0, 2, 1]) / tf.reduce_prod(pos, axis=[1, 2], keepdims=True),
            scores,
            tf.raw_ops.Select(condition=scores > 0, x=x, y=-x),
            tf.math.segment_sum(rows, segments),
            tf.math.unsorted_segment_sum(rows, segments, 5),
            tf.add_n(tf.unstack(x, axis=1)),
            tf.cast(x > 0.1, tf.float32) + 2 * tf.cast(tf.logical_or(x <= -0.2, tf.equal(x, 0.0)), tf.float32),
            tf.exp(tf.minimum(x, 1.0)) + tf.math.log(pos) + tf.sqrt(pos) + tf.square(x) - tf.tanh(x) / pos
            + tf.maximum(x, 0.0) - tf.sigmoid(x) * tf.math.rsqrt(pos),
            tf.nn.softmax(x) + tf.nn.log_softmax(x),
            tf.linalg.band_part(tf.einsum("bij,bkj->bik", x, x), 1, 0),
            tf.fill(tf.shape(x)[:2], 2.0) * tf.reduce_mean(x, -1),
            unique_ids,
            unique_idx,
            tf.sparse.segment_sum(rows, unique_idx, segments, num_segments=5),
            tf.reshape(x, tf.stack([tf.shape(x)[0] * 2, -1])),
            tf.range(tf.shape(x)[0]) + tf.size(x),
            tf.broadcast_to(x[:, :1, :], tf.shape(x)) + tf.fill(tf.shape(x), tf.reduce_max(x)),
            tf.math.divide_no_nan(x, tf.round(x)) + tf.pow(pos, 1.5) + tf.nn.leaky_relu(x) + tf.nn.softplus(x)
            + tf.nn.elu(x) + tf.math.erf(x) + tf.zeros_like(x) + tf.ones_like(x),
            tf.math.floordiv(ids, 2) + tf.math.floormod(ids, 3),
            tf.nn.bias_add(tf.reshape(x, [-1, 4, 3, 1]), [1.0, 2.0, 3.0, 4.0], data_format="NCHW"),
            tf.matmul(x, x, adjoint_a=True) * tf.cast(tf.shape(x)[0], tf.float32),
            tf.raw_ops.Select(condition=x > 0, x=x, y=2 * x),
        )


MODELS = {"wide_deep": WideDeep, "dlrm": DLRM, "dcn": DCN, "transformer": Transformer, "ops": Ops}


def save_frozen_saved_model(graph_def, inputs, outputs, path):
    """A SavedModel whose graph is the frozen one (its variables folded into constants), with a
    serving signature whose keys sort in the input and output order."""
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        tensors = {name: graph.get_tensor_by_name(f"{name}:0") for name in inputs + outputs}
        signature = tf.compat.v1.saved_model.signature_def_utils.predict_signature_def(
            inputs={f"in{i}": tensors[name] for i, name in enumerate(inputs)},
            outputs={f"out{i}": tensors[name] for i, name in enumerate(outputs)},
        )
        with tf.compat.v1.Session(graph=graph) as session:
            builder = tf.compat.v1.saved_model.Builder(path)
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={"serving_default": signature})
            builder.save()


def freeze(model):
    concrete = tf.function(model.__call__).get_concrete_function(*model.signature())
    frozen = convert_variables_to_constants_v2(concrete)
    inputs = [t.name.split(":")[0] for t in frozen.inputs]
    outputs = [t.name.split(":")[0] for t in frozen.outputs]
    return frozen, frozen.graph.as_graph_def(), inputs, outputs


def time_ms(fn, args, iters):
    fn(*args), fn(*args)  # warm up
    return timeit.timeit(lambda: fn(*args), number=iters) / iters * 1e3


def main(out_dir, batch, time_iters):
    tf.random.set_seed(0)
    index = {}
    for name, cls in MODELS.items():
        model = cls()
        frozen, graph_def, inputs, outputs = freeze(model)
        values = model.inputs(batch)
        results = frozen(*[tf.constant(v) for v in values])
        results = results if isinstance(results, (list, tuple)) else [results]
        with open(os.path.join(out_dir, f"{name}.pb"), "wb") as f:
            f.write(graph_def.SerializeToString())
        arrays = {f"in:{i}": v for i, v in enumerate(values)}
        arrays.update({f"out:{i}": r.numpy() for i, r in enumerate(results)})
        np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
        index[name] = {"inputs": inputs, "outputs": outputs, "ops": sorted({n.op for n in graph_def.node})}
        if time_iters:
            index[name]["tf_ms"] = time_ms(tf.function(frozen), [tf.constant(v) for v in values], time_iters)
        if name == "wide_deep":
            save_frozen_saved_model(graph_def, inputs, outputs, os.path.join(out_dir, f"{name}_saved_model"))
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--time-iters", type=int, default=0, help="also time TensorFlow's forward")
    args = parser.parse_args()
    main(args.out_dir, args.batch, args.time_iters)
