"""Quantized inference tables: FBGEMM's bytes, the quantized grouped lookup against its reference and FBGEMM's
CPU TBE, recompile.quantize on models, and the embedding pass grouping quantized lookups."""
import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.quantize import QuantizedEmbedding, QuantizedEmbeddingBag
from recompile.runtime import embedding_native
from recompile.runtime.embedding import grouped_embedding_bag_reference
from recompile.runtime.quantized import SCALE_BIAS, dequantize_rows, quantize_rows, scale_bias

fbgemm = pytest.importorskip("fbgemm_gpu")
QOP = torch.ops.recompile.grouped_embedding_bag_quantized.default
IMPLS = ["reference"] + (["native"] if embedding_native.available() else [])
SMALL = DLRMConfig(table_rows=[50, 80, 120, 30], dim=16, bottom=[16, 16], top=[16, 1])


def _table(rows, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 3 + torch.randn(rows, 1, generator=g)
    if rows > 1:
        w[1] = 0.25  # a constant row: range 0
    return w


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_bytes_equal_fbgemm(qdtype, dtype):
    w = _table(37, 24).to(dtype)
    ours = quantize_rows(w, qdtype)
    if qdtype == "int8":
        theirs = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(w.float())
    else:
        theirs = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, 4)
    assert ours.dtype == torch.uint8 and torch.equal(ours, theirs)


@pytest.mark.parametrize("qdtype, levels", [("int8", 255), ("int4", 15)])
def test_round_trip_error_is_within_half_a_step(qdtype, levels):
    w = _table(64, 32)
    packed = quantize_rows(w, qdtype)
    back = dequantize_rows(packed, qdtype)
    scale = scale_bias(packed, qdtype)[:, :1].float()
    # Half a quantization step, plus (int4) the fp16 rounding of the bias and scale (a relative 2^-11 each).
    slack = 1e-6 if qdtype == "int8" else 2.0 ** -10 * (w.abs().amax(1, keepdim=True) + levels * scale)
    assert ((back - w).abs() <= scale / 2 + slack).all()
    assert packed.shape[1] == (32 + 8 if qdtype == "int8" else 16 + 4)
    assert torch.equal(back[1], torch.full((32,), 0.25))  # a constant row is exact


def _bag(draw, rows, batch, index_dtype):
    lengths = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    ids = torch.tensor(draw(st.lists(st.integers(0, rows - 1), min_size=sum(lengths), max_size=sum(lengths))),
                       dtype=index_dtype)
    offsets = torch.tensor([0] + lengths, dtype=index_dtype).cumsum(0).to(index_dtype)
    return ids, offsets


@st.composite
def lookups(draw):
    qdtype = draw(st.sampled_from(["int8", "int4"]))
    num = draw(st.integers(1, 3))
    layout = draw(st.sampled_from(["concat", "stack"]))
    dims = [draw(st.sampled_from([2, 6, 16, 40, 64, 72]))] * num if layout == "stack" else \
        [draw(st.sampled_from([2, 6, 16, 40, 64, 72])) for _ in range(num)]
    batch, index_dtype = draw(st.integers(0, 5)), draw(st.sampled_from([torch.int32, torch.int64]))
    tables, indices, offsets, psws, pooling, padding, last = [], [], [], [], [], [], []
    for t, dim in enumerate(dims):
        rows = draw(st.integers(1, 9))
        tables.append(quantize_rows(_table(rows, dim, seed=t), qdtype))
        ids, offs = _bag(draw, rows, batch, index_dtype)
        include_last = draw(st.booleans())
        indices.append(ids)
        offsets.append(offs if include_last else offs[:-1])
        last.append(include_last)
        mode = draw(st.sampled_from([0, 1]))
        pooling.append(mode)
        weighted = mode == 0 and draw(st.booleans())
        psws.append(torch.rand(ids.shape) + 0.5 if weighted else torch.empty(0))
        padding.append(draw(st.sampled_from([-1, 0])))
    names = ",".join(f"f{t}" for t in range(num))
    return tables, indices, offsets, psws, pooling, padding, last, qdtype, layout, names


@settings(max_examples=40, deadline=None)
@given(lookups())
def test_lookup_equals_dequantize_then_bag(case):
    tables, indices, offsets, psws, pooling, padding, last, qdtype, layout, names = case
    floats = [dequantize_rows(t, qdtype) for t in tables]
    expected = grouped_embedding_bag_reference(floats, indices, offsets, [p if p.numel() else None for p in psws],
                                               pooling, padding, last, layout, names.split(","))
    for impl in IMPLS:
        # The native kernel reads every such group itself: its torch fallback must not run.
        with mock.patch("recompile.runtime.quantized.forward_reference", side_effect=AssertionError("fell back")) \
                if impl == "native" else contextlib.nullcontext():
            out = QOP(tables, indices, offsets, psws, pooling, padding, last, qdtype, layout, names, "fatal", impl)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=impl)


def _one_table(qdtype="int8", rows=10, dim=16):
    return [quantize_rows(_table(rows, dim), qdtype)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offsets, why", [([1, 2], "must start at 0"), ([0, 3, 2], "not decrease"),
                                          ([0, 9], "not exceed len")])
def test_malformed_offsets_name_the_table(impl, offsets, why):
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=f"feature 'user_city'.*{why}"):
        QOP(_one_table(), [ids], [torch.tensor(offsets)], [torch.empty(0)], [0], [-1], [False], "int8", "concat",
            "user_city", "fatal", impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_id_and_bad_table_name_the_table(impl):
    with pytest.raises(IndexError, match="feature 'ad_id': id 10 is out of range for its table of 10 rows"):
        QOP(_one_table(), [torch.tensor([3, 10])], [torch.tensor([0, 1])], [torch.empty(0)], [0], [-1], [False], "int8",
            "concat", "ad_id", "fatal", impl)
    with pytest.raises(ValueError, match="'ad_id': a quantized table is a 2-D uint8 tensor"):
        QOP([torch.randn(10, 16)], [torch.tensor([3])], [torch.tensor([0])], [torch.empty(0)], [0], [-1], [False],
            "int8", "concat", "ad_id", "fatal", impl)


def test_op_schema_and_fake():
    args = (_one_table("int4"), [torch.tensor([1, 2, 3])], [torch.tensor([0, 1])], [torch.rand(3)], [0], [-1], [False],
            "int4", "concat", "f", "fatal", IMPLS[-1])
    torch.library.opcheck(QOP, args, test_utils=("test_schema", "test_faketensor"))


def _tbe_tables(qdtype, rows, dim, seeds):
    """Our packed tables with fp16-exact scale and bias (what FBGEMM's TBE stores), and the TBE holding them."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    sparse = SparseType.INT8 if qdtype == "int8" else SparseType.INT4
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([(f"t{s}", rows, dim, sparse, EmbeddingLocation.HOST) for s in seeds],
                                                  device="cpu", pooling_mode=PoolingMode.SUM,
                                                  output_dtype=SparseType.FP32)
    tbe.initialize_weights()
    tables = []
    for s, (codes, stored) in zip(seeds, tbe.split_embedding_weights()):
        packed = quantize_rows(_table(rows, dim, seed=s), qdtype)
        width = codes.shape[1]
        sb = scale_bias(packed, qdtype).half()
        packed[:, width:] = sb.to(SCALE_BIAS[qdtype]).view(torch.uint8)
        codes.copy_(packed[:, :width])
        stored.copy_(sb.view(torch.uint8))
        tables.append(packed)
    return tables, tbe


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_lookup_equals_fbgemm_cpu_tbe(qdtype):
    rows, dim, batch, seeds = 40, 32, 7, (0, 1, 2)
    tables, tbe = _tbe_tables(qdtype, rows, dim, seeds)
    g = torch.Generator().manual_seed(1)
    lengths = [torch.randint(0, 4, (batch,), generator=g) for _ in seeds]
    indices = [torch.randint(0, rows, (int(n.sum()),), generator=g) for n in lengths]
    offsets = [F.pad(n.cumsum(0), (1, 0)) for n in lengths]
    theirs = tbe(torch.cat(indices).int(), F.pad(torch.cat(lengths).cumsum(0), (1, 0)).int())
    for impl in IMPLS:
        ours = QOP(tables, indices, offsets, [torch.empty(0)] * 3, [0] * 3, [-1] * 3, [True] * 3, qdtype, "concat",
                   "a,b,c", "fatal", impl)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=impl)


class Tables(nn.Module):
    """nn.EmbeddingBag (sum, mean, per-sample weights), nn.Embedding, and a TorchRec EmbeddingBagCollection."""

    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.bags = nn.ModuleList([nn.EmbeddingBag(20, 8, mode="sum"), nn.EmbeddingBag(30, 8, mode="mean")])
        self.seq = nn.Embedding(25, 8, padding_idx=0)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=15,
                                                                     feature_names=["f"])])

    def forward(self, ids, offsets, psw, seq, kjt):
        pooled = torch.stack([self.bags[0](ids, offsets, psw), self.bags[1](ids, offsets)], 1)
        return pooled, self.seq(seq), self.ebc(kjt).values()


def test_quantize_modules_equal_their_dequantized_tables():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = Tables().eval().requires_grad_(False)
    ids, offsets = torch.tensor([1, 4, 9, 2, 13]), torch.tensor([0, 2, 2])
    args = (ids, offsets, torch.rand(5), torch.tensor([[0, 3], [24, 5]]),
            KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 14, 7]), torch.tensor([2, 0, 1])))
    for qdtype in ("int8", "int4"):
        quantized = recompile.quantize(model, qdtype)
        names = [n for n, m in quantized.named_modules() if isinstance(m, (QuantizedEmbeddingBag, QuantizedEmbedding))]
        assert names == ["bags.0", "bags.1", "seq", "ebc.embedding_bags.t"]
        floats = Tables().eval()
        floats.load_state_dict({n.removesuffix(".weight") + ".weight": quantized.get_submodule(n.removesuffix(".weight"))
                                .dequantized() for n in model.state_dict()})
        for got, want in zip(quantized(*args), floats(*args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert model.bags[0].weight.dtype == torch.float32  # a copy by default


def test_quantize_refuses_training_and_trainable_tables_unless_forced():
    model = DLRM(SMALL)
    with pytest.raises(ValueError, match="training mode"):
        recompile.quantize(model)
    with pytest.raises(ValueError, match="table 'embeddings.0' requires grad"):
        recompile.quantize(model.eval())
    assert isinstance(recompile.quantize(model.train(), "int4", force=True).embeddings[3], nn.Module)
    with pytest.raises(ValueError, match="dtype 'int2'"):
        recompile.quantize(model.eval().requires_grad_(False), "int2")


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_compiled_quantized_dlrm_is_one_grouped_call_equal_to_dequantized_eager(qdtype):
    model = DLRM(SMALL).eval().requires_grad_(False)
    quantized = recompile.quantize(model, qdtype)
    for i, table in enumerate(model.embeddings):  # the eager float model over the dequantized tables
        table.weight.copy_(quantized.embeddings[i].dequantized())
    report = recompile.explain(quantized, *synthetic_batch(SMALL, 8)).to_dict()
    (region,) = [r for r in report["regions"] if r["kind"] == "embedding"]
    assert region["op"] == "recompile::grouped_embedding_bag_quantized" and len(region["replaced"]) == 5
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(quantized, backend=counter)
    for batch in (8, 13, 21):
        args = synthetic_batch(SMALL, batch)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


@pytest.mark.skipif(not embedding_native.available(), reason="built without the native kernels")
@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_native_kernel_on_every_instruction_set_and_streamed_output(qdtype):
    from recompile.runtime.native import available_isas, use_isa

    g = torch.Generator().manual_seed(3)
    tables = [quantize_rows(_table(50, dim, seed=i), qdtype) for i, dim in enumerate((160, 90))]  # 64-blocks, 16s, tail
    batch = 5000  # a [5000, 250] fp32 output is past embedding_native.STREAM_BYTES: written with streaming stores
    lengths = [torch.randint(0, 3, (batch,), generator=g) for _ in tables]
    indices = [torch.randint(0, 50, (int(n.sum()),), generator=g) for n in lengths]
    offsets = [F.pad(n.cumsum(0), (1, 0))[:-1] for n in lengths]
    args = (tables, indices, offsets, [torch.rand(i.shape, generator=g) for i in indices], [0, 0], [-1, 3],
            [False, False], qdtype, "concat", "a,b", "fatal")
    expected = QOP(*args, "reference")
    for isa in available_isas():
        with use_isa(isa):
            torch.testing.assert_close(QOP(*args, "native"), expected, rtol=1e-5, atol=1e-5, msg=isa)


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_large_tables_start_on_a_huge_page_with_fbgemm_bytes(qdtype):
    """A packed table of at least 2 MiB starts on a 2 MiB boundary, its storage covers its last 2 MiB page (so all of
    it can be put on transparent huge pages), and its bytes are still FBGEMM's."""
    from recompile.runtime.quantized import HUGE_PAGE

    w = torch.randn(50_000 if qdtype == "int8" else 120_000, 64, generator=torch.Generator().manual_seed(2))
    ours = quantize_rows(w, qdtype)
    theirs = (torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(w) if qdtype == "int8" else
              torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, 4))
    assert ours.nbytes >= HUGE_PAGE and ours.data_ptr() % HUGE_PAGE == 0 and ours.is_contiguous()
    end = ours.untyped_storage().data_ptr() + ours.untyped_storage().nbytes()
    assert end >= ours.data_ptr() + -(-ours.nbytes // HUGE_PAGE) * HUGE_PAGE
    assert torch.equal(ours, theirs)
