"""Fuzz of issue 22's guarantees, one hypothesis test per op family: no silent wrong result, no crash other than
a named error, no lost entry.

- jagged ops: random (often malformed) offsets, modes, dtypes and maximum lengths on every kernel
  (reference, cpu, fbgemm, native, Triton under the interpreter): all kernels agree with the contract;
- embedding ops: random ids (some out of range) and offsets (some malformed) on every kernel;
- hkv tables: random operations with an allocation failure injected into some growths, against a dict;
- hkv checkpoints: valid files with random bytes mutated, header fields replaced, keys duplicated.

CI runs ``RECOMPILE_FUZZ_EXAMPLES`` examples per family (default 100, derandomized); the full run is
``RECOMPILE_FUZZ_EXAMPLES=1000 pytest -m slow tests/test_reliability_fuzz.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hkv
import recompile.runtime.embedding_native  # noqa: F401  (registers the native kernel)
from hkv import checkpoint, storage
from hkv.checkpoint import CheckpointError
from recompile.runtime.kernels import KERNELS
from tests.test_reliability_hkv import Injector
from tests.test_reliability_jagged import JAGGED_OPS, check_call

EXAMPLES = int(os.environ.get("RECOMPILE_FUZZ_EXAMPLES", "100"))
# CI's run is the same every time; a run asked for by the variable explores anew.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="RECOMPILE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------------ jagged ops

def _corrupt(offsets: list[int], kind: str, at: int, by: int) -> list[int]:
    out = list(offsets)
    i = at % len(out)
    if kind == "first":
        out[0] = by
    elif kind == "decrease" and len(out) > 1:
        i = max(i, 1)
        out[i] = out[i - 1] - by
    elif kind == "last":
        out[-1] += by if at % 2 else -by
    elif kind == "negative":
        out[i] = -by
    elif kind == "any":
        out[i] += by if at % 2 else -by
    return out


@FUZZ
@given(op=st.sampled_from(JAGGED_OPS), lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       kind=st.sampled_from(["none", "first", "decrease", "last", "negative", "any"]), at=st.integers(0, 7),
       by=st.integers(1, 4), mode=st.sampled_from(["fatal", "warning", "ignore"]),
       dtype=st.sampled_from([torch.int32, torch.int64]), max_len=st.integers(1, 7), seed=st.integers(0, 99))
def test_fuzz_jagged_ops(op, lengths, kind, at, by, mode, dtype, max_len, seed):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    got = check_call(op, _corrupt(offsets, kind, at, by), offsets[-1], max_len, mode, dtype, seed)
    event(f"{op}: {'named error' if got[0] == 'error' else 'repaired, warned' if got[2] else 'result'}")


# ------------------------------------------------------------------------------------------ embedding ops

def _embedding_outcome(args, impl):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = torch.ops.recompile.grouped_embedding_bag(*args, impl)
        except (ValueError, IndexError) as exc:
            return ("error", f"{type(exc).__name__}: {exc}")
    return ("ok", out, any("grouped_embedding_bag" in str(w.message) for w in caught))


@FUZZ
@given(tables=st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(0, 5), min_size=1, max_size=4),
                                 st.sampled_from(["none", "first", "decrease", "last", "negative", "any"]),
                                 st.integers(0, 7), st.integers(1, 4), st.booleans()), min_size=1, max_size=2),
       pooling=st.sampled_from([0, 1]), mode=st.sampled_from(["fatal", "warning", "ignore"]),
       dtype=st.sampled_from([torch.int32, torch.int64]), bad_id=st.integers(-3, 3), seed=st.integers(0, 99))
def test_fuzz_embedding_ops(tables, pooling, mode, dtype, bad_id, seed):
    gen = torch.Generator().manual_seed(seed)
    weights, indices, offsets, last = [], [], [], []
    batch = len(tables[0][1])
    malformed = out_of_range = False
    for rows, lengths, kind, at, by, include_last in tables:
        lengths = (lengths * batch)[:batch]  # one batch size for the group
        total = sum(lengths)
        ids = torch.randint(0, rows, (total,), generator=gen)
        if bad_id and total:
            ids[seed % total] = rows - 1 + bad_id if bad_id > 0 else bad_id
            out_of_range |= not 0 <= int(ids[seed % total]) < rows
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        bad = _corrupt(bounds, kind, at, by)
        given_offsets = bad if include_last else bad[:-1]
        ok = given_offsets[0] == 0 and all(b >= a for a, b in zip(given_offsets, given_offsets[1:])) and (
            given_offsets[-1] == total if include_last else given_offsets[-1] <= total)
        malformed |= not ok
        weights.append(torch.randn(rows, 4, generator=gen))
        indices.append(ids.to(dtype))
        offsets.append(torch.tensor(given_offsets, dtype=dtype))
        last.append(include_last)
    n = len(tables)
    names = ",".join(f"f{i}" for i in range(n))
    args = (weights, indices, offsets, [torch.empty(0)] * n, [pooling] * n, [-1] * n, last, [False] * n, "concat",
            names, mode)
    results = {impl: _embedding_outcome(args, impl) for impl in sorted(KERNELS["grouped_embedding_bag"])}
    ref = results["reference"]
    for impl, got in results.items():
        assert got[0] == ref[0] and (got[1] == ref[1] if got[0] == "error" else got[2] == ref[2]), (impl, got, ref)
        if got[0] == "ok":
            torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5, msg=impl)
    event("named error" if ref[0] == "error" else "warned" if ref[2] else "result")
    if malformed:
        assert ref[0] == "error" and "offsets" in ref[1], ref
    elif out_of_range and mode == "fatal":
        assert ref[0] == "error" and "out of range" in ref[1], ref
    else:
        assert ref[0] == "ok" and ref[2] == (out_of_range and mode == "warning"), ref


# ------------------------------------------------------------------------------------------ hkv tables

TABLE_OPS = ("insert", "find_or_insert", "accum", "erase", "reserve")


@FUZZ
@given(kernel=st.sampled_from(["reference", "cpu", "triton"]), tier=st.sampled_from(["device", "host", "disk"]),
       steps=st.lists(st.tuples(st.sampled_from(TABLE_OPS), st.lists(st.integers(0, 300), max_size=40),
                                st.integers(0, 12), st.integers(0, 2**31)), min_size=1, max_size=8))
def test_fuzz_hkv_tables_with_failing_growth(kernel, tier, steps):
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        limits = {"device": {}, "host": dict(device_memory_bytes=24 * 8),
                  "disk": dict(device_memory_bytes=24 * 8, host_memory_bytes=8 * 8,
                               disk_path=os.path.join(folder, "values.bin"))}[tier]
        t = hkv.HashTable(2, init_capacity=32, max_capacity=1 << 12, bucket_size=8, kernel=kernel, **limits)
        model: dict[int, torch.Tensor] = {}
        for op, ks, fail_at, seed in steps:
            gen = torch.Generator().manual_seed(seed)
            keys = torch.tensor(ks, dtype=torch.int64)
            vals = torch.randn(len(ks), 2, generator=gen)
            patch.undo()
            Injector(patch, fail_at or None)
            before = {k: v.clone() for k, v in model.items()}
            try:
                if op == "insert":
                    assert t.insert_or_assign(keys, vals).numel() == 0
                    model.update({k: v for k, v in zip(ks, vals)})
                elif op == "find_or_insert":
                    t.find_or_insert(keys, init=vals)
                    for i, k in enumerate(ks):
                        model.setdefault(k, vals[max(j for j, x in enumerate(ks) if x == k)])
                elif op == "accum":
                    flags = torch.randint(0, 2, (len(ks),), generator=gen).bool()
                    t.accum_or_assign(keys, vals, flags)
                    for k, v, f in zip(ks, vals, flags.tolist()):
                        if not f:
                            model[k] = v
                        elif k in model:
                            model[k] = model[k] + v
                elif op == "erase":
                    t.erase(keys)
                    for k in ks:
                        model.pop(k, None)
                else:
                    t.reserve(4 * t.capacity())
            except storage.StorageError as exc:
                event("a growth failed")
                assert "the table is unchanged: could not allocate the" in str(exc)
                model = before
                if kernel == "cpu":  # its one-pass upsert stores the batch before it grows: take what it kept
                    values, found = t.find(keys) if ks else (None, torch.zeros(0, dtype=torch.bool))
                    for i, k in enumerate(ks):
                        if bool(found[i]):
                            model[k] = values[i]
                        else:
                            assert k not in before, f"key {k} lost by a failed growth"
            patch.undo()
            exported = t.export_batch(t.capacity())[0]
            assert t.size() == exported.numel() == len(model), (t.size(), exported.numel(), len(model))
            if model:
                probe = torch.tensor(sorted(model))
                values, found = t.find(probe)
                assert bool(found.all()), "entry lost"
                torch.testing.assert_close(values, torch.stack([model[k] for k in sorted(model)]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ checkpoint bytes

def _source_table(seed: int) -> hkv.HashTable:
    gen = torch.Generator().manual_seed(seed)
    t = hkv.HashTable(3, init_capacity=64, max_capacity=1024, bucket_size=16,
                      evict_strategy=hkv.EvictStrategy.CUSTOMIZED)
    n = seed % 40
    t.insert_or_assign(torch.randperm(1000, generator=gen)[:n], torch.randn(n, 3, generator=gen),
                       scores=torch.randint(0, 100, (n,), generator=gen))
    return t


JSON_VALUES = st.one_of(st.integers(-2**64, 2**64), st.floats(allow_nan=True), st.text(max_size=8), st.booleans(),
                        st.none(), st.lists(st.integers(), max_size=2),
                        st.sampled_from(["float32", "bfloat16", "int64", "lfu", "lru", "customized"]))


def _resealed(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


@FUZZ
@given(seed=st.integers(0, 10**6), mutation=st.sampled_from(["bytes", "header", "header_bytes", "keys", "truncate"]),
       where=st.lists(st.integers(0, 2**31), min_size=1, max_size=4), value=JSON_VALUES,
       field=st.sampled_from(sorted(checkpoint.HEADER) + ["extra"]), reseal=st.booleans())
def test_fuzz_checkpoint_bytes(seed, mutation, where, value, field, reseal):
    data = checkpoint.dumps(_source_table(seed))
    header_len = struct.unpack_from("<I", data, 12)[0]
    header, body = json.loads(data[16:16 + header_len]), bytearray(data[:-32])
    if mutation == "bytes":
        for w in where:
            body[w % len(body)] ^= 1 + w % 255
    elif mutation == "header":
        header = dict(header)
        if value is None and field in header:
            del header[field]
        else:
            header[field] = value
        raw = json.dumps(header).encode()
        body = bytearray(data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + header_len:-32])
    elif mutation == "header_bytes":
        for w in where:
            body[16 + w % header_len] = w % 256
    elif mutation == "keys" and header["size"]:
        start, n = 16 + header_len, header["size"]
        keys = torch.frombuffer(bytearray(body[start:start + 8 * n]), dtype=torch.int64).clone()
        for w in where:
            keys[w % n] = [-1, -2, -3, int(keys[(w // 7) % n])][w % 4]
        body[start:start + 8 * n] = keys.numpy().tobytes()
    elif mutation == "truncate":
        body = body[:where[0] % len(body)]
    blob = _resealed(bytes(body)) if reseal or mutation == "header" else bytes(body) + data[-32:]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.hkv")
        with open(path, "wb") as f:
            f.write(blob)
        try:
            table = hkv.HashTable.load(path)
        except CheckpointError as exc:
            event(f"CheckpointError:{str(exc).replace(f'hkv checkpoint {path!r}', '')[:45]}")
            return
    event("loaded")
    # it loaded: it must hold exactly what the file says
    parsed_header, keys, values, scores = checkpoint.parse(blob)
    assert table.size() == keys.numel() == parsed_header["size"]
    if keys.numel():
        got, found, got_scores = table.find(keys, return_scores=True)
        assert bool(found.all()), "entry lost"
        assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got,
                           values.to(table.dtype).view(torch.int32) if got.dtype == torch.float32 else values.to(table.dtype))
        if table.evict_strategy is hkv.EvictStrategy(parsed_header["evict_strategy"]):
            assert torch.equal(got_scores, scores)
