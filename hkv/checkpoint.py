"""The hkv checkpoint format: versioned, checksummed, written atomically.

Layout of a file::

    MAGIC (8 bytes) | version (u32 LE) | header length (u32 LE) | header (UTF-8 JSON) | payload | SHA-256 (32 bytes)

The header holds the table's settings and the payload's arrays (name, dtype, shape), in order;
the payload holds them raw (little-endian): keys (int64), values (size x dim), scores (int64). A table of
quantized rows (header dtype "int8" / "int4") stores its packed rows (size x packed width, uint8) byte for byte.
The digest covers every byte before it. ``save`` writes ``<path>.tmp-<pid>``, fsyncs it and renames
it over ``path``, so a crash mid-save leaves the previous checkpoint as it was (the next save removes
temp files of savers no longer alive); it refuses a table whose exported entries do not number ``size()``.

``parse`` validates everything before it allocates: every header field's type and range, the payload's
length against the file's real length, no reserved or duplicate keys; a header capacity is honoured only
while its allocation stays within ``RESTORE_BYTES`` or 64 x the file's length. Restoring refuses to drop
entries (``allow_eviction=True`` keeps the highest-scoring ones that fit) and to mix eviction strategies
(``allow_strategy_change=True`` keeps the saved scores as they are).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
from typing import BinaryIO

import torch

from hkv.rowwise import QDTYPES, stored_row

MAGIC = b"HKVCKPT\x00"
VERSION = 1
DIGEST_BYTES = 32
# Rows per chunk when streaming the table out.
EXPORT_CHUNK = 1 << 16
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)
DTYPES = {str(d).removeprefix("torch."): d for d in VALUE_DTYPES}
# The most bytes a checkpoint's header capacity may make ``load`` allocate, beyond 64 x the file's length.
RESTORE_BYTES = 1 << 30
SLOT_BYTES = 3 * 8 + 1  # keys, scores, scratch (int64) and the CPU kernel's flag byte per slot


class CheckpointError(ValueError):
    """A checkpoint file is not an hkv checkpoint, is corrupt, or does not match what was asked."""


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _header(table) -> dict:
    return {
        "dim": table.dim,
        "dtype": table.qdtype or str(table.dtype).removeprefix("torch."),
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
    """Stream ``table`` into ``f`` in the checkpoint format (refused when its entries do not number its size)."""
    chunks = [table.export_batch(EXPORT_CHUNK, offset, stored=True)
              for offset in range(0, table.capacity(), EXPORT_CHUNK)]
    exported = sum(chunk[0].numel() for chunk in chunks)
    if exported != table.size():
        raise CheckpointError(f"{table.name}: refusing to save: the table exports {exported} entries but its size "
                              f"is {table.size()}")
    header = json.dumps(_header(table), sort_keys=True).encode()
    digest = hashlib.sha256()

    def put(data: bytes) -> None:
        digest.update(data)
        f.write(data)

    put(MAGIC + struct.pack("<II", VERSION, len(header)) + header)
    for part in range(3):  # keys, values, scores: one array after the other
        for chunk in chunks:
            put(_to_bytes(chunk[part]))
    f.write(digest.digest())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(path: str) -> None:
    """Remove ``<path>.tmp-<pid>`` files left by saves whose process is gone (killed mid-write)."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(name) + r"\.tmp-(\d+)")
    for entry in os.listdir(folder):
        match = pattern.fullmatch(entry)
        if match and int(match[1]) != os.getpid() and not _alive(int(match[1])):
            try:
                os.remove(os.path.join(folder, entry))
            except FileNotFoundError:
                pass  # another saver removed it first


def save(table, path: str) -> None:
    """Write ``table`` to ``path`` atomically (temp file, fsync, rename)."""
    path = os.fspath(path)
    clean_stale_temps(path)
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


def _integer(lo: int, hi: int | None = None):
    return lambda v: type(v) is int and lo <= v and (hi is None or v <= hi)


STRATEGIES = ("lru", "lfu", "epoch_lru", "epoch_lfu", "customized")  # hkv.table.EvictStrategy's values
# Every header field and what it must be (checked before anything is allocated).
HEADER = {
    "dim": (_integer(0, 1 << 24), "an integer in [0, 2**24]"),
    "dtype": (lambda v: isinstance(v, str) and (v in DTYPES or v in QDTYPES),
              f"one of {sorted(DTYPES) + list(QDTYPES)}"),
    "size": (_integer(0), "a non-negative integer"),
    "capacity": (_integer(1, 1 << 62), "an integer in [1, 2**62]"),
    "max_capacity": (_integer(1, 1 << 62), "an integer in [1, 2**62]"),
    "max_load_factor": (lambda v: type(v) in (int, float) and 0 < v <= 1, "a number in (0, 1]"),
    "bucket_size": (lambda v: _integer(1, 1 << 20)(v) and not v & (v - 1), "a power of two up to 2**20"),
    "evict_strategy": (lambda v: isinstance(v, str) and v in STRATEGIES, f"one of {STRATEGIES}"),
    "global_epoch": (_integer(0, 0x7FFFFFFF), "an integer in [0, 2**31)"),
    "clock": (_integer(0, (1 << 63) - 1), "a non-negative int64"),
}


def _check_header(header, source: str) -> None:
    if not isinstance(header, dict):
        raise CheckpointError(f"{source}: its header is not a JSON object")
    for name, (ok, rule) in HEADER.items():
        if name not in header:
            raise CheckpointError(f"{source}: its header has no {name!r}")
        if not ok(header[name]):
            raise CheckpointError(f"{source}: header {name!r} must be {rule}, got {header[name]!r}")
    if header["dtype"] in QDTYPES and (header["dim"] < 1 or header["dtype"] == "int4" and header["dim"] % 2):
        raise CheckpointError(f"{source}: header dim {header['dim']} cannot be packed as {header['dtype']}")
    if header["max_capacity"] < header["capacity"]:
        raise CheckpointError(f"{source}: header capacity {header['capacity']} exceeds its max_capacity "
                              f"{header['max_capacity']}")


def _check_keys(keys: torch.Tensor, source: str) -> None:
    from hkv.table import RESERVED_KEYS

    reserved = torch.isin(keys, torch.tensor(RESERVED_KEYS))
    if bool(reserved.any()):
        raise CheckpointError(f"{source}: the payload holds {int(reserved.sum())} reserved key(s) "
                              f"{sorted(set(keys[reserved].tolist()))} (-1, -2, -3 mark empty, erased and locked slots)")
    unique, counts = torch.unique(keys, return_counts=True)
    if unique.numel() != keys.numel():
        raise CheckpointError(f"{source}: the payload holds {keys.numel() - unique.numel()} duplicate key(s), "
                              f"e.g. {unique[counts > 1][:4].tolist()}")


def parse(data: bytes, source: str = "checkpoint"):
    """(header, keys, values, scores) from checkpoint bytes; raises CheckpointError naming what is wrong.

    Nothing is allocated before the header is known good and the payload's length matches it exactly."""
    if len(data) < len(MAGIC) + 8 + DIGEST_BYTES or not data.startswith(MAGIC):
        raise CheckpointError(f"{source} is not an hkv checkpoint (bad magic or too short)")
    version, header_len = struct.unpack_from("<II", data, len(MAGIC))
    if version != VERSION:
        raise CheckpointError(f"{source} has checkpoint format version {version}; this hkv reads version {VERSION}")
    body, digest = memoryview(data)[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{source} is corrupt or truncated: SHA-256 checksum mismatch")
    start = len(MAGIC) + 8
    if header_len > len(body) - start:
        raise CheckpointError(f"{source}: header length {header_len} runs past the end of the file")
    try:
        header = json.loads(bytes(body[start:start + header_len]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{source}: its header is not valid JSON ({exc})") from None
    _check_header(header, source)
    offset = start + header_len
    n = header["size"]
    width, dtype = _stored_row(header)
    row_bytes = 16 + width * dtype.itemsize
    if n * row_bytes != len(body) - offset:
        raise CheckpointError(f"{source}: the payload has {len(body) - offset} bytes, its header says {n} entries "
                              f"of {row_bytes} bytes")
    arrays = []
    for dt, shape in ((torch.int64, (n,)), (dtype, (n, width)), (torch.int64, (n,))):
        nbytes = dt.itemsize * n * (shape[1] if len(shape) > 1 else 1)
        raw = bytearray(body[offset:offset + nbytes])
        arrays.append(torch.frombuffer(raw, dtype=dt).view(shape) if nbytes else torch.empty(shape, dtype=dt))
        offset += nbytes
    _check_keys(arrays[0], source)
    return header, *arrays


def _stored_row(header: dict) -> tuple[int, torch.dtype]:
    """(width, dtype) of the header's stored rows."""
    return stored_row(header["dim"], DTYPES.get(header["dtype"], header["dtype"]))


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _slot_limit(header: dict, file_bytes: int, source: str) -> int:
    """The most slots restoring the checkpoint may allocate: its header capacity is refused beyond that, and
    the restore grows no further (entries that need more do not fit)."""
    width, dtype = _stored_row(header)
    slot_bytes = SLOT_BYTES + width * dtype.itemsize
    limit = max(RESTORE_BYTES, 64 * file_bytes)
    if header["capacity"] * slot_bytes > limit:
        raise CheckpointError(f"{source}: header capacity {header['capacity']} would allocate "
                              f"{header['capacity'] * slot_bytes} bytes for a checkpoint of {file_bytes} bytes holding "
                              f"{header['size']} entries (at most {limit}); pass init_capacity= to choose the table's size")
    return limit // slot_bytes


def build(header: dict, keys, values, scores, allow_eviction: bool = False, allow_strategy_change: bool = False,
          source: str = "checkpoint", file_bytes: int = 0, **overrides):
    """A new HashTable with the header's settings (``overrides`` replace them) holding the entries."""
    from hkv.table import EvictStrategy, HashTable

    slots = None if "init_capacity" in overrides else _slot_limit(header, file_bytes, source)
    settings = {
        "dim": header["dim"],
        "init_capacity": max(header["capacity"], 1),
        "max_capacity": header["max_capacity"],
        "max_load_factor": header["max_load_factor"],
        "bucket_size": header["bucket_size"],
        "evict_strategy": EvictStrategy(header["evict_strategy"]),
        "dtype": DTYPES.get(header["dtype"], header["dtype"]),
    }
    settings.update(overrides)
    if "init_capacity" in overrides and "max_capacity" not in overrides:
        settings["max_capacity"] = max(settings["max_capacity"], settings["init_capacity"])
    bounded = slots is not None and "max_capacity" not in overrides and settings["max_capacity"] > slots
    if bounded:  # the restore may grow only as far as the file's size allows; the table may later grow on
        settings["max_capacity"] = max(slots, settings["init_capacity"])
    table = HashTable(**settings)
    restore(table, header, keys, values, scores, allow_eviction, allow_strategy_change)
    if bounded:
        table.max_capacity = table._round_capacity(header["max_capacity"])
    return table


def restore(table, header: dict, keys, values, scores, allow_eviction: bool = False,
            allow_strategy_change: bool = False) -> int:
    """Replace ``table``'s entries by checkpointed ones; returns how many did not fit (the lowest scores), which
    is an error unless ``allow_eviction``. On any error the table is left as it was."""
    if header["dim"] != table.dim:
        raise CheckpointError(f"{table.name}: checkpoint has dim {header['dim']}, the table has dim {table.dim}")
    if (header["dtype"] in QDTYPES or table.qdtype) and header["dtype"] != table.qdtype:
        raise CheckpointError(f"{table.name}: checkpoint stores {header['dtype']} rows, the table "
                              f"{table.qdtype or str(table.dtype).removeprefix('torch.')} rows; a quantized table "
                              f"restores only its own format (HashTable.quantized converts a float table)")
    if header["evict_strategy"] != table.evict_strategy.value and not allow_strategy_change:
        raise CheckpointError(f"{table.name}: the checkpoint's scores are of evict_strategy "
                              f"{header['evict_strategy']!r}, the table's {table.evict_strategy.value!r}; pass "
                              f"allow_strategy_change=True to keep them as they are")

    def refuse_drops(lost: int) -> None:
        if lost and not allow_eviction:
            raise CheckpointError(f"{table.name}: {lost} of {keys.numel()} checkpointed entries do not fit (capacity "
                                  f"at most {table.max_capacity}); pass allow_eviction=True to keep the highest-scoring "
                                  f"ones that fit")

    with table._lock:
        stored_dtype = torch.uint8 if table.qdtype else table.dtype
        lost = table._relayout(table.capacity(), keys.to(table.device), values.to(table.device, stored_dtype),
                               scores.to(table.device), refuse_drops)
        table.global_epoch = header["global_epoch"]
        table._clock = header["clock"]
        return lost


def load(path: str, allow_eviction: bool = False, allow_strategy_change: bool = False, **overrides):
    source = f"hkv checkpoint {path!r}"
    data = read(path)
    header, keys, values, scores = parse(data, source=source)
    return build(header, keys, values, scores, allow_eviction, allow_strategy_change, source, len(data), **overrides)
