"""hkv checkpoints: round trip, other capacities, incremental dumps, corruption, crash mid-save."""
import os

import pytest
import torch

import hkv
from hkv import checkpoint


def filled(n=500, **kw):
    args = dict(dim=4, init_capacity=128, max_capacity=1 << 12, bucket_size=32,
                evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    args.update(kw)
    t = hkv.HashTable(**args)
    keys = torch.randint(0, 2**62, (n,)).unique()
    t.insert_or_assign(keys, torch.randn(keys.numel(), 4), scores=torch.arange(keys.numel()))
    return t, keys


def same_entries(a, b):
    ka, va, sa = a.export_batch(a.capacity())
    kb, vb, sb = b.export_batch(b.capacity())
    oa, ob = ka.argsort(), kb.argsort()
    assert torch.equal(ka[oa], kb[ob]) and torch.equal(sa[oa], sb[ob])
    torch.testing.assert_close(va[oa], vb[ob])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_other_capacity(tmp_path, dtype):
    t, keys = filled(dtype=dtype)
    t.set_global_epoch(9)
    path = tmp_path / "t.hkv"
    t.save(path)
    back = hkv.HashTable.load(path)
    same_entries(t, back)
    assert (back.capacity(), back.dtype, back.global_epoch, back.evict_strategy) == (
        t.capacity(), dtype, 9, hkv.EvictStrategy.CUSTOMIZED)
    bigger = hkv.HashTable.load(path, init_capacity=4 * t.capacity())
    assert bigger.capacity() == 4 * t.capacity()
    same_entries(t, bigger)
    # a smaller table refuses to drop entries, unless asked to keep the highest-scoring ones that fit
    with pytest.raises(hkv.CheckpointError, match=r"\d+ of \d+ checkpointed entries do not fit"):
        hkv.HashTable.load(path, init_capacity=256, max_capacity=256)
    small = hkv.HashTable.load(path, init_capacity=256, max_capacity=256, allow_eviction=True)
    assert small.size() <= 256 and small.size() > 0
    _, _, s = small.export_batch(256)
    assert int(s.min()) >= 0


def test_export_batch_if_gives_incremental_dump(tmp_path):
    t, keys = filled(200)
    k, v, s = t.export_batch_if(150)
    assert k.numel() == int((torch.arange(keys.numel()) >= 150).sum())
    torch.testing.assert_close(t.find(k)[0], v)
    chunks = [t.export_batch_if(150, n=64, offset=o)[0] for o in range(0, t.capacity(), 64)]
    assert sorted(torch.cat(chunks).tolist()) == sorted(k.tolist())


def test_corrupt_and_mismatched_files_rejected(tmp_path):
    t, _ = filled(100)
    path = tmp_path / "t.hkv"
    t.save(path)
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    cases = {
        "checksum mismatch": bytes(flipped),
        "not an hkv checkpoint": b"garbage" * 10,
        "corrupt or truncated": bytes(data[:-100]),
        "format version 99": data[:8] + (99).to_bytes(4, "little") + data[12:],
    }
    for message, content in cases.items():
        bad = tmp_path / "bad.hkv"
        bad.write_bytes(content)
        with pytest.raises(hkv.CheckpointError, match=message):
            hkv.HashTable.load(bad)
    other = hkv.HashTable(dim=8, init_capacity=128, max_capacity=128)
    with pytest.raises(hkv.CheckpointError, match="dim 4, the table has dim 8"):
        checkpoint.restore(other, *checkpoint.parse(path.read_bytes()))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    t, keys = filled(300)
    path = tmp_path / "t.hkv"
    t.save(path)
    before = path.read_bytes()
    t.insert_or_assign(torch.tensor([7]), torch.ones(1, 4), scores=torch.tensor([1]))
    calls = []

    def dying(tensor):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed mid-save")
        return original(tensor)

    original = checkpoint._to_bytes
    monkeypatch.setattr(checkpoint, "_to_bytes", dying)
    with pytest.raises(KeyboardInterrupt):
        t.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["t.hkv"]
    monkeypatch.undo()
    back = hkv.HashTable.load(path)
    assert not bool(back.contains(torch.tensor([7])).any()) and back.size() == keys.numel()
