"""The hkv checkpoint format: versioned, checksummed, written atomically.

Layout of a file::

    MAGIC (8 bytes) | version (u32 LE) | header length (u32 LE) | header (UTF-8 JSON) | payload | SHA-256 (32 bytes)

The header holds the table's settings and the payload's arrays (name, dtype, shape), in order;
the payload holds them raw (little-endian): keys (int64), scores (int64), values (size x dim).
The digest covers every byte before it. ``save`` writes ``<path>.tmp-<pid>``, fsyncs it and renames
it over ``path``, so a crash mid-save leaves the previous checkpoint as it was.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from typing import BinaryIO

import torch

MAGIC = b"HKVCKPT\x00"
VERSION = 1
DIGEST_BYTES = 32
# Rows per chunk when streaming the table out.
EXPORT_CHUNK = 1 << 16
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)}


class CheckpointError(ValueError):
    """A checkpoint file is not an hkv checkpoint, is corrupt, or does not match what was asked."""


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _header(table) -> dict:
    return {
        "dim": table.dim,
        "dtype": str(table.dtype).removeprefix("torch."),
        "size": table.size(),
        "capacity": table.capacity(),
        "max_capacity": table.max_capacity,
        "max_load_factor": table.max_load_factor,
        "bucket_size": table.bucket_size,
        "evict_strategy": table.evict_strategy.value,
        "global_epoch": table.global_epoch,
        "clock": table._clock,
    }


def write(table, f: BinaryIO) -> None:
    """Stream ``table`` into ``f`` in the checkpoint format."""
    header = json.dumps(_header(table), sort_keys=True).encode()
    digest = hashlib.sha256()

    def put(data: bytes) -> None:
        digest.update(data)
        f.write(data)

    put(MAGIC + struct.pack("<II", VERSION, len(header)) + header)
    chunks = [table.export_batch(EXPORT_CHUNK, offset) for offset in range(0, table.capacity(), EXPORT_CHUNK)]
    for part in range(3):  # keys, values, scores: one array after the other
        for chunk in chunks:
            put(_to_bytes(chunk[part]))
    f.write(digest.digest())


def save(table, path: str) -> None:
    """Write ``table`` to ``path`` atomically (temp file, fsync, rename)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def dumps(table) -> bytes:
    buf = io.BytesIO()
    write(table, buf)
    return buf.getvalue()


def parse(data: bytes, source: str = "checkpoint"):
    """(header, keys, values, scores) from checkpoint bytes; raises CheckpointError naming what is wrong."""
    if len(data) < len(MAGIC) + 8 + DIGEST_BYTES or not data.startswith(MAGIC):
        raise CheckpointError(f"{source} is not an hkv checkpoint (bad magic or too short)")
    version, header_len = struct.unpack_from("<II", data, len(MAGIC))
    if version != VERSION:
        raise CheckpointError(f"{source} has checkpoint format version {version}; this hkv reads version {VERSION}")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{source} is corrupt or truncated: SHA-256 checksum mismatch")
    start = len(MAGIC) + 8
    header = json.loads(body[start:start + header_len])
    offset = start + header_len
    n, dim, dtype = header["size"], header["dim"], DTYPES[header["dtype"]]
    arrays = []
    for dt, shape in ((torch.int64, (n,)), (dtype, (n, dim)), (torch.int64, (n,))):
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dt).element_size()
        raw = bytearray(body[offset:offset + nbytes])
        if len(raw) != nbytes:
            raise CheckpointError(f"{source}: payload is shorter than its header says")
        arrays.append(torch.frombuffer(raw, dtype=dt).view(shape) if nbytes else torch.empty(shape, dtype=dt))
        offset += nbytes
    if offset != len(body):
        raise CheckpointError(f"{source}: payload is longer than its header says")
    return header, *arrays


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def build(header: dict, keys, values, scores, **overrides):
    """A new HashTable with the header's settings (``overrides`` replace them) holding the entries."""
    from hkv.table import EvictStrategy, HashTable

    settings = {
        "dim": header["dim"],
        "init_capacity": max(header["capacity"], 1),
        "max_capacity": header["max_capacity"],
        "max_load_factor": header["max_load_factor"],
        "bucket_size": header["bucket_size"],
        "evict_strategy": EvictStrategy(header["evict_strategy"]),
        "dtype": DTYPES[header["dtype"]],
    }
    settings.update(overrides)
    if "init_capacity" in overrides and "max_capacity" not in overrides:
        settings["max_capacity"] = max(settings["max_capacity"], settings["init_capacity"])
    table = HashTable(**settings)
    restore(table, header, keys, values, scores)
    return table


def restore(table, header: dict, keys, values, scores) -> int:
    """Put checkpointed entries into ``table`` (cleared first); returns how many did not fit (lowest scores)."""
    if header["dim"] != table.dim:
        raise CheckpointError(f"{table.name}: checkpoint has dim {header['dim']}, the table has dim {table.dim}")
    with table._lock:
        table.clear()
        table.global_epoch = header["global_epoch"]
        table._clock = header["clock"]
        return table._restore_entries(keys.to(table.device), values.to(table.device), scores.to(table.device))


def load(path: str, **overrides):
    header, keys, values, scores = parse(read(path), source=f"hkv checkpoint {path!r}")
    return build(header, keys, values, scores, **overrides)
