"""hkv's dequantize-on-copy: the C++ probe's paths per instruction set (hkv/csrc/dequantize.h: portable, AVX2,
AVX-512) and the Triton find kernel (hkv/triton_kernels.py, TRITON_INTERPRET=1 here), each equal bit for bit to
``hkv.rowwise.dequantize_rows`` of the stored rows; the forced ISA setting (RECOMPILE_ISA, ``use_isa``) reaches hkv."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hkv
from hkv import cpu, kernels
from hkv.rowwise import dequantize_rows, quantize_rows
from recompile.runtime.native import ISAS, use_isa

pytestmark = pytest.mark.skipif(not cpu.available(), reason="hkv._C is not built")
HERE_ISAS = [name for name in ISAS if cpu.available() and torch.ops.hkv_native.isa_available(name)]
# columns around the vector widths (8 AVX2, 16 AVX-512 and int4's 16 a step): whole vectors, tails, tails only
DIMS = [2, 6, 8, 16, 30, 64, 130]


def filled(qdtype, dim, kernel="cpu", n=120, seed=0):
    """A table of ``n`` keys holding rows of mixed scales; (table, keys, values written)."""
    g = torch.Generator().manual_seed(seed)
    t = hkv.HashTable(dim=dim, init_capacity=256, max_capacity=1 << 12, bucket_size=16, dtype=qdtype, kernel=kernel)
    keys = torch.randperm(10 * n, generator=g)[:n] * 7919 + 3
    values = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 4 - 1
    t.insert_or_assign(keys, values)
    return t, keys, values


def expected(values, qdtype):
    return dequantize_rows(quantize_rows(values, qdtype), qdtype) if qdtype else values


@pytest.mark.parametrize("isa", HERE_ISAS)
@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_cpu_dequantize_paths_equal_reference(qdtype, isa):
    """find and find_or_insert's copy-out, on every dim around the vector widths, on each ISA path."""
    for dim in DIMS:
        t, keys, values = filled(qdtype, dim)
        probe = torch.cat([keys.flip(0), torch.tensor([1, 2])])  # two absent keys
        with use_isa(isa):
            assert torch.ops.hkv_native.isa() == isa
            rows, found = t.find(probe)
            copied = t.find_or_insert(keys[:50])
        assert found.tolist() == [True] * len(keys) + [False, False]
        assert torch.equal(rows[:-2], expected(values.flip(0), qdtype)), (dim, isa)
        assert torch.equal(rows[-2:], torch.zeros(2, dim))
        assert torch.equal(copied, expected(values[:50], qdtype)), (dim, isa)


@settings(max_examples=25, deadline=None)
@given(dim=st.integers(1, 40).map(lambda d: 2 * d), n=st.integers(1, 40), seed=st.integers(0, 1000),
       qdtype=st.sampled_from(["int8", "int4"]), constant=st.booleans())
def test_cpu_dequantize_paths_agree(dim, n, seed, qdtype, constant):
    """Every ISA path gives the same bits, constant rows (scale from a zero range) included."""
    t, keys, values = filled(qdtype, dim, n=n, seed=seed)
    if constant:
        t.insert_or_assign(keys, torch.full((n, dim), 0.37))
        values = torch.full((n, dim), 0.37)
    outs = []
    for isa in HERE_ISAS:
        with use_isa(isa):
            outs.append(t.find(keys)[0])
    for out in outs:
        assert torch.equal(out, expected(values, qdtype))


def test_forced_isa_reaches_hkv():
    """RECOMPILE_ISA (runtime/native.py's setting) chooses hkv's path for the process; a bad name is an error
    naming it."""
    code = "import torch, hkv.cpu as c; c.available(); print(torch.ops.hkv_native.isa())"
    env = dict(os.environ, RECOMPILE_ISA="generic")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "generic", out.stderr[-2000:]
    with pytest.raises(ValueError, match="sse9"):
        torch.ops.hkv_native.set_isa("sse9")


@pytest.mark.parametrize("qdtype", ["int8", "int4", None])
def test_triton_find_equals_reference(qdtype):
    """The Triton find (probe + read out in one launch) on dims around its column blocks, absent keys zero."""
    for dim in (2, 6, 130) if qdtype else (6,):
        t, keys, values = filled(qdtype, dim, kernel="triton", n=70)
        probe = torch.cat([keys[::2], torch.tensor([5, 6])]).int()  # int32 ids; two absent keys
        rows, found = t.find(probe)
        assert rows.dtype == torch.float32 and found.tolist() == [True] * 35 + [False, False]
        assert torch.equal(rows[:-2], expected(values[::2], qdtype)), dim
        assert torch.equal(rows[-2:], torch.zeros(2, dim))


def test_triton_find_keeps_a_float_table_dtype_and_takes_no_keys():
    t, keys, values = filled(None, 4, kernel="triton", n=20)
    half = hkv.HashTable(dim=4, init_capacity=64, max_capacity=64, bucket_size=16, dtype=torch.bfloat16,
                         kernel="triton")
    half.insert_or_assign(keys, values)
    rows, found = half.find(keys)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, values.bfloat16()) and bool(found.all())
    rows, found = t.find(keys[:0])
    assert rows.shape == (0, 4) and found.shape == (0,)


def test_triton_supports_names_the_int32_limit(monkeypatch):
    """The registry's supports for the Triton probe (hkv::lookup) refuses a table past int32 offsets at compile
    time, naming it."""
    t, _, _ = filled("int8", 6, kernel="triton", n=10)
    assert kernels.supports("triton", t) is True
    monkeypatch.setattr(t, "_keys", torch.empty(1, dtype=torch.int64).expand(2**31))
    assert "int32" in kernels.supports("triton", t) and t.name in kernels.supports("triton", t)
