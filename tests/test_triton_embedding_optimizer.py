"""The fused optimizers' Triton step (runtime/triton_kernels/embedding_optimizer.py, TRITON_INTERPRET=1 here):
every table's touched rows in one launch, equal to the reference step (weights and optimizer state) over
repeated ids, empty bags, MEAN pooling with a padding id, per-sample weights, every layout and three steps."""
import pytest
import torch

from recompile.runtime import embedding_optimizer
from recompile.runtime.embedding import MEAN, NONE, SUM
from recompile.runtime.embedding_optimizer import OPTIMIZERS, format_optimizer
from recompile.runtime.triton_kernels import embedding_optimizer as kernels

ops = torch.ops.recompile


def _group(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    dims = [3, 5, 4] if layout == "concat" else [4, 4, 4]
    rows = [6, 9, 1]  # the last table: one row, every id repeats it
    weights = [torch.randn(r, d, generator=gen) for r, d in zip(rows, dims)]
    if layout == "sequence":
        ids = [torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows, (7, 0, 3))]
        return weights, ids, [None] * 3, [torch.empty(0)] * 3, [NONE] * 3, [-1] * 3, [False] * 3
    batch = 5
    lengths = [torch.randint(0, 5, (batch,), generator=gen) for _ in rows]  # empty bags among them
    ids = [torch.randint(0, r, (int(n.sum()),), generator=gen) for r, n in zip(rows, lengths)]
    offsets = [torch.cumsum(n, 0) - n for n in lengths]
    psw = [torch.rand(ids[0].shape, generator=gen), torch.empty(0), torch.empty(0)]
    return weights, ids, offsets, psw, [SUM, MEAN, SUM], [-1, 2, -1], [False] * 3


def _run(impl, group, layout, kind, steps=3):
    weights, *lookup = group
    tables = [w.clone() for w in weights]
    width = {"concat": sum(w.shape[1] for w in tables), "stack": len(tables) * 4, "sequence": 4}[layout]
    gen = torch.Generator().manual_seed(7)
    rows = sum(i.numel() for i in lookup[0]) if layout == "sequence" else lookup[1][0].numel()
    shape = (rows, 3, 4) if layout == "stack" else (rows, width)
    for _ in range(steps):
        grad = torch.randn(shape, generator=gen)
        ops.embedding_optimizer_step(grad, tables, *lookup, layout, "a,b,c", "fatal",
                                     format_optimizer(kind, lr=0.1, eps=1e-6), impl)
    return tables, [embedding_optimizer.STATES.get(t, {}).get(kind, {}) for t in tables]


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("layout", ["concat", "stack", "sequence"])
def test_triton_step_matches_reference(kind, layout):
    group = _group(layout, seed=OPTIMIZERS.index(kind))
    got, got_states = _run("triton", group, layout, kind)
    want, want_states = _run("reference", group, layout, kind)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_states, want_states):
        assert g.keys() == w.keys()
        for key in w:
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-6)


def test_one_launch_for_every_table(monkeypatch):
    launches = []
    kernel = kernels._step_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(kernels, "_step_kernel", Counting())
    _run("triton", _group("concat", 0), "concat", "adam", steps=1)
    assert len(launches) == 1
