"""RecBole 1.2.1's models, unmodified, on its MovieLens-100k (models/corpus): compiled with rec_ascend, their loss
(with gradients), predict and full-sort scores equal eager's, a stream of batch sizes compiles at most twice, the
regions models/corpus/expected.py lists are found, and Dynamo breaks only where the table says."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("recbole")
pytest.importorskip("pandas", reason="RecBole's data modules: pip install '.[test]'")

from models.corpus import testing  # noqa: E402
from models.corpus.harness import CASES  # noqa: E402

PREFIX = "recbole/"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", testing.cases(PREFIX))
def test_compiled_equals_eager_and_compiles_at_most_twice(case):
    testing.check_numbers_and_compiles(case)


@pytest.mark.parametrize("case, expect", testing.expectations(PREFIX))
def test_expected_region_found(case, expect):
    testing.check_region(case, expect)


@pytest.mark.parametrize("case", testing.breaks(PREFIX))
def test_graph_breaks_only_where_expected(case):
    testing.check_graph_breaks(case)


@pytest.mark.slow
def test_fm_training_through_inductor():
    """The same checks with Inductor compiling the rewritten graph, as rec_ascend does."""
    testing.check_numbers_and_compiles(CASES["recbole/FM:loss"], inductor=True)


FULL_SORT_1 = CASES["recbole/SASRec:full_sort"]  # plain Inductor fails on it at batch 1 (torch 2.13's matmul
# decomposition: "Attempting to broadcast a dimension of length 12"), eager runs it


def full_sort_at_batch_1(options):
    """SASRec's full_sort_predict at batch 1 under no_grad, compiled with rec_ascend (Inductor), against eager."""
    import torch

    torch._dynamo.reset()
    module = FULL_SORT_1.make(0)
    inputs = FULL_SORT_1.inputs(1, 0)
    with torch.no_grad():
        got = torch.compile(module, backend="rec_ascend", options=options)(*inputs)
        torch.testing.assert_close(got, module(*inputs), rtol=1e-5, atol=1e-5)


def test_full_sort_at_batch_1_drops_a_candidate_inductor_fails_to_compile(tmp_path, monkeypatch):
    """The race with plain Inductor (``inductor-captured``) made to compile: its failure is named in the decision,
    the candidate left out of the race, and the scores equal eager's."""
    import json

    from recompile import autotune

    real = autotune.choose_compiles

    def compile_captured_only(graphs, builders, *args, **kwargs):
        captured = builders["inductor-captured"]
        fastest = real(graphs, builders, *args, **kwargs)
        builders.pop("inductor", None)  # the rewrite's Inductor compiles (and is timed) in the other tests
        builders["inductor-captured"] = captured
        return fastest

    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "choose_compiles", compile_captured_only)
    full_sort_at_batch_1(None)
    decisions = [json.loads(f.read_text()) for f in (tmp_path / "autotune").glob("*.json")]
    assert [d["rejected"]["inductor-captured"].split(":")[0] for d in decisions] == ["failed to compile"], decisions


def test_full_sort_at_batch_1_without_regions_runs_eagerly_where_inductor_fails():
    """No rec pass, no race: the graph is Inductor's alone, and where Inductor fails it runs eagerly, warned."""
    from recompile.pipeline import PASS_ORDER

    with pytest.warns(UserWarning, match="Inductor failed to compile graph"):
        full_sort_at_batch_1({"autotune": False, "passes": dict.fromkeys(PASS_ORDER, False)})


def test_building_a_sequential_model_leaves_anomaly_detection_off():
    """RecBole's sequential package turns autograd's anomaly detection on at its import (sine.py), which the first
    sequential model built imports: every step after it would record tracebacks and check gradients (the corpus
    bench timed 26 of its 48 cases so). A fresh process, so that the package is imported by this build."""
    code = ("import torch; from models.corpus.harness import CASES; case = CASES['recbole/SASRec:loss']; "
            "case.inputs(16, 0); assert not torch.is_anomaly_enabled(), 'on after the inputs'; "
            "case.make(0); assert not torch.is_anomaly_enabled(), 'on after the model'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
