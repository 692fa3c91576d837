"""Checkpoints as an attacker writes them: crafted headers and payloads, pickles that would run code, restores
that would drop entries or mix eviction strategies. Each is refused with CheckpointError before allocating."""
from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import torch

import hkv
from hkv import checkpoint
from hkv.checkpoint import CheckpointError


def _filled(n=200, capacity=512, strategy=hkv.EvictStrategy.CUSTOMIZED):
    t = hkv.HashTable(4, init_capacity=capacity, max_capacity=4 * capacity, bucket_size=32, evict_strategy=strategy)
    keys = torch.arange(1, n + 1) * 1_000_003
    scores = torch.arange(n) if strategy is hkv.EvictStrategy.CUSTOMIZED else None
    t.insert_or_assign(keys, torch.randn(n, 4), scores=scores)
    return t


def _craft(header: dict, payload: bytes, header_bytes: bytes | None = None) -> bytes:
    """A checkpoint with a valid checksum around whatever header and payload the test wants."""
    raw = json.dumps(header).encode() if header_bytes is None else header_bytes
    body = checkpoint.MAGIC + struct.pack("<II", checkpoint.VERSION, len(raw)) + raw + payload
    return body + hashlib.sha256(body).digest()


def _parts(t):
    data = checkpoint.dumps(t)
    header_len = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + header_len])
    return header, data[16 + header_len:-32]


def _keys_payload(header, keys):
    n = len(keys)
    return (torch.tensor(keys).numpy().tobytes() + torch.zeros(n, header["dim"]).numpy().tobytes()
            + torch.zeros(n, dtype=torch.int64).numpy().tobytes())


def _crafted_cases():
    t = _filled(3)
    header, payload = _parts(t)
    yield "not valid JSON", _craft(header, payload, b"{not json")
    yield "not a JSON object", _craft(header, payload, b"[1, 2]")
    yield "has no 'dim'", _craft({k: v for k, v in header.items() if k != "dim"}, payload)
    yield "'dtype' must be one of", _craft(header | {"dtype": "complex128"}, payload)
    yield "'evict_strategy' must be one of", _craft(header | {"evict_strategy": ["lru"]}, payload)
    yield "'dim' must be", _craft(header | {"dim": "4"}, payload)
    yield "'size' must be", _craft(header | {"size": -1}, payload)
    yield "header says 1099511627776 entries", _craft(header | {"size": 2**40}, payload)
    yield "'evict_strategy' must be", _craft(header | {"evict_strategy": "fifo"}, payload)
    yield "'bucket_size' must be", _craft(header | {"bucket_size": 48}, payload)
    yield "'max_load_factor' must be", _craft(header | {"max_load_factor": 0}, payload)
    yield "exceeds its max_capacity", _craft(header | {"capacity": 1024, "max_capacity": 512}, payload)
    yield "header length .* runs past", _craft(header, payload)[:12] + struct.pack("<I", 2**31) + b"\0" * 64
    yield "reserved key", _craft(header, _keys_payload(header, [5, -1, 7]))
    yield "2 duplicate key", _craft(header, _keys_payload(header, [5, 5, 5]))
    yield "would allocate", _craft(header | {"capacity": 2**40, "max_capacity": 2**40}, payload)


@pytest.mark.parametrize("message,data", list(_crafted_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_crafted_checkpoints_are_refused_before_allocating(tmp_path, message, data):
    if message == "header length .* runs past":  # its checksum is recomputed so only the length is wrong
        data = data[:-32] + hashlib.sha256(data[:-32]).digest()
    path = tmp_path / "crafted.hkv"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        hkv.HashTable.load(path)


def test_restoring_into_a_smaller_table_is_refused_unless_eviction_is_allowed(tmp_path):
    t = _filled(200)
    path = tmp_path / "t.hkv"
    t.save(path)
    with pytest.raises(CheckpointError, match=r"(\d+) of 200 checkpointed entries do not fit") as err:
        hkv.HashTable.load(path, init_capacity=32, max_capacity=32)
    assert "allow_eviction=True" in str(err.value)
    small = hkv.HashTable.load(path, init_capacity=32, max_capacity=32, allow_eviction=True)
    assert 0 < small.size() <= 32
    # into a live table: refused, and the table keeps what it had
    live = hkv.HashTable(4, init_capacity=32, max_capacity=32, bucket_size=32, evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    live.insert_or_assign(torch.tensor([42]), torch.ones(1, 4), scores=torch.tensor([1]))
    with pytest.raises(CheckpointError, match="do not fit"):
        checkpoint.restore(live, *checkpoint.parse(path.read_bytes()))
    assert live.size() == 1 and bool(live.contains(torch.tensor([42])).all())


def test_dynamic_embedding_state_dict_load_reports_dropped_entries():
    def module(capacity):
        return hkv.DynamicEmbedding(hkv.DynamicEmbTableOptions(dim=4, max_capacity=capacity, bucket_capacity=32))

    big = module(1024)
    big.table.insert_or_assign(torch.arange(200), torch.randn(200, 4))
    state = big.state_dict()
    small = module(64)
    small.table.insert_or_assign(torch.tensor([7]), torch.ones(1, 4))
    with pytest.raises(CheckpointError, match=r"\d+ of 200 checkpointed entries do not fit"):
        small.load_state_dict(state)
    assert small.table.size() == 1
    small.restore_allows_eviction = True
    small.load_state_dict(state)
    assert 0 < small.table.size() <= 64


def test_a_checkpoint_of_another_eviction_strategy_is_refused(tmp_path):
    t = _filled(50, strategy=hkv.EvictStrategy.LRU)
    path = tmp_path / "t.hkv"
    t.save(path)
    with pytest.raises(CheckpointError, match="evict_strategy 'lru', the table's 'lfu'"):
        hkv.HashTable.load(path, evict_strategy=hkv.EvictStrategy.LFU)
    lfu = hkv.HashTable.load(path, evict_strategy=hkv.EvictStrategy.LFU, allow_strategy_change=True)
    assert lfu.size() == 50 and lfu.evict_strategy is hkv.EvictStrategy.LFU


class _RunsCode:
    """Pickles as a call of os.mkdir: unpickling it with weights_only=False runs that call."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_distributed_checkpoint_whose_pickle_runs_code_is_refused(tmp_path):
    from models.dlrm import DLRM, DLRMConfig
    from recompile.distributed import checkpoint as dist_checkpoint, distribute

    model = distribute(DLRM(DLRMConfig(num_dense=4, table_rows=[30, 20], dim=4, bottom=[8, 4], top=[8, 1])))
    path = str(tmp_path / "ckpt")
    dist_checkpoint.save(model, path)
    marker = str(tmp_path / "code-ran")
    torch.save({"params": {}, "optimizer": {}, "table_scalars": {}, "x": _RunsCode(marker)},
               os.path.join(path, dist_checkpoint.DENSE))
    with pytest.raises(CheckpointError, match="dense.pt.* refused to unpickle it"):
        dist_checkpoint.load(model, path)
    assert not os.path.exists(marker)


def test_a_dynamic_table_restore_is_all_or_nothing(tmp_path):
    from recompile.distributed import checkpoint as dist_checkpoint, distribute
    from tests.distributed_workers import DynamicModel, KEY_POOL, table_contents

    model = distribute(DynamicModel())
    for t in model.tables:
        t.table.insert_or_assign(KEY_POOL[:200], torch.randn(200, t.table.dim))
    path = str(tmp_path / "ckpt")
    dist_checkpoint.save(model, path)
    fresh = distribute(DynamicModel())
    dist_checkpoint.load(fresh, path)
    for (k, v), (fk, fv) in zip(table_contents(model), table_contents(fresh)):
        assert torch.equal(k, fk) and torch.equal(v, fv)
    small = distribute(DynamicModel())
    for t in small.tables:  # 128 slots: 200 keys do not fit
        t.runtime.table = hkv.HashTable(t.table.dim, init_capacity=128, max_capacity=128, bucket_size=128)
        t.table.insert_or_assign(torch.tensor([5]), torch.ones(1, t.table.dim))
    with pytest.raises(CheckpointError, match=r"\d+ of 200 checkpointed entries do not fit"):
        dist_checkpoint.load(small, path)
    assert small.tables[0].table.size() == 1
