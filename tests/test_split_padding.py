"""The paddings of one split's pieces become one padding (recompile.split_padding): the graph Inductor gets
pads once per split, builds fewer C++ kernels, and its outputs and gradients equal eager's; a piece whose user needs
it contiguous keeps its own padding."""

import pytest
import torch

from recompile.split_padding import pad_split_once
from tests.checks import inductor_on_captured, train_step

fbgemm = pytest.importorskip("fbgemm_gpu")


def paddings(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "jagged_to_padded_dense" in str(n.target)]


def captured(model, args, merge: bool, training: bool = False):
    return inductor_on_captured(model, args, pad_split_once if merge else (lambda gm: gm), training)


def test_hstu_pads_each_split_once():
    """The generative-recommenders HSTU (corpus): q, k and v, pieces of ``split(silu(x @ uvqk))``, are padded by one
    call per layer, whose source Inductor computes in one kernel (three before: one per piece); outputs equal
    eager's."""
    from models.corpus import gr_hstu

    model = gr_hstu.build()
    seq, lengths, _ = gr_hstu.batch(16)
    with torch.no_grad():
        want = model(seq, lengths)
    out, (graph,), kernels = captured(model, (seq, lengths), merge=True)
    plain, (before,), kernels_before = captured(model, (seq, lengths), merge=False)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-6)
    assert len(paddings(before)) == 3 * gr_hstu.LAYERS and len(paddings(graph)) == gr_hstu.LAYERS
    assert len(kernels) == len(kernels_before) - 2


def test_hstu_gradients_through_one_padding():
    """Training on the captured graph with the paddings merged: every gradient equals eager's."""
    from models.corpus import gr_hstu

    model = gr_hstu.build()
    seq, lengths, _ = gr_hstu.batch(16)
    (out_c, grads_c), (graph,), _ = captured(model, (seq, lengths), merge=True, training=True)
    out_e, grads_e = train_step(model, (seq, lengths))
    assert len(paddings(graph)) == gr_hstu.LAYERS
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)


class Pieces(torch.nn.Module):
    """Two pieces of a split padded with the same offsets; ``flat`` reads the second as ``view(-1)``, which a
    slice of a wider padding does not allow."""

    def __init__(self, flat: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12))
        self.flat = flat

    def forward(self, x, lengths):
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        a, b, c = torch.split(torch.tanh(x @ self.w), 4, dim=1)
        pa = torch.ops.fbgemm.jagged_to_padded_dense(a, [offsets], [5])
        pc = torch.ops.fbgemm.jagged_to_padded_dense(c, [offsets], [5], 0.0)
        tail = pc.view(-1).sum() if self.flat else pc.sum(1)
        return pa.sum(1) * 2 + tail + b.sum()


@pytest.mark.parametrize("flat", [False, True])
def test_pieces_merged_only_where_their_users_take_a_slice(flat):
    torch.manual_seed(0)
    model = Pieces(flat)
    lengths = torch.tensor([3, 5, 1, 4])
    x = torch.randn(int(lengths.sum()), 8)
    (out, grads), (graph,), _ = captured(model, (x, lengths), merge=True, training=True)
    want, want_grads = train_step(model, (x, lengths))
    assert len(paddings(graph)) == (2 if flat else 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["w"], want_grads["w"], rtol=1e-5, atol=1e-6)
