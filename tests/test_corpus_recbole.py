"""RecBole 1.2.1's models, unmodified, on its MovieLens-100k (models/corpus): compiled with rec_ascend, their loss
(with gradients), predict and full-sort scores equal eager's, a stream of batch sizes compiles at most twice, the
regions models/corpus/expected.py lists are found, and Dynamo breaks only where the table says."""
import pytest

pytest.importorskip("recbole")
pytest.importorskip("pandas", reason="RecBole's data modules: pip install '.[test]'")

from models.corpus import testing  # noqa: E402
from models.corpus.harness import CASES  # noqa: E402

PREFIX = "recbole/"


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
