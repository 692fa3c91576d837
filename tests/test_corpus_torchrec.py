"""TorchRec's DLRM, DLRM_DCN, SimpleDeepFMNN and its four cross nets (EmbeddingBagCollection + KeyedJaggedTensor
inputs), and an HSTU written as generative-recommenders writes it (models/corpus): compiled with rec_ascend, their
training loss (with gradients) and forward equal eager's, a stream of batch sizes compiles at most twice, the
regions models/corpus/expected.py lists are found, and Dynamo breaks only where the table says. The same for TorchRec's
modules beyond the corpus (``torchrec_zoo.WIDE``: DeepFM and FactorizationMachine, MLP, EmbeddingCollection, position
weights, the experimental transformer DLRM); one in ``make test``, the rest slow."""
import pytest

pytest.importorskip("torchrec")

from models.corpus import testing  # noqa: E402
from models.corpus.expected import WIDE_EXPECTED  # noqa: E402
from models.corpus.harness import CASES, WIDE_CASES  # noqa: E402

PREFIXES = ("torchrec/", "gr/")


@pytest.mark.parametrize("case", [p for prefix in PREFIXES for p in testing.cases(prefix)])
def test_compiled_equals_eager_and_compiles_at_most_twice(case):
    testing.check_numbers_and_compiles(case)


@pytest.mark.parametrize("case, expect", [p for prefix in PREFIXES for p in testing.expectations(prefix)])
def test_expected_region_found(case, expect):
    testing.check_region(case, expect)


@pytest.mark.parametrize("case", [p for prefix in PREFIXES for p in testing.breaks(prefix)])
def test_graph_breaks_only_where_expected(case):
    testing.check_graph_breaks(case)


@pytest.mark.slow
def test_dlrm_training_through_inductor():
    """The same checks with Inductor compiling the rewritten graph, as rec_ascend does."""
    testing.check_numbers_and_compiles(CASES["torchrec/DLRM:train"], inductor=True)


WIDE_FAST = {"torchrec/PositionWeighted:train"}
WIDE = {name: case for name, case in WIDE_CASES.items() if name.startswith("torchrec/")}


def _wide(name: str, *values, id: str | None = None):
    return pytest.param(*values, id=id or name, marks=[] if name in WIDE_FAST else [pytest.mark.slow])


@pytest.mark.parametrize("case", [_wide(n, c) for n, c in WIDE.items()])
def test_beyond_the_corpus_equals_eager_and_compiles_at_most_twice(case):
    testing.check_numbers_and_compiles(case)


@pytest.mark.parametrize("case, expect", [_wide(n, c, e, id=f"{n}-{i}-{e.kind}") for n, c in WIDE.items()
                                          for i, e in enumerate(WIDE_EXPECTED[c.model])])
def test_beyond_the_corpus_region_found(case, expect):
    testing.check_region(case, expect)


@pytest.mark.parametrize("case", [_wide(n, c) for n, c in WIDE.items()])
def test_beyond_the_corpus_one_graph(case):
    testing.check_graph_breaks(case)
