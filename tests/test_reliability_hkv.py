"""hkv under failure: a growth that cannot allocate leaves the table as it was, saves export exactly what the
table holds, stale temp files of dead savers are removed, accum_or_assign applies a batch in order, quantized rows
on disk tiers survive growth and checkpoints, crafted quantized headers are refused."""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import hkv
from hkv import checkpoint, storage
from hkv.table import HashTable

DIM = 4
ROW = DIM * 4
# Each tier configuration puts the grown table's last rows on that tier.
TIERS = {
    "device": {},
    "host": dict(device_memory_bytes=40 * ROW),
    "disk": dict(device_memory_bytes=40 * ROW, host_memory_bytes=16 * ROW, disk_path="values.bin"),
}


class Injector:
    """Counts the allocations a growth makes (tensors, files, renames) and fails the ``fail_at``-th one."""

    FUNCTIONS = ((torch, "zeros"), (torch, "full"), (torch, "arange"), (torch, "tensor"), (torch, "from_file"),
                 (os, "replace"), (os, "makedirs"))

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.calls, self.fail_at, self.active = 0, fail_at, False
        for module, name in self.FUNCTIONS:
            monkeypatch.setattr(module, name, self._wrap(getattr(module, name)))
        monkeypatch.setattr(storage, "open", self._wrap(builtins.open), raising=False)
        allocate_layout, adopt = HashTable._allocate, storage.TieredValues.adopt
        monkeypatch.setattr(HashTable, "_allocate", lambda table, capacity: self._during(
            table._staging, allocate_layout, table, capacity))
        monkeypatch.setattr(storage.TieredValues, "adopt", lambda values: self._during(True, adopt, values))

    def _during(self, active, fn, *args):
        was, self.active = self.active, active
        try:
            return fn(*args)
        finally:
            self.active = was

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            if self.active:
                self.calls += 1
                if self.calls == self.fail_at:
                    raise (OSError(28, "No space left on device") if fn in (os.replace, builtins.open)
                           else MemoryError("injected allocation failure"))
            return fn(*args, **kwargs)

        return counted


def _table(tmp_path, tier: str, kernel: str) -> HashTable:
    limits = dict(TIERS[tier])
    if "disk_path" in limits:
        limits["disk_path"] = str(tmp_path / limits["disk_path"])
    t = HashTable(DIM, init_capacity=64, max_capacity=1024, bucket_size=16, kernel=kernel, **limits)
    keys = torch.arange(1, 29) * 7919
    t.insert_or_assign(keys, torch.randn(keys.numel(), DIM, generator=torch.Generator().manual_seed(0)))
    return t


def _state(t: HashTable):
    keys, values, scores = t.export_batch(t.capacity())
    order = keys.argsort()
    return t.size(), t.capacity(), t.tier_rows(), keys[order], values[order], scores[order]


def _assert_same(a, b):
    assert a[:3] == b[:3]
    for x, y in zip(a[3:], b[3:]):
        assert torch.equal(x, y)


GROWTHS = {
    "reserve": lambda t: t.reserve(4 * t.capacity()),
    "insert": lambda t: t.insert_or_assign(torch.arange(1000, 1040), torch.ones(40, DIM)),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("growth", GROWTHS)
def test_a_failed_growth_leaves_the_table_as_it_was(tmp_path, monkeypatch, tier, growth):
    kernel = "reference"  # the CPU kernel's one-pass upsert stores the batch before it grows (see docs)
    probe = Injector(monkeypatch)
    grown = _table(tmp_path, tier, kernel)
    GROWTHS[growth](grown)
    assert grown.capacity() > 64 and grown.tier_rows()[tier] > 0
    allocations = probe.calls
    assert allocations >= (8 if tier == "disk" else 5)
    monkeypatch.undo()
    for fail_at in range(1, allocations + 1):
        (tmp_path / "values.bin").unlink(missing_ok=True)
        t = _table(tmp_path, tier, kernel)
        before, files = _state(t), sorted(os.listdir(tmp_path))
        Injector(monkeypatch, fail_at)
        with pytest.raises(storage.StorageError, match=r"the table is unchanged: could not allocate the "
                                                         r"(device|host|disk) tier") as err:
            GROWTHS[growth](t)
        monkeypatch.undo()
        if tier == "disk" and "disk tier" in str(err.value):
            assert str(tmp_path / "values.bin") in str(err.value)
        _assert_same(_state(t), before)
        assert sorted(os.listdir(tmp_path)) == files
        keys = before[3]
        values, found = t.find(keys)
        assert bool(found.all()) and torch.equal(values, before[4])
        GROWTHS[growth](t)  # it grows once the failure is gone
        assert t.capacity() > 64 and torch.equal(t.find(keys)[0], before[4])


def test_a_growth_into_an_unusable_disk_path_names_it(tmp_path):
    t = _table(tmp_path, "disk", "cpu")
    t.tier_limits = storage.TierLimits(40 * ROW, 40 * ROW, str(tmp_path / "no" / "such" / "dir" / "x.bin"))
    (tmp_path / "no").write_text("a file where a directory should be")
    before = _state(t)
    with pytest.raises(storage.StorageError, match="disk tier .* at '.*/no/such/dir/x.bin.grow-"):
        t.reserve(512)
    _assert_same(_state(t), before)


def test_save_refuses_a_table_whose_entries_do_not_match_its_size(tmp_path):
    t = _table(tmp_path, "device", "cpu")
    path = tmp_path / "t.hkv"
    t.save(path)
    good = path.read_bytes()
    t._size += 1  # an inconsistent table: what it exports is not what it counts
    with pytest.raises(hkv.CheckpointError, match="exports 28 entries but its size is 29"):
        t.save(path)
    assert path.read_bytes() == good and sorted(os.listdir(tmp_path)) == ["t.hkv"]


def test_stale_temp_files_of_dead_savers_are_removed(tmp_path):
    t = _table(tmp_path, "device", "cpu")
    path = tmp_path / "t.hkv"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f"t.hkv.tmp-{int(dead.stdout)}", tmp_path / f"t.hkv.tmp-{os.getppid()}"
    other = tmp_path / f"u.hkv.tmp-{int(dead.stdout)}"
    for f in (stale, live, other):
        f.write_bytes(b"half a checkpoint")
    t.save(path)
    assert not stale.exists() and live.exists() and other.exists()
    assert HashTable.load(path).size() == t.size()


def test_accum_or_assign_applies_a_batch_in_order():
    t = HashTable(2, init_capacity=64, max_capacity=64)
    t.insert_or_assign(torch.tensor([1]), torch.tensor([[10.0, 10.0]]))
    keys = torch.tensor([1, 1, 2, 2, 2, 3, 1])
    flags = torch.tensor([True, False, True, False, True, True, True])
    rows = torch.arange(14, dtype=torch.float32).view(7, 2)
    applied = t.accum_or_assign(keys, rows, flags)
    # key 1: 10 + row0, then assigned row1, then + row6; key 2: absent (ignored), assigned row3, + row4; key 3 absent
    assert applied.tolist() == [True, True, False, True, True, False, True]
    values, found = t.find(torch.tensor([1, 2, 3]))
    assert found.tolist() == [True, True, False]
    torch.testing.assert_close(values[:2], torch.stack([rows[1] + rows[6], rows[3] + rows[4]]))


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_quantized_tables_on_disk_tiers_and_crafted_quantized_checkpoints(tmp_path, qdtype):
    from hkv.rowwise import dequantize_rows, packed_width, quantize_rows

    width = packed_width(DIM, qdtype)
    t = HashTable(DIM, init_capacity=64, max_capacity=1024, bucket_size=16, dtype=qdtype,
                  device_memory_bytes=8 * width, host_memory_bytes=8 * width, disk_path=str(tmp_path / "q.bin"))
    keys, values = torch.arange(1, 101) * 7919, torch.randn(100, DIM, generator=torch.Generator().manual_seed(1))
    t.insert_or_assign(keys, values)  # grows past 64 slots; rows on all three tiers
    assert t.tier_rows()["disk"] > 0 and t.capacity() > 64
    expected = dequantize_rows(quantize_rows(values, qdtype), qdtype)
    assert torch.equal(t.find(keys)[0], expected)
    path = str(tmp_path / "q.hkv")
    t.save(path)
    back = HashTable.load(path, disk_path=str(tmp_path / "back.bin"))
    assert back.qdtype == qdtype and torch.equal(back.find(keys)[0], expected)
    data = checkpoint.read(path)
    header, *arrays = checkpoint.parse(data)
    assert arrays[1].dtype == torch.uint8 and arrays[1].shape == (100, width)
    # A header claiming float rows over a packed payload, or an int4 table of odd dim, is refused.
    with pytest.raises(checkpoint.CheckpointError, match="the payload has .* bytes, its header says 100 entries"):
        checkpoint.parse(_resealed(data, header | {"dtype": "float32"}))
    with pytest.raises(checkpoint.CheckpointError, match="header dim 3 cannot be packed as int4"):
        checkpoint.parse(_resealed(data, header | {"dtype": "int4", "dim": 3}))


def _resealed(data: bytes, header: dict) -> bytes:
    """``data`` with another header and a valid checksum."""
    header_len = struct.unpack_from("<I", data, 12)[0]
    raw = json.dumps(header).encode()
    body = data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + header_len:-32]
    return body + hashlib.sha256(body).digest()
