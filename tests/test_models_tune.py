"""models.tune's grid, scoring and choice, and models.train's learning-rate schedules (no training)."""
import math

import pytest
import torch

from models import train, tune


def test_points_collapse_epoch_counts_only_under_a_constant_schedule():
    grid = {"--epochs": [10, 20], "--lr-schedule": ["constant", "cosine"], "--dropout": [0.2]}
    points = tune.points(grid, [])
    assert len(tune.points({"--epochs": [10, 20], "--dropout": [0.2]}, ["--lr-schedule", "cosine"])) == 2
    assert len(tune.points({"--epochs": [10, 20], "--dropout": [0.2]}, ["--lr-schedule", "constant"])) == 1
    constant = [p for p in points if p["--lr-schedule"] == "constant"]
    cosine = [p for p in points if p["--lr-schedule"] == "cosine"]
    assert constant == [{"--lr-schedule": "constant", "--dropout": 0.2, "--epochs": 20, "counts": [10, 20]}]
    assert sorted((p["--epochs"], p["counts"]) for p in cosine) == [(10, [10]), (20, [20])]
    assert tune.as_argv(constant[0]) == ["--lr-schedule", "constant", "--dropout", "0.2", "--epochs", "20"]


def run(model, seed, counts, curve, **point):
    return {"model": model, "seed": seed, "point": {**point, "--epochs": max(counts), "counts": counts},
            "curve": [{"M": v} for v in curve]}


def test_scores_average_the_tail_and_drop_points_not_trained_for_every_model_and_seed():
    runs = [run(m, s, [10, 20], [0.1] * 7 + [0.2, 0.3, 0.4] + [0.5] * 7 + [0.6, 0.6, 0.9], **{"--x": 1})
            for m in "ab" for s in (0, 1)]
    runs.append(run("a", 0, [20], [0.9] * 20, **{"--x": 2}))  # model b and seed 1 missing: dropped
    table = tune.scores(runs, "ab", "M", [0, 1])
    assert tune.tail(10) == 2 and tune.tail(20) == 3
    assert table == {("a", 10, "--x 1"): pytest.approx(0.35), ("b", 10, "--x 1"): pytest.approx(0.35),
                     ("a", 20, "--x 1"): pytest.approx(0.7), ("b", 20, "--x 1"): pytest.approx(0.7)}


def test_choice_shares_the_epoch_count_where_the_best_points_sum_highest():
    table = {("a", 10, "p"): 0.5, ("a", 10, "q"): 0.1, ("b", 10, "p"): 0.1, ("b", 10, "q"): 0.2,
             ("a", 20, "p"): 0.3, ("a", 20, "q"): 0.4, ("b", 20, "p"): 0.35, ("b", 20, "q"): 0.1}
    choice = tune.choose(table, "ab")
    assert choice["epochs"] == 20  # 0.4 + 0.35 beats 0.5 + 0.2
    assert choice["a"] == {"args": "--epochs 20 q", "score": 0.4}
    assert choice["b"] == {"args": "--epochs 20 p", "score": 0.35}
    with pytest.raises(RuntimeError, match="budget"):
        tune.choose({}, "ab")


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_learning_rate_schedules(schedule):
    args = train.parser().parse_args(["--lr", "0.01", "--lr-schedule", schedule, "--warmup-steps", "4"])
    param = torch.nn.Parameter(torch.ones(2))
    optimizer, scheduler = train.make_optimizer(args, [param], total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    if schedule == "constant":
        assert lrs[4:] == pytest.approx([0.01] * 16)
    else:
        assert lrs[4] == pytest.approx(0.01)
        assert lrs[12] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 0.5)))
        assert all(x > y for x, y in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.001
