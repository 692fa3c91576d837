"""Distributed training on 1, 2 and 4 spawned processes (gloo on 127.0.0.1), every run bounded in time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from recompile.distributed import Sharding
from recompile.distributed.sharding import hash_owner
from tests.distributed_workers import (
    assemble, checkpoint_continue, compiled_training, dead_rank, dynamic_restored, dynamic_training, mixed_tables,
    out_of_step, reference_state, prefetched_training, run_ranks, torchrec_dmp_compiled, torchrec_model, torchrec_plan,
)

STEPS, SAVE_AFTER = 4, 2


def _ok(results, hung):
    assert not hung, f"ranks {hung} did not finish in time"
    for rank, result in enumerate(results):
        assert result is not None and result.error is None, f"rank {rank}: {result and result.trace}"
    return [r.value for r in results]


def _assert_same(got: dict, expected: dict, rtol: float = 1e-5):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=rtol * value.abs().max().item(), msg=name)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    """Row-wise DLRM on 2 ranks: trained SAVE_AFTER steps, saved, trained on to STEPS (the continuation baseline)."""
    root = tmp_path_factory.mktemp("two_ranks")
    path = str(root / "ckpt")
    results = _ok(*run_ranks(checkpoint_continue, 2, ("row_wise",), path, SAVE_AFTER, STEPS, False))
    return path, assemble(results)


def test_row_wise_dlrm_on_two_ranks_matches_one_process(two_rank_checkpoint):
    _, state = two_rank_checkpoint
    _assert_same(state, reference_state(STEPS, 16, momentum=0.9))


def test_table_wise_dlrm_on_two_ranks_matches_one_process_and_reshards_row_wise(tmp_path):
    path = str(tmp_path / "ckpt")
    continued = assemble(_ok(*run_ranks(checkpoint_continue, 2, ("table_wise",), path, SAVE_AFTER, STEPS, False, 24)))
    _assert_same(continued, reference_state(STEPS, 24, momentum=0.9))
    # The table-wise checkpoint, loaded row-wise on 3 ranks (uneven row blocks), continues the same way.
    results = _ok(*run_ranks(checkpoint_continue, 3, ("row_wise",), path, SAVE_AFTER, STEPS, True, 24))
    _assert_same(assemble(results), continued)


def test_prefetched_lookups_one_round_per_step_same_parameters():
    results = _ok(*run_ranks(prefetched_training, 2, 3, 16))
    _assert_same(assemble([r["state"] for r in results]), reference_state(3, 16))
    for r in results:  # one exchange of counts, ids, bags, pooled results and gradients per step for all 4 tables
        assert r["calls"] == {"counts": 3, "ids": 3, "bags": 3, "pooled": 3, "grads": 3}, r["calls"]


# On 4 ranks: every kind of placement, row-wise over a group of 2 ranks among them.
GROUPED = {"embeddings.0": Sharding("table_wise", 3), "embeddings.1": Sharding("row_wise", 0, 2),
           "embeddings.2": Sharding("row_wise", 2, 2), "embeddings.3": Sharding("row_wise")}


@pytest.mark.parametrize("world_size, kinds", [(1, ("row_wise",)), (4, GROUPED)])
def test_checkpoint_from_two_ranks_continues_on_other_world_sizes(two_rank_checkpoint, tmp_path, world_size, kinds):
    path, continued_on_two = two_rank_checkpoint
    results = _ok(*run_ranks(checkpoint_continue, world_size, kinds, path, SAVE_AFTER, STEPS, True))
    _assert_same(assemble(results), continued_on_two)


@pytest.mark.parametrize("shardings", [
    {"emb": Sharding("row_wise"), "mean": Sharding("table_wise", 1), "weighted": Sharding("row_wise")},
    {"emb": Sharding("table_wise", 0), "mean": Sharding("row_wise"), "weighted": Sharding("table_wise", 1)},
], ids=["row_wise", "table_wise"])
def test_unpooled_mean_and_weighted_tables_on_two_ranks_equal_torch(shardings):
    for rank, errors in enumerate(_ok(*run_ranks(mixed_tables, 2, shardings))):
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_dynamic_tables_each_key_on_its_owner_and_union_equals_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    results = _ok(*run_ranks(dynamic_training, 2, 3, 16, path))
    single = dynamic_training(0, 1, 3, 16)
    restored = dynamic_restored(path)  # the 2-rank checkpoint loaded into one process
    for t, (ref_keys, ref_rows) in enumerate(single["tables"]):
        for rank, result in enumerate(results):
            keys = result["tables"][t][0]
            assert keys.numel() and bool((hash_owner(keys, 2) == rank).all()), f"table {t}: a key off its owner"
        keys = torch.cat([r["tables"][t][0] for r in results])
        rows = torch.cat([r["tables"][t][1] for r in results])
        order = torch.argsort(keys)
        assert torch.equal(keys[order], ref_keys), f"table {t}: the shards' keys are not the single table's"
        torch.testing.assert_close(rows[order], ref_rows, rtol=1e-5, atol=1e-6)
        assert float(ref_rows[:, :8].std()) > 1e-3, "training did not change the rows"
        assert torch.equal(restored[t][0], ref_keys)
        torch.testing.assert_close(restored[t][1], ref_rows, rtol=1e-5, atol=1e-6)
    _assert_same(results[0]["dense"], single["dense"])


def test_rank_dying_mid_step_makes_the_others_fail_with_a_clear_error():
    start = time.monotonic()
    results, hung = run_ranks(dead_rank, 2, timeout_s=90, collective_timeout_s=15)
    assert not hung and time.monotonic() - start < 90
    assert results[1] is None  # it exited without a word
    error = results[0].error
    assert error and error.startswith("CollectiveError") and "a peer rank died" in error, results[0]


def test_ranks_calling_tables_out_of_step_fail_naming_the_round():
    results, hung = run_ranks(out_of_step, 2, timeout_s=90, collective_timeout_s=15)
    assert not hung
    for rank, result in enumerate(results):
        assert result.error and result.error.startswith("CollectiveError"), (rank, result)
        assert "lookup round 0 of tables ['embeddings." in result.error and "different orders" in result.error


@pytest.mark.slow
def test_compiled_sharded_dlrm_matches_one_process():
    results = _ok(*run_ranks(compiled_training, 2, ("row_wise",), 2, 16, timeout_s=400))
    _assert_same(assemble([r["state"] for r in results]), reference_state(2, 16))
    for r in results:  # the owners' pooling (all 4 local tables: one grouped lookup) and the dense layers compiled
        assert 1 <= r["lookup_graphs"] <= 2 and r["dense_graphs"] >= 1, r
        assert r["local_tables"] == 4 and r["grouped"] == [4], r


@pytest.mark.slow
def test_torchrec_dmp_table_wise_compiles_with_rec_ascend_on_cpu():
    results = _ok(*run_ranks(torchrec_dmp_compiled, 2, "table_wise", timeout_s=400))
    for r in results:
        assert "table_wise" in r["plan"]
        torch.testing.assert_close(r["compiled"], r["eager"], rtol=1e-5, atol=1e-6)


def test_torchrec_has_no_row_wise_sharding_on_cpu():
    """A fact the README states: TorchRec 1.8 offers no row-wise kernel for CPU (table-wise and data-parallel
    work); recompile.distributed shards row-wise on CPU."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    model = torchrec_model()
    with pytest.raises(RuntimeError, match="No available sharding type and compute kernel combination"):
        torchrec_plan(model, 2, "row_wise").plan(model, get_default_sharders())


@pytest.mark.slow
def test_models_train_with_nproc_trains_a_zoo_dlrm_on_two_ranks(tmp_path):
    """``python -m models.train --nproc 2`` starts two workers through torch's launcher; rank 0 reports."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "models.train", "--model", "dlrm", "--data", "criteo-synthetic", "--nproc", "2",
               "--epochs", "1", "--ctr-rows", "1024", "--batch-size", "128", "--backend", "eager", "--quiet",
               "--json", str(out)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("sharding plan: 4 tables on 2 ranks") == 1, proc.stdout  # printed by rank 0 only
    assert proc.stdout.count("dlrm on criteo-synthetic") == 1, proc.stdout
    result = json.loads(out.read_text())
    assert result["steps"] == 8 and 0.0 < result["metrics"]["AUC"] < 1.0
