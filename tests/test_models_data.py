"""Data loaders on the real MovieLens-100k file and GroupLens formats, synthetic CTR data, metrics on known cases."""
import math

import numpy as np
import pytest
import torch

from models import data as D
from models.compare import paired
from models.metrics import (
    auc, hit_rate, log_loss, ndcg, popularity_scores, ranking_metrics, target_ranks, user_gains,
)


@pytest.fixture(scope="module")
def ml100k():
    return D.load_ratings()


def test_movielens_100k_from_the_recbole_wheel(ml100k):
    assert (len(ml100k), ml100k.num_users, ml100k.num_items) == (100_000, 943, 1682)
    assert ml100k.items.min() == 1 and ml100k.items.max() == 1682  # 0 is padding
    assert ml100k.source.endswith("ml-100k.inter")


def test_leave_one_out_is_by_timestamp(ml100k):
    split = D.leave_one_out(ml100k)
    user = 7
    rows = np.flatnonzero(ml100k.users == user)
    order = rows[np.lexsort((rows, ml100k.timestamps[rows]))]
    assert split.test_targets[user] == ml100k.items[order[-1]]
    assert split.valid_targets[user] == ml100k.items[order[-2]]
    np.testing.assert_array_equal(split.train.items[user], ml100k.items[order[:-2]])
    np.testing.assert_array_equal(split.test_history.items[user], ml100k.items[order[:-1]])
    assert all(np.all(np.diff(t) >= 0) for t in split.train.timestamps)
    history, targets = split.held_out("valid")  # for choosing settings; the test item stays unseen
    assert targets is split.valid_targets and np.array_equal(history.items[user], split.train.items[user])
    assert split.held_out("test")[1] is split.test_targets
    with pytest.raises(ValueError, match="held-out split 'train'; valid values: valid, test"):
        split.held_out("train")


def test_training_windows_and_batches(ml100k):
    split = D.leave_one_out(ml100k)
    windows = D.training_windows(split.train, max_len=10)
    assert max(len(w) for w in windows.items) == 11 and min(len(w) for w in windows.items) >= 2
    # every training transition (item -> next item) appears in exactly one window
    assert sum(len(w) - 1 for w in windows.items) == sum(len(s) - 1 for s in split.train.items)
    rows = np.array([0, 3, 5])
    (ids, ts, lengths), targets = D.next_item_batch(windows, rows, "jagged", 10)
    (padded,), padded_targets = D.next_item_batch(windows, rows, "padded", 10)
    assert ids.shape == ts.shape == targets.shape == (int(lengths.sum()),)
    assert torch.equal(padded[padded > 0], ids) and torch.equal(padded_targets[padded_targets > 0], targets)
    np.testing.assert_array_equal(targets[: lengths[0]].numpy(), windows.items[0][1:])
    (_, _, lengths), last = D.history_inputs(split.test_history, rows, "jagged", 10)
    assert torch.equal(last, torch.cumsum(lengths, 0) - 1)


@pytest.mark.parametrize("name, line", [("ratings.dat", "{u}::{i}::4::{t}"), ("ratings.csv", "{u},{i},4.0,{t}")])
def test_grouplens_formats(tmp_path, name, line):
    header = "userId,movieId,rating,timestamp\n" if name.endswith(".csv") else ""
    rows = [(1, 10, 100), (1, 20, 50), (2, 10, 70), (1, 30, 200), (2, 40, 10), (2, 20, 90)]
    (tmp_path / name).write_text(header + "\n".join(line.format(u=u, i=i, t=t) for u, i, t in rows) + "\n")
    ratings = D.load_ratings("ml-1m", str(tmp_path / name))
    assert (len(ratings), ratings.num_users, ratings.num_items) == (6, 2, 4)
    split = D.leave_one_out(ratings)
    # user 1 by time: 20 (t=50), 10 (t=100), 30 (t=200); items numbered by first appearance: 10->1, 20->2, 30->3
    assert split.test_targets[0] == 3 and split.valid_targets[0] == 1


def test_missing_or_unknown_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="ratings file not found"):
        D.load_ratings("ml-1m", str(tmp_path / "ratings.dat"))
    with pytest.raises(ValueError, match="needs --data-path"):
        D.load_ratings("ml-20m")
    (tmp_path / "x.txt").write_text("1 2 3 4\n")
    with pytest.raises(ValueError, match="unknown ratings file format"):
        D.load_ratings("ml-1m", str(tmp_path / "x.txt"))


def test_criteo_synthetic_shape_power_law_and_batches():
    rows = D.criteo_synthetic(4000, [500] * 26, max_ids_per_bag=3, seed=1)
    assert rows.dense.shape == (4000, 13) and len(rows.values) == 26 and "synthetic" in rows.note
    counts = torch.bincount(rows.values[0], minlength=500).double()
    # P(0) / P(9) = 10 ** 1.05 for alpha 1.05
    assert 6 < counts[0] / counts[9] < 20
    assert 0.1 < rows.labels.mean() < 0.6
    dense, indices, offsets, labels = rows.batch(np.array([7, 2, 3999]))
    for t in (0, 25):
        bounds = rows.offsets[t]
        expected = torch.cat([rows.values[t][bounds[r]:bounds[r + 1]] for r in (7, 2, 3999)])
        assert torch.equal(indices[t], expected)
        assert offsets[t][0] == 0 and offsets[t][1] == bounds[8] - bounds[7]
    assert torch.equal(labels, rows.labels[[7, 2, 3999]])


def test_criteo_synthetic_labels_are_learnable():
    """Labels come from a hidden model of the features: a per-id click rate separates them (AUC well above 0.5)."""
    rows = D.criteo_synthetic(20000, [50] * 4, seed=2)
    train, test = slice(0, 15000), slice(15000, 20000)
    score = torch.zeros(5000, dtype=torch.double)
    for values in rows.values:  # one id per bag: values[i] is row i's id
        clicks = torch.bincount(values[train], weights=rows.labels[train].double(), minlength=50)
        seen = torch.bincount(values[train], minlength=50).double()
        rate = (clicks + 1) / (seen + 2)
        score += torch.log(rate / (1 - rate))[values[test]]
    assert auc(rows.labels[test], score) > 0.65


def test_ranking_metrics_known_cases():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.6, 0.4]])
    ranks = target_ranks(scores, torch.tensor([3, 2]))  # item 3 (0.5) ranks 2nd, item 2 (0.2) ranks 4th
    assert ranks.tolist() == [1, 3]
    assert hit_rate(ranks, 2) == 0.5 and hit_rate(ranks, 4) == 1.0
    assert ndcg(ranks, 2) == pytest.approx(0.5 / math.log2(3))
    assert ndcg(ranks, 4) == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / 2)
    assert ranking_metrics(ranks, (1,)) == {"HR@1": 0.0, "NDCG@1": 0.0}


def test_popularity_scores():
    scores = popularity_scores([np.array([1, 2, 2]), np.array([2, 3])], num_items=4)
    assert scores.tolist() == [1, 3, 1, 0]


def test_auc_and_log_loss_known_cases():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(labels, torch.tensor([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert auc(labels, torch.tensor([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert auc(labels, torch.ones(4)) == 0.5  # ties count half
    assert log_loss(labels, torch.zeros(4)) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="both positive and negative"):
        auc(torch.ones(3), torch.rand(3))


def test_user_gains_average_to_the_metrics():
    ranks = torch.tensor([0, 3, 9, 10, 250])
    for metric, value in ranking_metrics(ranks).items():
        gains = user_gains(ranks, metric)
        assert gains.shape == ranks.shape and gains.mean().item() == pytest.approx(value)
    assert user_gains(ranks, "HR@10").tolist() == [1, 1, 1, 0, 0]


def test_paired_comparison():
    rng = np.random.default_rng(1)
    worse = rng.random((3, 500)) * (rng.random((3, 500)) < 0.3)
    better = worse + 0.05  # every user gains 0.05 on every seed
    result = paired(better, worse, (better.mean(1).tolist(), worse.mean(1).tolist()))
    assert result["mean_diff"] == pytest.approx(0.05) and result["seed_wins"] == 3
    lo, hi = result["bootstrap_ci95"]
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05) and result["bootstrap_p_not_better"] == 0
    noise = paired(worse[:, ::-1], worse, None)  # the same gains shuffled across users: no difference
    assert noise["bootstrap_ci95"][0] < 0 < noise["bootstrap_ci95"][1] and "seed_wins" not in noise
    baseline = paired(better, worse[:1], None)  # a baseline's single row is compared with every seed's mean
    assert baseline["mean_diff"] == pytest.approx(better.mean() - worse[0].mean())
