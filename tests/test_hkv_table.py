"""hkv.HashTable against a Python dict model, eviction semantics, growth, tiers, admission, threads."""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hkv
from hkv.table import mix64

DIM = 3


def table(**kw):
    args = dict(dim=DIM, init_capacity=64, max_capacity=1 << 14, bucket_size=16)
    args.update(kw)
    return hkv.HashTable(**args)


def keys_of(xs):
    return torch.tensor(xs, dtype=torch.int64)


def check_against(t, model, probe):
    values, found = t.find(keys_of(probe))
    for i, k in enumerate(probe):
        assert bool(found[i]) == (k in model), k
        expect = model.get(k, torch.zeros(DIM))
        torch.testing.assert_close(values[i], expect, msg=f"key {k}")
    assert t.size() == len(model)


# Keys from a small pool (many duplicates inside a batch), including large and negative 64-bit values.
POOL = [0, 1, 2, 3, 7, 64, 65, 1000, 2**40 + 3, 2**62 + 11, -5, -(2**63), 2**63 - 1, 12345678901]
key_lists = st.lists(st.sampled_from(POOL), min_size=0, max_size=12)
ops = st.lists(st.tuples(st.sampled_from(["insert", "find_or_insert", "assign", "accum", "erase"]), key_lists,
                         st.integers(0, 2**31)), max_size=12)


@pytest.mark.parametrize("kernel", ["reference", "cpu", "triton"])
@settings(max_examples=40, deadline=None)
@given(sequence=ops)
def test_random_op_sequences_match_dict(kernel, sequence):
    t, model = table(kernel=kernel), {}
    for op, ks, seed in sequence:
        gen = torch.Generator().manual_seed(seed)
        keys = keys_of(ks)
        vals = torch.randn(len(ks), DIM, generator=gen)
        if op == "insert":
            assert t.insert_or_assign(keys, vals).numel() == 0
            for k, v in zip(ks, vals):
                model[k] = v
        elif op == "find_or_insert":
            out = t.find_or_insert(keys, init=vals)
            for i, k in enumerate(ks):
                model.setdefault(k, vals[max(j for j, x in enumerate(ks) if x == k)])
                torch.testing.assert_close(out[i], model[k])
        elif op == "assign":
            found = t.assign(keys, vals)
            for i, k in enumerate(ks):
                assert bool(found[i]) == (k in model)
            for k, v in zip(ks, vals):
                if k in model:
                    model[k] = v
        elif op == "accum":
            flags = torch.randint(0, 2, (len(ks),), generator=gen).bool()
            applied = t.accum_or_assign(keys, vals, flags)
            for i, (k, v, f) in enumerate(zip(ks, vals, flags.tolist())):  # as if applied in order
                assert bool(applied[i]) == (not f or k in model)
                if not f:
                    model[k] = v
                elif k in model:
                    model[k] = model[k] + v
        else:
            assert t.erase(keys) == len(set(ks) & set(model))
            for k in ks:
                model.pop(k, None)
        check_against(t, model, POOL)


def test_reserved_keys_rejected():
    t = table()
    for bad in hkv.RESERVED_KEYS:
        with pytest.raises(ValueError, match="reserved key"):
            t.insert_or_assign(keys_of([1, bad]), torch.zeros(2, DIM))
    with pytest.raises(ValueError, match="must be a 1-D tensor"):
        t.find(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"values must have shape \(2, 3\)"):
        t.insert_or_assign(keys_of([1, 2]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="CUSTOMIZED needs scores"):
        table(evict_strategy=hkv.EvictStrategy.CUSTOMIZED).insert_or_assign(keys_of([1]), torch.zeros(1, DIM))


def one_bucket_keys(t, n, start=0):
    """``n`` distinct keys that hash to bucket 0 of ``t``."""
    k = torch.arange(start, start + 64 * n * t.capacity() // t.bucket_size)
    base = (mix64(k) & (t.capacity() // t.bucket_size - 1))
    return k[base == 0][:n]


def sequential_bucket(entries, bucket_size, inserts):
    """Reference: a bucket (key -> score) after inserting ``inserts`` one by one, HierarchicalKV rules."""
    bucket, refused = dict(entries), []
    for k, s in inserts:
        if k in bucket:
            bucket[k] = s
        elif len(bucket) < bucket_size:
            bucket[k] = s
        else:
            low = min(bucket, key=bucket.get)
            if s >= bucket[low]:
                del bucket[low]
                bucket[k] = s
            else:
                refused.append(k)
    return bucket, refused


@pytest.mark.parametrize("kernel", ["reference", "cpu"])
@settings(max_examples=30, deadline=None)
@given(old_scores=st.lists(st.integers(0, 100), min_size=8, max_size=8),
       new_scores=st.lists(st.integers(0, 100), min_size=1, max_size=12))
def test_full_bucket_evicts_lowest_and_refuses_lower(kernel, old_scores, new_scores):
    t = table(init_capacity=32, max_capacity=32, bucket_size=8, evict_strategy=hkv.EvictStrategy.CUSTOMIZED,
              kernel=kernel)
    ks = one_bucket_keys(t, 8 + len(new_scores))
    old, new = ks[:8], ks[8:]
    t.insert_or_assign(old, torch.randn(8, DIM), scores=keys_of(old_scores))
    # the reference applies new keys in descending score order (the batch's order among equals is free)
    ordered = sorted(zip(new.tolist(), new_scores), key=lambda x: -x[1])
    bucket, refused = sequential_bucket(zip(old.tolist(), old_scores), 8, ordered)
    ev_keys, ev_values, ev_scores = t.insert_and_evict(new, torch.randn(len(new), DIM), scores=keys_of(new_scores))
    stored = t.export_batch(t.capacity())
    assert sorted(stored[2].tolist()) == sorted(bucket.values())
    assert t.size() == 8
    # every key that went in is either stored or reported evicted/refused, never silently lost
    everything = set(old.tolist()) | set(new.tolist())
    assert set(stored[0].tolist()) | set(ev_keys.tolist()) == everything
    assert not set(stored[0].tolist()) & set(ev_keys.tolist())
    assert len(refused) <= ev_keys.numel()


def test_lru_evicts_least_recent_and_lfu_least_frequent():
    for strategy in (hkv.EvictStrategy.LRU, hkv.EvictStrategy.LFU):
        t = table(init_capacity=32, max_capacity=32, bucket_size=8, evict_strategy=strategy)
        ks = one_bucket_keys(t, 9)
        for k in ks[:8]:
            t.insert_or_assign(k.view(1), torch.randn(1, DIM))
        t.find_or_insert(ks[1:8])  # touch all but ks[0]: most recent (LRU), seen twice (LFU)
        ev_keys, _, _ = t.insert_and_evict(ks[8:], torch.randn(1, DIM))
        assert ev_keys.tolist() == [int(ks[0])], strategy
        assert bool(t.contains(ks[8:]).all())


def test_lfu_counts_duplicates_and_epoch_scores():
    t = table(evict_strategy=hkv.EvictStrategy.LFU)
    t.insert_or_assign(keys_of([5, 5, 6]), torch.randn(3, DIM), scores=keys_of([2, 3, 1]))
    t.insert_or_assign(keys_of([6]), torch.randn(1, DIM), scores=keys_of([4]))
    assert t.find(keys_of([5, 6]), return_scores=True)[2].tolist() == [5, 5]
    t = table(evict_strategy=hkv.EvictStrategy.EPOCH_LFU)
    t.set_global_epoch(7)
    t.insert_or_assign(keys_of([1, 1]), torch.randn(2, DIM))
    assert t.find(keys_of([1]), return_scores=True)[2].tolist() == [(7 << 32) | 2]
    t = table(evict_strategy=hkv.EvictStrategy.EPOCH_LRU)
    t.set_global_epoch(3)
    t.insert_or_assign(keys_of([1]), torch.randn(1, DIM))
    assert t.find(keys_of([1]), return_scores=True)[2].tolist()[0] >> 32 == 3


def test_growth_keeps_every_key():
    t = table(init_capacity=64, max_capacity=1 << 13, max_load_factor=0.5)
    ks = torch.randint(-(2**62), 2**62, (3000,))
    ks = ks[(ks < -3) | (ks >= 0)]
    vals = torch.randn(ks.numel(), DIM)
    for c in range(0, ks.numel(), 500):
        t.insert_or_assign(ks[c:c + 500], vals[c:c + 500])
        assert t.load_factor() <= 0.5
    assert t.capacity() == 8192
    out, found = t.find(ks)
    assert bool(found.all())
    torch.testing.assert_close(out, vals)
    t.reserve(1 << 13)
    t.erase_if(lambda keys, scores: keys % 2 == 0)
    assert t.size() == int((ks % 2 != 0).sum())


def test_erase_if_and_export_batch_if_by_score():
    t = table(evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    ks = keys_of(list(range(10, 30)))
    t.insert_or_assign(ks, torch.randn(20, DIM), scores=ks * 10)
    k, v, s = t.export_batch_if(200)
    assert sorted(k.tolist()) == list(range(20, 30)) and bool((s >= 200).all())
    torch.testing.assert_close(v, t.find(k)[0])
    assert t.erase_if(150) == 5
    assert sorted(t.export_batch(1000)[0].tolist()) == list(range(15, 30))
    t.assign_scores(keys_of([15]), keys_of([1]))
    assert t.find(keys_of([15]), return_scores=True)[2].tolist() == [1]
    t.clear()
    assert t.size() == 0 and not t.contains(ks).any()


def test_threads_insert_concurrently():
    t = table(max_capacity=1 << 15)
    batches = [torch.arange(i * 1000, (i + 1) * 1000) for i in range(6)]

    def work(ks):
        for c in range(0, 1000, 100):
            t.insert_or_assign(ks[c:c + 100], ks[c:c + 100, None].float().expand(-1, DIM))
            t.find(ks[:c + 100])

    threads = [threading.Thread(target=work, args=(b,)) for b in batches]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    allk = torch.cat(batches)
    out, found = t.find(allk)
    assert bool(found.all()) and t.size() == 6000
    torch.testing.assert_close(out[:, 0], allk.float())


def test_tiers_hold_values_and_migrate_hot_rows(tmp_path):
    row_bytes = DIM * 4
    t = table(init_capacity=256, max_capacity=256, bucket_size=256, max_load_factor=1.0,
              device_memory_bytes=32 * row_bytes,
              host_memory_bytes=64 * row_bytes, disk_path=str(tmp_path / "values.bin"),
              evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    assert t.tier_rows() == {"device": 32, "host": 64, "disk": 160}
    ks = torch.arange(100, 300)
    vals = torch.randn(200, DIM)
    t.insert_or_assign(ks, vals, scores=ks)
    torch.testing.assert_close(t.find(ks)[0], vals)
    t.migrate()
    torch.testing.assert_close(t.find(ks)[0], vals)
    hottest = t._locate(ks[-32:])
    assert bool((t._values.tier_of_slots(hottest) == 0).all())
    assert bool((t._values.tier_of_slots(t._locate(ks[:50])) == 2).all())
    with pytest.raises(ValueError, match="give disk_path"):
        table(init_capacity=256, max_capacity=256, device_memory_bytes=row_bytes, host_memory_bytes=row_bytes)


@pytest.mark.parametrize("make", [lambda: hkv.CounterFilter(3), lambda: hkv.CBFFilter(3, num_counters=1 << 12)])
def test_admission_stores_key_after_threshold(make):
    t = table(admission=make())
    ks = keys_of([11, 22])
    for seen in range(1, 4):
        out = t.find_or_insert(ks, init=torch.full((DIM,), 0.5))
        torch.testing.assert_close(out, torch.full((2, DIM), 0.5))
        assert bool(t.contains(ks).all()) == (seen >= 3)
        if seen < 3:
            assert t.admission.count(ks).tolist() == [seen, seen]
    t.insert_or_assign(keys_of([33]), torch.ones(1, DIM))  # explicit inserts are not filtered
    assert bool(t.contains(keys_of([33])).all())


def test_hot_rows_move_to_the_device_tier_automatically(tmp_path):
    row_bytes = DIM * 4
    t = table(init_capacity=64, max_capacity=64, bucket_size=64, max_load_factor=1.0,
              device_memory_bytes=8 * row_bytes, host_memory_bytes=16 * row_bytes, disk_path=str(tmp_path / "v.bin"),
              evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    ks = torch.arange(1000, 1040)
    vals = torch.randn(40, DIM)
    t.insert_or_assign(ks, vals, scores=torch.arange(40))
    tier = lambda keys: t._values.tier_of_slots(t._locate(keys))  # noqa: E731
    # the device tier holds the 8 highest scores; every value is where its slot says
    assert sorted(ks[tier(ks) == 0].tolist()) == ks[-8:].tolist()
    torch.testing.assert_close(t.find(ks)[0], vals)
    # raising cold keys' scores above the device tier's lowest moves them up, no migrate() call
    cold = ks[:3]
    assert bool((tier(cold) > 0).all())
    t.assign(cold, vals[:3] + 1, scores=torch.tensor([100, 101, 36]))
    assert tier(cold).tolist() == [0, 0, 0]
    vals[:3] += 1
    torch.testing.assert_close(t.find(ks)[0], vals)
    assert sorted(ks[tier(ks) == 0].tolist()) == sorted(cold.tolist() + ks[-5:].tolist())
    # a score below the device tier's lowest stays where it is
    t.assign_scores(ks[10:11], torch.tensor([5]))
    assert int(tier(ks[10:11])) > 0


@pytest.mark.parametrize("strategy", list(hkv.EvictStrategy))
def test_one_pass_cpu_upsert_matches_reference(strategy):
    """The CPU kernel's one-pass upsert against the vectorised torch path: values, scores, sizes and
    growth, with duplicates, erased slots and keys of full buckets (which take the torch path to grow).
    Eviction order among a batch's keys may differ; test_full_bucket_evicts_lowest_and_refuses_lower
    checks both kernels' eviction semantics."""
    gen = torch.Generator().manual_seed(0)
    tables = [table(init_capacity=64, max_capacity=4096, bucket_size=8, evict_strategy=strategy, kernel=k)
              for k in ("reference", "cpu")]
    for t in tables:
        t.set_global_epoch(2)
    pool = torch.randint(0, 2**62, (300,), generator=gen)
    for step in range(12):
        ks = pool[torch.randint(0, 60 + 20 * step, (40,), generator=gen)]
        vals = torch.randn(40, DIM, generator=gen)
        scores = None if strategy in (hkv.EvictStrategy.LRU, hkv.EvictStrategy.EPOCH_LRU) else \
            torch.randint(1, 50, (40,), generator=gen)
        outs = []
        for t in tables:
            if step % 4 == 3:
                outs.append(t.find_or_insert(ks, init=vals, scores=scores))
            elif step % 4 == 2:
                outs.append(t.assign(ks, vals, scores=scores))
                t.erase(ks[:3])
            else:
                outs.append(t.insert_and_evict(ks, vals, scores=scores)[0])
        torch.testing.assert_close(outs[1], outs[0], msg=f"step {step}")
        ref, fast = tables
        assert (fast.size(), fast.capacity()) == (ref.size(), ref.capacity())
        stored = ref.export_batch(ref.capacity())[0]
        for t in tables:
            assert bool(t.contains(stored).all())
        v_ref, _, s_ref = ref.find(stored, return_scores=True)
        v_fast, _, s_fast = fast.find(stored, return_scores=True)
        torch.testing.assert_close(v_fast, v_ref)
        assert torch.equal(s_fast, s_ref)


def test_grouped_keys_split_over_threads_by_bucket():
    """Keys grouped by bucket on the host (hkv.cpu.unique) take the kernel's grouped path, on two threads."""
    from hkv import cpu

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = 40000  # two threads' worth of keys
        raw = torch.randint(0, 2**40, (n,))
        t, plain = (table(init_capacity=1 << 17, max_capacity=1 << 17, bucket_size=64) for _ in range(2))
        uniq, inverse = cpu.unique(raw, t.num_buckets())
        assert torch.equal(uniq[inverse], raw) and uniq.numel() == torch.unique(raw).numel()
        buckets = mix64(uniq) & (t.num_buckets() - 1)
        assert bool((buckets[1:] >= buckets[:-1]).all())
        init = torch.randn(uniq.numel(), DIM)
        out = t.find_or_insert(uniq, init=init, grouping=t.num_buckets())
        torch.testing.assert_close(out, init)
        torch.testing.assert_close(plain.find_or_insert(uniq, init=init), init)
        assert t.size() == plain.size() == uniq.numel()
        torch.testing.assert_close(t.find(raw)[0], init[inverse])
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=30, deadline=None)
@given(xs=st.lists(st.sampled_from(POOL), max_size=30), buckets=st.sampled_from([0, 1, 4, 64]))
def test_host_unique_matches_torch_unique(xs, buckets):
    from hkv import cpu

    ids = keys_of(xs)
    uniq, inverse = cpu.unique(ids, buckets)
    assert sorted(uniq.tolist()) == sorted(set(xs))
    assert torch.equal(uniq[inverse], ids)
    if buckets:
        b = mix64(uniq) & (buckets - 1)
        assert bool((b[1:] >= b[:-1]).all())
