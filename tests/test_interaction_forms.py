"""Interaction layers as others write them (raw Parameters, TorchRec's cross nets, RecBole's layers, used unmodified):
each gets its region, computes what eager does (forward and gradients), and compiles at most twice over batch sizes."""
import functools

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from recompile.backend import rec_ascend
from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.pipeline import PassContext, run_pipeline

torchrec_crossnet = pytest.importorskip("torchrec.modules.crossnet")
N = 12  # features of a cross net's input


def pipeline_only(gm, example_inputs):
    """The rewritten graph run eagerly (custom ops with their autograd), without Inductor: fast to test."""
    ctx = PassContext(RecompileOptions(verify=True), detect_target("cpu"), example_inputs)
    return run_pipeline(gm, ctx).forward


class RawCross(nn.Module):
    """DCN-v2 with raw Parameters, ``x0 * (x @ W + b) + x``, the weight [in, out]."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.W = nn.ParameterList([nn.Parameter(torch.randn(N, N) / N) for _ in range(layers)])
        self.b = nn.ParameterList([nn.Parameter(torch.randn(N)) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for W, b in zip(self.W, self.b):
            x = x0 * (x @ W + b) + x
        return x


def recbole_cross(cls_name: str):
    """RecBole's cross network method on a module holding just the parameters it reads (the whole model needs a
    dataset); the method is RecBole's own, unmodified."""
    recbole = pytest.importorskip("recbole.model.context_aware_recommender.dcnv2")

    class Cross(nn.Module):
        cross_network = getattr(recbole, cls_name).cross_network

        def __init__(self, layers: int = 2):
            super().__init__()
            self.cross_layer_num = layers
            self.cross_layer_w = nn.ParameterList(nn.Parameter(torch.randn(N, N) / N) for _ in range(layers))
            self.bias = nn.ParameterList(nn.Parameter(torch.randn(N, 1)) for _ in range(layers))

        def forward(self, x):
            return self.cross_network(x)

    return Cross()


class RawVectorCross(nn.Module):
    """DCN-v1 with raw Parameters, ``x0 * (x . w) + b + x``, the dot written ``x @ w``, ``(x * w).sum(-1)`` or
    ``matmul(x, w.unsqueeze(-1))``."""

    def __init__(self, spelling: str = "matmul", layers: int = 3, bias: bool = True):
        super().__init__()
        self.spelling = spelling
        self.w = nn.ParameterList(nn.Parameter(torch.randn(N) / N) for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(N)) for _ in range(layers)) if bias else None

    def dot(self, x, w):
        if self.spelling == "matmul":
            return (x @ w).unsqueeze(1)
        if self.spelling == "sum":
            return (x * w).sum(-1, keepdim=True)
        return torch.matmul(x, w.unsqueeze(-1))

    def forward(self, x0):
        x = x0
        for layer, w in enumerate(self.w):
            x = x0 * self.dot(x, w) + self.b[layer] + x if self.b is not None else x0 * self.dot(x, w) + x
        return x


def recbole_dcn():
    """RecBole's DCN (v1) cross network, its method unmodified (the whole model needs a dataset)."""
    dcn = pytest.importorskip("recbole.model.context_aware_recommender.dcn")

    class Cross(nn.Module):
        cross_network = dcn.DCN.cross_network

        def __init__(self, layers: int = 3):
            super().__init__()
            self.cross_layer_num = layers
            self.cross_layer_w = nn.ParameterList(nn.Parameter(torch.randn(N) / N) for _ in range(layers))
            self.cross_layer_b = nn.ParameterList(nn.Parameter(torch.randn(N)) for _ in range(layers))

        def forward(self, x):
            return self.cross_network(x)

    return Cross()


def recbole_pnn():
    pnn = pytest.importorskip("recbole.model.context_aware_recommender.pnn")
    return pnn.InnerProductLayer(5, torch.device("cpu"))


def recbole_fm(reduce_sum: bool):
    layers = pytest.importorskip("recbole.model.layers")
    return layers.BaseFactorizationMachine(reduce_sum=reduce_sum)


class BufferDot(nn.Module):
    """DLRM's dot interaction with the pairs gathered by index buffers (``triu_indices`` kept on the module)."""

    def __init__(self, num_features: int = 6, dim: int = 4):
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)
        self.bottom = nn.Linear(3, dim)
        self.tables = nn.Parameter(torch.randn(num_features - 1, 10, dim))

    def forward(self, dense, ids):
        x = torch.relu(self.bottom(dense))
        features = torch.stack([x] + [t[ids[:, i]] for i, t in enumerate(self.tables)], 1)
        pairs = torch.bmm(features, features.transpose(1, 2))[:, self.rows, self.cols]
        return torch.cat([x, pairs], 1)


def _features(batch):
    return (torch.randn(batch, N),)


def _fields(batch):
    return (torch.randn(batch, 5, 4),)


def _dlrm(batch):
    return torch.randn(batch, 3), torch.randint(0, 10, (batch, 5))


# name -> (module factory, inputs of a batch, the regions expected: op -> count)
CASES = {
    "raw_parameters": (RawCross, _features, {"recompile::cross_stack": 1}),
    "torchrec_crossnet": (lambda: torchrec_crossnet.CrossNet(N, 2), _features, {"recompile::cross_stack": 1}),
    "torchrec_low_rank": (lambda: torchrec_crossnet.LowRankCrossNet(N, 3, low_rank=4), _features,
                          {"recompile::cross_stack": 1}),
    "torchrec_mixture": (lambda: torchrec_crossnet.LowRankMixtureCrossNet(N, 2, num_experts=3, low_rank=4),
                         _features, {"recompile::cross_mixture": 2}),
    "recbole_dcnv2": (lambda: recbole_cross("DCNV2"), _features, {"recompile::cross_stack": 1}),
    "torchrec_vector_crossnet": (lambda: torchrec_crossnet.VectorCrossNet(N, 2), _features,
                                 {"recompile::vector_cross": 1}),
    "recbole_dcn": (recbole_dcn, _features, {"recompile::vector_cross": 1}),
    "raw_vector_cross_matmul": (RawVectorCross, _features, {"recompile::vector_cross": 1}),
    "raw_vector_cross_sum": (lambda: RawVectorCross("sum"), _features, {"recompile::vector_cross": 1}),
    "raw_vector_cross_column": (lambda: RawVectorCross("column", bias=False), _features,
                                {"recompile::vector_cross": 1}),
    "recbole_pnn_inner_product": (recbole_pnn, _fields, {"recompile::dot_interaction": 1}),
    "recbole_fm": (lambda: recbole_fm(True), _fields, {"recompile::fm_second_order": 1}),
    "recbole_fm_per_dim": (lambda: recbole_fm(False), _fields, {"recompile::fm_second_order": 1}),
    "dlrm_index_buffers": (BufferDot, _dlrm, {"recompile::dot_interaction": 1}),
}


def _regions(model, args) -> dict[str, int]:
    found: dict[str, int] = {}
    for region in recompile.explain(model, *args).to_dict()["regions"]:
        if region["kind"] == "interaction":
            found[region["op"]] = found.get(region["op"], 0) + 1
    return found


def _run(model, args):
    model.zero_grad()
    args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = model(*args)
    out.pow(2).mean().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}
    grads.update({f"input{i}": a.grad for i, a in enumerate(args) if a.grad is not None})
    return out.detach(), grads


def _assert_same_training(compiled, model, args):
    out_c, grads_c = _run(compiled, args)
    out_e, grads_e = _run(model, args)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_form_found_equal_eager_and_compiled_at_most_twice(case):
    make, inputs, expected = CASES[case]
    torch.manual_seed(0)
    model = make()
    assert _regions(model, inputs(7)) == expected
    counter = CompileCounterWithBackend(pipeline_only)
    compiled = torch.compile(model, backend=counter)
    for batch in (3, 7, 12):
        _assert_same_training(compiled, model, inputs(batch))
    assert counter.frame_count <= 2


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_form_under_rec_ascend(case):
    """The whole backend (passes, Inductor, the race off so one candidate is compiled): same numbers, <= 2 compiles."""
    make, inputs, _ = CASES[case]
    torch.manual_seed(0)
    model = make()
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    compiled = torch.compile(model, backend=counter)
    for batch in (3, 7, 12):
        _assert_same_training(compiled, model, inputs(batch))
    assert counter.frame_count <= 2


def test_torchrec_dlrm_dcn_gets_its_cross_stack():
    """``torchrec.models.dlrm.DLRM_DCN`` (its ``LowRankCrossNet`` inside) with an ``EmbeddingBagCollection``."""
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f"f{i}"])
              for i in range(2)]
    model = DLRM_DCN(EmbeddingBagCollection(tables=tables), dense_in_features=3, dense_arch_layer_sizes=[8, 4],
                     over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=2)

    def batch(size):
        lengths = torch.randint(0, 3, (2 * size,))
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.randint(0, 20, (int(lengths.sum()),)), lengths)
        return torch.randn(size, 3), kjt

    dense, kjt = batch(5)
    ops = [r["op"] for r in recompile.explain(model, dense, kjt).to_dict()["regions"] if r["kind"] == "interaction"]
    assert ops == ["recompile::cross_stack"]
    compiled = torch.compile(model, backend=pipeline_only)
    torch.testing.assert_close(compiled(dense, kjt), model(dense, kjt), rtol=1e-5, atol=1e-5)


def test_cross_stack_backward_fake_for_transposed_weights():
    """``x @ W`` reaches the op as ``transpose(W, 0, 1)``: the fake's weight grads are contiguous like the kernel's."""
    from recompile.lowering import choose

    impl = choose("recompile::cross_stack", detect_target("cpu")).impl
    x0, weights = torch.randn(5, N), [torch.randn(N, N).t() for _ in range(2)]
    biases = [torch.randn(N) for _ in range(2)]
    out, saved = torch.ops.recompile.cross_stack(x0, x0, weights, biases, [], True, impl)
    args = (torch.randn_like(out), x0, x0, weights, [], saved, True)
    torch.library.opcheck(torch.ops.recompile.cross_stack_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))
