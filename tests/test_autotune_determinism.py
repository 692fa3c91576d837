"""Repeatable across machines (issue 17, item 5; ``docs/determinism.md``): trained from the same seed, the race's
candidates (each forced, real Inductor), autotune off, every region on its reference kernel and eager PyTorch give
numbers within ``candidate_spread.BOUND`` of each other, relative: they differ only in the floating-point order of
the kernels each runs. What another machine's race keeps is one of these runs."""
import pytest
import torch

from tests import candidate_spread


def tiny_dlrm(batch: int = 16):
    """A DLRM with three small tables (a lookup and an interaction region), its inputs and a loss."""
    from models.dlrm import DLRM, DLRMConfig, synthetic_batch

    cfg = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])
    torch.manual_seed(0)
    return DLRM(cfg), synthetic_batch(cfg, batch), lambda out: out.float().pow(2).mean()


FEW = (("eager", None, None), candidate_spread.AUTOTUNE_OFF, candidate_spread.REFERENCE_KERNELS)  # one compile


@pytest.mark.parametrize("make, variants", [
    pytest.param(tiny_dlrm, FEW, id="tiny-dlrm"),
    pytest.param(tiny_dlrm, candidate_spread.VARIANTS, id="tiny-dlrm-every-candidate", marks=pytest.mark.slow),
    pytest.param(candidate_spread.zoo("deepfm"), candidate_spread.VARIANTS, id="zoo-deepfm", marks=pytest.mark.slow),
])
def test_every_candidate_gives_the_same_numbers_up_to_the_stated_bound(make, variants, tmp_path, monkeypatch):
    """Three SGD steps: the captured graph eagerly, Inductor on the rewrite with the native kernels, the rewrite on
    the reference kernels and eager PyTorch (slow: every whole-graph candidate forced, and a zoo model)."""
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    runs = candidate_spread.runs(make, 3, variants)
    assert len(runs) == len(variants) + 2, sorted(runs)  # each a run of its own, and eager PyTorch on two threads
    spread = candidate_spread.spread(runs)
    assert spread["loss"] <= candidate_spread.BOUND and spread["params"] <= candidate_spread.BOUND, spread
