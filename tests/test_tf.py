"""TensorFlow front end: real TF models frozen in a subprocess, imported, compared with TensorFlow, compiled.

TensorFlow and triton load conflicting LLVM builds, so TensorFlow only ever runs in the subprocess
(``models/tf_models.py``); this process reads the GraphDefs it wrote without TensorFlow.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import cli
from recompile.frontends import graph_proto
from recompile.frontends.tensorflow import import_graph
from torch._dynamo.testing import CompileCounterWithBackend

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

MODELS = ["wide_deep", "dlrm", "dcn", "transformer", "ops"]


@pytest.fixture(scope="module")
def tf_dir(tmp_path_factory):
    if importlib.util.find_spec("tensorflow") is None:
        pytest.fail("TensorFlow is not installed: install the `tf` extra (`pip install -e .[tf]`; `make test` does)")
    out = tmp_path_factory.mktemp("tf_models")
    script = Path(__file__).parents[1] / "models" / "tf_models.py"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def load(tf_dir, name):
    entry = json.loads((tf_dir / "models.json").read_text())[name]
    arrays = np.load(tf_dir / f"{name}.npz")
    inputs = [torch.from_numpy(arrays[f"in:{i}"]) for i in range(len(entry["inputs"]))]
    expected = [torch.from_numpy(arrays[f"out:{i}"]) for i in range(len(entry["outputs"]))]
    return entry, inputs, expected


def assert_matches(got, expected):
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype, f"output {i}: {g.dtype} != {e.dtype}"
        torch.testing.assert_close(g.detach(), e, rtol=1e-5, atol=1e-6, msg=lambda m: f"output {i}: {m}")


def calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


@pytest.mark.parametrize("name", MODELS)
def test_imported_graph_matches_tensorflow(tf_dir, name):
    entry, inputs, expected = load(tf_dir, name)
    gm = import_graph(tf_dir / f"{name}.pb", entry["inputs"], entry["outputs"])
    assert_matches(gm(*inputs), expected)


def test_embedding_lookups_import_as_embedding_patterns(tf_dir):
    entry, _, _ = load(tf_dir, "dlrm")
    dlrm = import_graph(tf_dir / "dlrm.pb", entry["inputs"], entry["outputs"])
    bags = calls(dlrm, F.embedding_bag)
    assert [b.kwargs["mode"] for b in bags] == ["sum", "mean", "sum"]  # sqrtn: a sum bag with 1/sqrt(n) weights
    assert bags[2].kwargs["per_sample_weights"] is not None
    tables = {b.args[1].target for b in bags}
    assert tables <= dict(dlrm.named_parameters()).keys() and len(tables) == 3  # the tables themselves, no Unique
    assert "unique" not in dlrm.code
    for name, count in [("wide_deep", 6), ("dcn", 2), ("transformer", 1)]:
        entry, _, _ = load(tf_dir, name)
        gm = import_graph(tf_dir / f"{name}.pb", entry["inputs"], entry["outputs"])
        lookups = calls(gm, F.embedding)
        assert len(lookups) == count
        assert all(n.args[1].target in dict(gm.named_parameters()) for n in lookups)


def test_imported_dlrm_fine_tunes(tf_dir):
    entry, inputs, _ = load(tf_dir, "dlrm")
    gm = import_graph(tf_dir / "dlrm.pb", entry["inputs"], entry["outputs"])
    params = dict(gm.named_parameters())
    assert len(params) == 11  # 4 dense layers (kernel, bias) and 3 tables
    assert not any(b.is_floating_point() and b.numel() > 1 for b in gm.buffers())  # index constants only
    gm(*inputs).pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


@pytest.mark.parametrize("name", [pytest.param("wide_deep", marks=pytest.mark.slow), "dlrm", "transformer", "ops"])
def test_compile_tf_matches_tensorflow(tf_dir, name):
    entry, inputs, expected = load(tf_dir, name)
    compiled = recompile.compile_tf(tf_dir / f"{name}.pb", entry["inputs"], entry["outputs"])
    torch._dynamo.utils.counters.clear()
    assert_matches(compiled(*inputs), expected)
    assert not torch._dynamo.utils.counters["graph_break"]  # data-dependent sizes (bag counts, Unique) included


@pytest.mark.slow  # the compile count over batches: tests/test_foundation.py, test_models.py in make test
def test_compiled_batches_compile_at_most_twice(tf_dir):
    entry, inputs, expected = load(tf_dir, "dcn")
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(import_graph(tf_dir / "dcn.pb", entry["inputs"], entry["outputs"]), backend=counter)
    for batch in (6, 3, 5, 2):  # the model is row-wise: a prefix of the batch gives a prefix of TF's outputs
        assert_matches(compiled(*[x[:batch] for x in inputs]), [e[:batch] for e in expected])
    assert counter.frame_count <= 2


def test_sources_path_bytes_message_and_saved_model(tf_dir):
    entry, inputs, expected = load(tf_dir, "wide_deep")
    data = (tf_dir / "wide_deep.pb").read_bytes()
    message = graph_proto.GraphDef.FromString(data)
    for source in (str(tf_dir / "wide_deep.pb"), data, message, tf_dir / "wide_deep_saved_model"):
        assert_matches(import_graph(source, entry["inputs"], entry["outputs"])(*inputs), expected)
    default = import_graph(data)  # every Placeholder in graph order, and the sinks
    assert default.tf_outputs == entry["outputs"] and sorted(default.tf_inputs) == sorted(entry["inputs"])
    saved = import_graph(tf_dir / "wide_deep_saved_model")  # the serving signature
    assert saved.tf_inputs == entry["inputs"] and saved.tf_outputs == [f"{name}:0" for name in entry["outputs"]]
    assert_matches(saved(*inputs), expected)


def test_cli_import_tf(tf_dir, capsys):
    entry, _, _ = load(tf_dir, "dlrm")
    argv = ["import-tf", str(tf_dir / "dlrm.pb"), "--inputs", ",".join(entry["inputs"]), "--outputs", "Identity"]
    assert cli.main(argv + ["--print"]) == 0
    out = capsys.readouterr().out
    assert "embedding_bag x3" in out and "def forward(self, dense, indices0, values0" in out
    assert cli.main(["import-tf", str(tf_dir / "dlrm.pb"), "--inputs", "dense"]) == 2
    assert "placeholder 'values0' is needed by the outputs but is not among the inputs" in capsys.readouterr().err
