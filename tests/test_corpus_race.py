"""The autotune race is invisible on the third-party corpus too (issue 17): for a training case, three steps give
bit-identical losses and buffers with an empty and a warm cache, the same random draws whatever candidate is
forced or with autotune off, and eager's buffers (BatchNorm statistics, counters) with dropout off
(``tests/race_checks.py``).

Each case compiles its model six times (about 10-30 s apiece on 2 cores), so the suite runs the cases that carry
each hazard the race has to hide: BatchNorm statistics (DCNV2, NFM), dropout (SASRec), a GRU (GRU4Rec: the
rewrite's recurrent op, which keeps its gates for its backward, against ATen's GRU eagerly, with dropout before it;
until rec_ascend traced nn.GRU it was the corpus's graph break between two graphs), a loss that updates a tensor in place (xDeepFM's ``l2_reg``), TorchRec's KeyedJaggedTensor
lookups (DLRM) and a jagged HSTU (gr/HSTU). ``RECOMPILE_FULL_CORPUS=1`` runs every training case of the corpus.
``make test`` runs one hazard (the GRU, GRU4Rec); the others are marked slow (``make test-slow``).
"""
import os

import pytest

pytest.importorskip("recbole")
pytest.importorskip("pandas", reason="RecBole's data modules: pip install '.[test]'")

import race_checks  # noqa: E402
from models.corpus.harness import BATCHES, CASES  # noqa: E402

HAZARDS = {"recbole/DCNV2:loss", "recbole/NFM:loss", "recbole/SASRec:loss", "recbole/GRU4Rec:loss",
           "recbole/xDeepFM:loss", "torchrec/DLRM:train", "gr/HSTU:train"}
FULL = os.environ.get("RECOMPILE_FULL_CORPUS") == "1"
DEFAULT = "recbole/GRU4Rec:loss"  # the cheapest hazard (a GRU: our recurrent op against ATen's)
TRAINING = [pytest.param(c, id=c.name, marks=([] if c.name == DEFAULT else [pytest.mark.slow]) + (
    [] if FULL or c.name in HAZARDS else [pytest.mark.skip(reason="RECOMPILE_FULL_CORPUS=1 runs it")]))
    for c in CASES.values() if c.training]
assert HAZARDS <= {c.name for c in CASES.values() if c.training}, "every hazard case exists"


@pytest.mark.parametrize("case", TRAINING)
def test_corpus_training_gives_the_same_numbers_whatever_the_cache_and_the_candidate(case, tmp_path, monkeypatch):
    def make():
        return case.make(0), case.inputs(BATCHES[0], 0), lambda loss: loss

    race_checks.assert_race_invisible(make, 3, tmp_path, monkeypatch)
