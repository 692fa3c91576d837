"""A legacy tensor type called on data becomes ``torch.tensor`` before Inductor (recompile.legacy_constructors): the
graph then passes AOT autograd's cache check, which it failed (a warm compile traced it again), and outputs and
gradients equal eager's; a legacy type called on a size is left as it is."""
import operator

import pytest
import torch
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable
from torch._subclasses.fake_tensor import FakeTensorMode

from recompile.legacy_constructors import LEGACY_TYPES, legacy_constructors_as_tensor
from tests.checks import inductor_on_captured, train_step


class MeanPooling(torch.nn.Module):
    """RecBole's mean pooling of a token sequence field (``ContextRecommender.embed_token_seq_fields``): the embedded
    ids summed over the positions holding one, over their count plus ``torch.FloatTensor([1e-8])``."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 8, padding_idx=0)

    def forward(self, seq):
        mask = (seq != 0).float()
        total = (self.embedding(seq) * mask.unsqueeze(2)).sum(1)
        eps = torch.FloatTensor([1e-8])
        return total / (mask.sum(1, keepdim=True) + eps)


def legacy_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LEGACY_TYPES]


def adding(legacy, arg) -> torch.fx.GraphModule:
    """``x + legacy(arg)`` as a graph (symbolic tracing would run the call), ``x`` a fake 0-d tensor of the type's
    dtype."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = FakeTensorMode().from_tensor(torch.zeros((), dtype=legacy.dtype))
    graph.output(graph.call_function(operator.add, (x, graph.call_function(legacy, (arg,)))))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_mean_pooling_passes_the_autograd_cache_check_with_eagers_numbers():
    torch.manual_seed(0)
    model, args = MeanPooling(), (torch.randint(0, 20, (16, 5)),)
    want, want_grads = train_step(model, args)
    (got, grads), (graph,), _ = inductor_on_captured(model, args, legacy_constructors_as_tensor, training=True)
    _, (before,), _ = inductor_on_captured(model, args, lambda gm: gm, training=True)
    assert len(legacy_calls(before)) == 1 and not legacy_calls(graph)
    with pytest.raises(BypassAOTAutogradCache, match="FloatTensor"):
        check_cacheable(before)
    check_cacheable(graph)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() == {"embedding.weight"}
    torch.testing.assert_close(grads["embedding.weight"], want_grads["embedding.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("data", [[1e-8], [[1, 2], [3, 4]], (True, False)])
@pytest.mark.parametrize("legacy", [torch.FloatTensor, torch.LongTensor, torch.BoolTensor])
def test_the_tensor_made_is_the_legacy_types(legacy, data):
    gm = adding(legacy, data)
    rewritten = legacy_constructors_as_tensor(gm)
    assert len(legacy_calls(gm)) == 1 and not legacy_calls(rewritten)
    x = torch.zeros((), dtype=legacy.dtype)
    got, want = rewritten(x), gm(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_legacy_type_called_on_a_size_is_left_as_it_is():
    assert legacy_constructors_as_tensor(gm := adding(torch.FloatTensor, 3)) is gm
