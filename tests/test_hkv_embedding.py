"""hkv.DynamicEmbedding(Bag): training against dense embeddings with torch's optimizers, eval, state_dict."""
import pytest
import torch
import torch.nn as nn

import hkv

DIM = 4
POOL = torch.tensor([3, 2**40 + 1, 17, 2**62 + 5, 99, 123456789, 5, 2**33])


def options(**kw):
    args = dict(dim=DIM, max_capacity=256, init_capacity=64, bucket_capacity=16)
    args.update(kw)
    return hkv.DynamicEmbTableOptions(**args)


def batches(steps=4, bags=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (bags,), generator=gen)  # empty bags included
        ids = POOL[torch.randint(0, len(POOL), (int(lengths.sum()),), generator=gen)]
        yield ids, torch.cumsum(lengths, 0) - lengths


class RowWiseAdagradRef:
    """FBGEMM's exact row-wise Adagrad on a dense weight with sparse gradients."""

    def __init__(self, weight, lr, eps):
        self.weight, self.lr, self.eps = weight, lr, eps
        self.acc = torch.zeros(weight.shape[0], 1)

    def step(self):
        g = self.weight.grad.coalesce()
        rows, vals = g.indices()[0], g.values()
        self.acc[rows] += (vals * vals).mean(1, keepdim=True)
        with torch.no_grad():
            self.weight[rows] -= self.lr * vals / (self.acc[rows].sqrt() + self.eps)

    def zero_grad(self):
        self.weight.grad = None


OPTIMIZERS = {
    "sgd": (hkv.SGD(0.1), lambda w: torch.optim.SGD([w], lr=0.1)),
    "adagrad": (hkv.Adagrad(0.1, eps=1e-10), lambda w: torch.optim.Adagrad([w], lr=0.1, eps=1e-10)),
    "rowwise_adagrad": (hkv.RowWiseAdagrad(0.1, eps=1e-10), lambda w: RowWiseAdagradRef(w, 0.1, 1e-10)),
    "adam": (hkv.Adam(0.05), lambda w: torch.optim.SparseAdam([w], lr=0.05)),
}


@pytest.mark.parametrize("mode", ["sum", "mean", "none"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_matches_dense_embedding_with_torch_optimizer(name, mode):
    ours, make_ref = OPTIMIZERS[name]
    dyn = hkv.DynamicEmbeddingBag(options(), mode=mode, optimizer=ours)
    dyn.table.find_or_insert(POOL, init=dyn.runtime._init_rows)  # same starting rows for both
    ref = nn.EmbeddingBag(len(POOL), DIM, mode=mode if mode != "none" else "sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(dyn.table.find(POOL)[0][:, :DIM])
    ref_opt = make_ref(ref.weight)
    row = {int(k): i for i, k in enumerate(POOL)}
    for ids, offsets in batches():
        dense = torch.tensor([row[int(k)] for k in ids], dtype=torch.int64)
        out = dyn(ids, offsets) if mode != "none" else dyn(ids)
        expect = ref(dense, offsets) if mode != "none" else ref(dense, torch.arange(len(dense)))
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
        target = torch.randn_like(out)
        (out * target).sum().backward()
        ref_opt.zero_grad()
        (expect * target).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(dyn.table.find(POOL)[0][:, :DIM], ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_eval_never_inserts_and_uses_eval_initializer():
    dyn = hkv.DynamicEmbedding(options(eval_initializer_args=hkv.DynamicEmbInitializerArgs(
        mode=hkv.DynamicEmbInitializerMode.CONSTANT, value=0.25)))
    seen = dyn(POOL[:3])
    dyn.eval()
    out = dyn(POOL[:5])
    assert dyn.table.size() == 3
    torch.testing.assert_close(out[:3], seen)
    torch.testing.assert_close(out[3:], torch.full((2, DIM), 0.25))


@pytest.mark.parametrize("args, lo, hi", [
    (dict(mode=hkv.DynamicEmbInitializerMode.UNIFORM, lower=-0.1, upper=0.2), -0.1, 0.2),
    (dict(mode=hkv.DynamicEmbInitializerMode.TRUNCATED_NORMAL, mean=1.0, std_dev=0.5), 0.0, 2.0),
    (dict(mode=hkv.DynamicEmbInitializerMode.CONSTANT, value=0.3), 0.3, 0.3),
])
def test_initializers(args, lo, hi):
    dyn = hkv.DynamicEmbedding(options(max_capacity=4096, initializer_args=hkv.DynamicEmbInitializerArgs(**args)))
    out = dyn(torch.arange(1000)).detach()
    assert lo - 1e-6 <= float(out.min()) and float(out.max()) <= hi + 1e-6
    assert (out.unique().numel() > 1000) == (lo != hi)


def test_state_dict_round_trip_continues_training_identically():
    a = hkv.DynamicEmbeddingBag(options(), optimizer=hkv.Adam(0.05))
    data = list(batches(steps=4))
    for ids, offsets in data[:2]:
        a(ids, offsets).sum().backward()
    b = hkv.DynamicEmbeddingBag(options(), optimizer=hkv.Adam(0.05))
    b.load_state_dict(a.state_dict())
    for step, (ids, offsets) in enumerate(data[2:]):
        torch.manual_seed(step)  # ids first seen now get the same random initial rows in both
        oa = a(ids, offsets)
        torch.manual_seed(step)
        ob = b(ids, offsets)
        torch.testing.assert_close(oa, ob)
        oa.sum().backward()
        ob.sum().backward()
    torch.testing.assert_close(a.table.find(POOL)[0], b.table.find(POOL)[0])
    corrupt = a.state_dict()
    corrupt["table"][-1] ^= 1
    with pytest.raises(hkv.CheckpointError, match="checksum mismatch"):
        b.load_state_dict(corrupt)


def test_admission_in_training():
    dyn = hkv.DynamicEmbedding(options(admit_strategy=hkv.CounterFilter(2), initializer_args=
                                       hkv.DynamicEmbInitializerArgs(mode=hkv.DynamicEmbInitializerMode.CONSTANT,
                                                                     value=1.0)), optimizer=hkv.SGD(0.5))
    ids = torch.tensor([42])
    dyn(ids).sum().backward()  # not admitted yet: initial value, no row, no update
    assert dyn.table.size() == 0
    out = dyn(ids)
    torch.testing.assert_close(out, torch.ones(1, DIM))
    out.sum().backward()
    torch.testing.assert_close(dyn(ids), torch.full((1, DIM), 0.5))


def test_bad_mode_and_missing_offsets():
    with pytest.raises(ValueError, match="mode must be one of"):
        hkv.DynamicEmbeddingBag(options(), mode="max")
    with pytest.raises(ValueError, match="needs offsets"):
        hkv.DynamicEmbeddingBag(options())(POOL)


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_lowered_ops_with_each_kernel(impl):
    dyn = hkv.DynamicEmbedding(options(), optimizer=hkv.SGD(0.1))
    ids = POOL[torch.tensor([0, 1, 2, 0, 1])]
    uniq, inverse, n, grouping = torch.ops.hkv.unique(ids, True, dyn.table_id)
    assert int(n) == 3 and torch.equal(uniq[inverse], ids)
    rows = torch.ops.hkv.lookup(dyn.weight, uniq, n, grouping, dyn.table_id, True, impl)
    assert dyn.table.size() == 3
    torch.testing.assert_close(rows[:3], dyn.table.find(uniq[:3])[0])
    assert not rows[3:].any()
    torch.ops.hkv.update(torch.ones_like(rows), uniq, n, dyn.table_id, impl)
    torch.testing.assert_close(dyn.table.find(uniq[:3])[0], rows[:3] - 0.1)
    with pytest.raises(ValueError, match="unknown kernel 'nosuch'"):
        torch.ops.hkv.lookup(dyn.weight, uniq, n, grouping, dyn.table_id, True, "nosuch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_batches_int32_ids_and_half_tables(dtype):
    dyn = hkv.DynamicEmbeddingBag(options(embedding_dtype=dtype), mode="mean", optimizer=hkv.Adam(0.1))
    out = dyn(torch.empty(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    assert out.shape == (3, DIM) and out.dtype == dtype and not out.any()
    out.sum().backward()
    ids = torch.tensor([1, 2, 3, 2], dtype=torch.int32)
    out = dyn(ids, torch.tensor([0, 0, 3]))
    out.float().sum().backward()
    assert dyn.table.size() == 3 and out.dtype == dtype
    assert not out[0].any()  # the empty bag
    assert bool(dyn.table.contains(ids.long()).all())


def test_deepcopy_gives_an_independent_table():
    import copy

    a = hkv.DynamicEmbedding(options(), optimizer=hkv.SGD(0.5))
    before = a(POOL[:3]).detach()
    b = copy.deepcopy(a)
    assert b.table_id != a.table_id
    b(POOL[:3]).sum().backward()
    b(POOL[3:5])
    torch.testing.assert_close(a(POOL[:3]), before)
    assert a.table.size() == 3 and b.table.size() == 5
    tiered = hkv.HashTable(DIM, 64, 64, device_memory_bytes=64)
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(tiered)


@pytest.mark.parametrize("strategy", [hkv.EvictStrategy.LRU, hkv.EvictStrategy.LFU])
def test_prefetcher_inserts_next_batch_and_keeps_training_identical(strategy):
    const = hkv.DynamicEmbInitializerArgs(mode=hkv.DynamicEmbInitializerMode.CONSTANT, value=0.1)
    plain, fetched = (hkv.DynamicEmbeddingBag(options(initializer_args=const, evict_strategy=strategy),
                                              optimizer=hkv.Adagrad(0.1)) for _ in range(2))
    data = list(batches(steps=5, seed=7))
    for ids, offsets in data:
        plain(ids, offsets).pow(2).sum().backward()
    for ids, offsets in hkv.Prefetcher(data, lambda b: [(fetched, b[0])]):
        assert bool(fetched.table.contains(ids).all())  # inserted before the step
        fetched(ids, offsets).pow(2).sum().backward()
    got, want = fetched.table.find(POOL, return_scores=True), plain.table.find(POOL, return_scores=True)
    torch.testing.assert_close(got[:2], want[:2])
    if strategy is hkv.EvictStrategy.LFU:  # a prefetch is no use: the counts are the lookups'
        assert torch.equal(got[2], want[2])


def test_prefetcher_leaves_tables_with_admission_alone():
    plain, fetched = (hkv.DynamicEmbeddingBag(options(admit_strategy=hkv.CounterFilter(2))) for _ in range(2))
    data = list(batches(steps=3, seed=5))
    for ids, offsets in hkv.Prefetcher(data, lambda b: [(fetched, b[0])]):
        fetched(ids, offsets)
    for ids, offsets in data:
        plain(ids, offsets)
    batches_with = {k: sum(k in ids.tolist() for ids, _ in data) for k in POOL.tolist()}
    assert 0 < fetched.table.size() == sum(n >= 2 for n in batches_with.values()) < len(POOL)
    assert torch.equal(fetched.table.contains(POOL), plain.table.contains(POOL))


@pytest.mark.parametrize("mode", ["sum", "mean", "none"])
def test_pool_backward_matches_autograd(mode):
    """hkv.ops.pool_backward (the C kernel for float32 bags, torch otherwise) against autograd of pool."""
    from hkv import ops

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 0, 3, 1, 0, 4])  # empty bags included
    inverse = torch.randint(0, 5, (int(lengths.sum()),), generator=gen)
    offsets = torch.cumsum(lengths, 0) - lengths
    for dtype in (torch.float32, torch.float64):
        rows = torch.randn(5, DIM, dtype=dtype, generator=gen, requires_grad=True)
        out = ops.pool(rows, inverse, offsets, mode)
        grad = torch.randn(out.shape, dtype=dtype, generator=gen)
        out.backward(grad)
        torch.testing.assert_close(ops.pool_backward(grad, inverse, offsets, mode, 5), rows.grad)
