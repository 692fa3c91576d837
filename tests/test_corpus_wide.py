"""The wider RecBole corpus (``recbole_zoo.WIDE_*``: models the benchmarked corpus does not hold), unmodified:
compiled with rec_ascend's passes, their loss (with gradients), predict and full-sort scores equal eager's and a
stream of batch sizes compiles at most twice per captured graph. ``make test`` runs five (GCSAN's session graphs,
``torch.unique(seq).tolist()``, break the graph where they failed to compile; BPR and FPMC train on sampled
negatives); the rest are slow. TorchRec's wider cases are in tests/test_corpus_torchrec.py."""
import json

import pytest

pytest.importorskip("recbole")
pytest.importorskip("pandas", reason="RecBole's data modules: pip install '.[test]'")

from models.corpus import testing  # noqa: E402
from models.corpus.expected import DIFFERENCES  # noqa: E402
from models.corpus.harness import WIDE_CASES  # noqa: E402

FAST = {"recbole/GCSAN:full_sort", "recbole/LR:predict", "recbole/STAMP:loss", "recbole/BPR:loss", "recbole/FPMC:full_sort"}


def _marks(name: str) -> list:
    marks = [] if name in FAST else [pytest.mark.slow]
    if name in DIFFERENCES:
        marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=DIFFERENCES[name]))
    return marks


@pytest.mark.parametrize("case", [pytest.param(c, id=n, marks=_marks(n)) for n, c in WIDE_CASES.items()
                                  if n.startswith("recbole/")])
def test_compiled_equals_eager_and_compiles_at_most_twice(case):
    testing.check_numbers_and_compiles(case)


def test_the_check_script_writes_its_row_and_table(tmp_path):
    """``python -m models.check_corpus_wide`` on one case with ``--replace``: the JSON row (the other rows kept) and
    the doc's table between its markers."""
    from models import check_corpus_wide

    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{check_corpus_wide.TABLE_START}\nold\n{check_corpus_wide.TABLE_END}\nafter\n")
    out = tmp_path / "wide.json"
    earlier = {"case": "recbole/DSSM:loss", "numbers_equal": True, "graphs": 1, "compiles": 2, "breaks": [],
               "regions": {}}
    out.write_text(json.dumps({"commit": "abc1234", "rows": [earlier, {**earlier, "case": "recbole/LR:predict"}]}))
    check_corpus_wide.main(["--cases", "recbole/LR:predict", "--replace", "--json", str(out), "--doc", str(doc)])
    kept, row = json.loads(out.read_text())["rows"]  # --replace keeps the other case's row, with its commit
    assert kept == {**earlier, "commit": "abc1234"}
    assert row["numbers_equal"] is True and row["graphs"] == 1 and row["compiles"] <= 2, row
    assert row["regions"] == {"embedding recompile::grouped_embedding_bag": 1}, row
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| recbole/LR:predict | yes | 1 / " in text
