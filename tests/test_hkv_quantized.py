"""hkv tables storing row-wise quantized rows (int8 / int4, FBGEMM's fused layouts): lookups against the dequantized
reference on every probe kernel, inserts, eviction, growth, tiers, checkpoints, the modules, recompile.quantize."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hkv
import recompile
from hkv import checkpoint, kernels
from hkv.rowwise import dequantize_rows, packed_width, quantize_rows

DIM = 6
QDTYPES = ["int8", "int4"]
KERNELS = [k for k in kernels.KERNEL_NAMES if kernels.runs_on(k, torch.device("cpu"))]
POOL = torch.tensor([3, 2**40 + 1, 17, 2**62 + 5, 99, 123456789, 5, 2**33, -7, 1000])


def table(qdtype, **kw):
    args = dict(dim=DIM, init_capacity=64, max_capacity=1 << 12, bucket_size=16, dtype=qdtype)
    args.update(kw)
    return hkv.HashTable(**args)


def rows(n, seed=0, dim=DIM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 3


def roundtrip(values, qdtype):
    """What a quantized table reads back for stored ``values``."""
    return dequantize_rows(quantize_rows(values, qdtype), qdtype)


def stored(t):
    """(keys, packed rows, scores) sorted by key."""
    keys, packed, scores = t.export_batch(t.capacity(), stored=True)
    order = keys.argsort()
    return keys[order], packed[order], scores[order]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_find_equals_dequantized_reference(qdtype, id_dtype, kernel):
    t = table(qdtype, kernel=kernel)
    keys = torch.arange(200, dtype=id_dtype) * 7919 + 3
    values = rows(200)
    assert not t.insert_or_assign(keys, values).numel()
    probe = torch.cat([keys[::3], torch.tensor([4, 8], dtype=id_dtype)])  # two missing keys
    found_rows, found = t.find(probe)
    assert found_rows.dtype == torch.float32 and found.tolist() == [True] * 67 + [False, False]
    assert torch.equal(found_rows[:67], roundtrip(values[::3], qdtype))  # dequantized in the probe, exactly
    assert torch.equal(found_rows[67:], torch.zeros(2, DIM))
    k, packed, _ = stored(t)
    assert packed.shape == (200, packed_width(DIM, qdtype)) and packed.dtype == torch.uint8
    assert torch.equal(packed, quantize_rows(values[torch.argsort(keys.long())], qdtype))


OPS = st.lists(st.tuples(st.sampled_from(["insert", "find_or_insert", "assign", "erase"]),
                         st.lists(st.integers(0, len(POOL) - 1), max_size=8), st.integers(0, 2**31)), max_size=8)


@settings(max_examples=20, deadline=None)
@given(qdtype=st.sampled_from(QDTYPES), kernel=st.sampled_from([k for k in KERNELS if k != "triton"]), ops=OPS)
def test_any_op_sequence_reads_what_a_float_table_reads_quantized(qdtype, kernel, ops):
    """Duplicates in a batch, erases, inserts of present keys, a tiny table that grows: the quantized table's
    reads are always the float table's, round-tripped through the format (the interpreted Triton probe is checked
    above: too slow here)."""
    q, f = (table(d, kernel=kernel, init_capacity=4) for d in (qdtype, torch.float32))
    for op, picks, seed in ops:
        keys, values = POOL[picks], rows(len(picks), seed)
        for t in (q, f):
            if op == "insert":
                t.insert_or_assign(keys, values)
            elif op == "find_or_insert":
                t.find_or_insert(keys, init=values)
            elif op == "assign":
                t.assign(keys, values)
            else:
                t.erase(keys)
        (qv, qf), (fv, ff) = q.find(POOL), f.find(POOL)
        assert torch.equal(qf, ff) and q.size() == f.size()
        assert torch.equal(qv, roundtrip(fv, qdtype))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_find_or_insert_quantizes_new_rows_and_reads_stored_ones(qdtype, kernel):
    t = table(qdtype, kernel=kernel)
    old = rows(4, seed=1)
    t.insert_or_assign(POOL[:4], old)
    init = rows(len(POOL), seed=2)
    got = t.find_or_insert(POOL, init=init)
    assert torch.equal(got[:4], roundtrip(old, qdtype))  # present keys keep their rows
    assert torch.equal(got[4:], roundtrip(init[4:], qdtype))  # new keys read what was stored
    assert torch.equal(t.find(POOL)[0], got)
    # A table with admission returns the initial row of a key it did not store, unquantized.
    gated = table(qdtype, kernel=kernel, admission=hkv.CounterFilter(threshold=2))
    assert torch.equal(gated.find_or_insert(POOL[:2], init=init[:2]), init[:2])


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_eviction_growth_and_tiers_move_packed_bytes_unchanged(qdtype):
    # Eviction picks the same keys as a float table; stored rows evicted come out dequantized, refused new keys
    # with the values they were given.
    small = dict(init_capacity=16, max_capacity=16, bucket_size=16, evict_strategy=hkv.EvictStrategy.LFU)
    q, f = table(qdtype, **small), table(torch.float32, **small)
    keys, values = torch.arange(40) * 31 + 1, rows(40, seed=3)
    scores = torch.arange(40) % 7 + 1
    for t in (q, f):
        t.insert_or_assign(keys[:16], values[:16], scores[:16])
    eq, ef = (t.insert_and_evict(keys[16:], values[16:], scores[16:]) for t in (q, f))
    assert torch.equal(eq[0], ef[0]) and torch.equal(eq[2], ef[2])
    was_stored = torch.isin(ef[0], keys[:16])
    assert was_stored.any() and (~was_stored).any()
    assert torch.equal(eq[1], torch.where(was_stored[:, None], roundtrip(ef[1], qdtype), ef[1]))
    assert torch.equal(stored(q)[0], stored(f)[0])
    # Growth rehashes the packed rows as they are.
    t = table(qdtype, init_capacity=16)
    t.insert_or_assign(keys[:8], values[:8])
    before = stored(t)
    t.insert_or_assign(keys[8:], values[8:])
    assert t.capacity() > 16
    after = stored(t)
    assert torch.equal(after[1][torch.isin(after[0], before[0])], before[1])
    # Tiers: rows split over device and host memory, read the same.
    width = packed_width(DIM, qdtype)
    tiered = table(qdtype, device_memory_bytes=8 * width, host_memory_bytes=None)
    tiered.insert_or_assign(keys, values)
    tiered.migrate()
    assert tiered.tier_rows()["device"] == 8
    assert torch.equal(tiered.find(keys)[0], roundtrip(values, qdtype))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_accumulate_and_update_rows_requantize(qdtype):
    t = table(qdtype)
    keys, values, deltas = POOL[:3], rows(3, seed=4), rows(4, seed=5)
    t.insert_or_assign(keys, values)
    applied = t.accum_or_assign(POOL[[0, 0, 1, 9]], deltas, torch.tensor([True, True, True, True]))
    assert applied.tolist() == [True, True, True, False]  # POOL[9] is absent
    expect = roundtrip(values, qdtype)
    expect[0] += deltas[0] + deltas[1]
    expect[1] += deltas[2]
    assert torch.equal(t.find(keys)[0], roundtrip(expect, qdtype))
    t.update_rows(keys, lambda r, _: r * 2)
    assert torch.equal(t.find(keys)[0], roundtrip(roundtrip(expect, qdtype) * 2, qdtype))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_checkpoint_keeps_packed_bytes_and_refuses_another_format(qdtype, tmp_path):
    t = table(qdtype, evict_strategy=hkv.EvictStrategy.LFU)
    t.insert_or_assign(POOL, rows(len(POOL), seed=6), torch.arange(len(POOL)) + 1)
    path = str(tmp_path / "q.ckpt")
    t.save(path)
    back = hkv.HashTable.load(path)
    assert back.qdtype == qdtype and back.dim == DIM
    for a, b in zip(stored(t), stored(back)):
        assert torch.equal(a, b)  # codes, scale and bias byte for byte, and the scores
    assert torch.equal(back.find(POOL)[0], t.find(POOL)[0])
    float_table = table(torch.float32)
    with pytest.raises(hkv.CheckpointError, match=f"stores {qdtype} rows, the table float32 rows"):
        checkpoint.restore(float_table, *checkpoint.parse(checkpoint.dumps(t)))
    with pytest.raises(hkv.CheckpointError, match=f"stores float32 rows, the table {qdtype} rows"):
        checkpoint.restore(table(qdtype), *checkpoint.parse(checkpoint.dumps(float_table)))


def test_bad_dtype_names_the_table():
    with pytest.raises(ValueError, match="hkv table 'user': dtype 'int3' is not one of"):
        hkv.HashTable(4, 16, 64, dtype="int3", name="hkv table 'user'")
    with pytest.raises(ValueError, match="hkv table 'item'.*int4 packs two columns.*dim 5 is odd"):
        hkv.DynamicEmbeddingBag(hkv.DynamicEmbTableOptions(dim=5, max_capacity=64, embedding_dtype="int4"),
                                name="item")
    model = nn.Sequential(hkv.DynamicEmbeddingBag(hkv.DynamicEmbTableOptions(dim=5, max_capacity=64))).eval()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="recompile.quantize: table '0'.*dim 5 is odd"):
        recompile.quantize(model, "int4")


def module(qdtype, mode="sum", **kw):
    init = hkv.DynamicEmbInitializerArgs(mode=hkv.DynamicEmbInitializerMode.UNIFORM)
    opts = hkv.DynamicEmbTableOptions(dim=DIM, max_capacity=256, init_capacity=64, bucket_capacity=16,
                                      embedding_dtype=qdtype, initializer_args=init, **kw)
    return hkv.DynamicEmbeddingBag(opts, mode, name="ads")


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_module_lookups_missing_ids_and_refused_training_step(qdtype):
    torch.manual_seed(0)
    emb = module(qdtype, eval_initializer_args=hkv.DynamicEmbInitializerArgs(
        mode=hkv.DynamicEmbInitializerMode.CONSTANT, value=0.5))
    ids, offsets = POOL[[0, 1, 1, 2, 9]], torch.tensor([0, 2, 2])
    out = emb(ids, offsets)  # training mode: inserts the ids with quantized initial rows
    table_rows = emb.table.find(POOL)[0]
    assert torch.equal(out, F.embedding_bag(torch.tensor([0, 1, 1, 2, 9]), table_rows, offsets, mode="sum"))
    assert torch.equal(table_rows[[0, 1, 2, 9]], roundtrip(table_rows[[0, 1, 2, 9]], qdtype))
    with pytest.raises(RuntimeError, match=f"hkv table 'ads': stores {qdtype} rows.*no optimizer step"):
        out.sum().backward()
    emb.eval()
    unseen = emb(torch.tensor([424242, 3]), torch.tensor([0, 1]))
    assert torch.equal(unseen[0], torch.full((DIM,), 0.5))  # a missing id: the eval initializer's row
    assert torch.equal(unseen[1], table_rows[0])
    # state_dict round trip keeps the packed rows.
    other = module(qdtype)
    other.load_state_dict(emb.state_dict())
    for a, b in zip(stored(emb.table), stored(other.table)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_recompile_quantize_converts_hkv_tables_eager_and_compiled(qdtype):
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    cfg = DLRMConfig(table_rows=[50, 80, 30], dim=8, bottom=[8, 8], top=[8, 1], dynamic_embeddings=True)
    torch.manual_seed(0)
    model = DLRM(cfg)
    dense, indices, offsets = synthetic_batch(cfg, 16, torch.Generator().manual_seed(1))
    model(dense, indices, offsets)  # training mode: the tables insert the batch's ids
    model.eval().requires_grad_(False)
    served = recompile.quantize(model, qdtype)
    reference = copy.deepcopy(model)  # float tables holding the dequantized rows
    for f, q, r in zip(*(tables_of(m) for m in (model, served, reference))):
        assert f.table.qdtype is None and q.table.qdtype == qdtype  # the original is untouched
        keys, values, _ = f.table.export_batch(f.table.capacity())
        assert torch.equal(stored(q.table)[0], keys.sort()[0])
        r.table.insert_or_assign(keys, roundtrip(values, qdtype))
    with torch.no_grad():
        expected = reference(dense, indices, offsets)
        torch.testing.assert_close(served(dense, indices, offsets), expected, rtol=1e-6, atol=1e-6)
        compiled = torch.compile(served, backend="rec_ascend")
        torch.testing.assert_close(compiled(dense, indices, offsets), expected, rtol=1e-6, atol=1e-6)


def tables_of(model):
    return [m for m in model.modules() if isinstance(m, hkv.DynamicEmbeddingBag)]
