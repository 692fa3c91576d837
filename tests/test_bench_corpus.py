"""The corpus benchmark's report: the verdict names the race's decision where rec_ascend is slower than
min(eager, Inductor) and the floor's parts where it is above 1.5x its floor; a partial run's table says so. Its
timing: inference steps under no_grad; a stopped run resumes, a shard replaces only its own rows."""
import json

import torch

from models.bench_corpus import (TABLE_END, TABLE_START, describe_decision, kept_rows, own_process_compile,
                                 render_table, step_fn, verdict, write_doc)
from models.corpus.harness import CASES, Case

DECISION = {"mode": "training", "choice": "inductor", "regions": {"padded_softmax_attention_default": "cpu"},
            "timings_ms": {"inductor": 2.5, "rec+eager": 4.0}, "rejected": {"inductor-captured": "not compiled: x"}}
FLOOR = {"ms": 1.0, "gemm_ms": 0.75, "lookup_ms": 0.25}


def test_describe_decision_names_choice_kernels_timings_and_rejections():
    line = describe_decision(DECISION)
    assert line.startswith("training graph kept inductor (padded_softmax_attention_default: cpu)")
    assert "race ms: inductor 2.5, rec+eager 4" in line and "inductor-captured not compiled: x" in line


def test_verdict_says_why_only_where_a_target_is_missed():
    ms = {128: {"eager": 3.0, "inductor": 2.0, "rec_ascend": 2.4}, 2048: {"eager": 9.0, "inductor": 8.0,
                                                                          "rec_ascend": 1.2}}
    notes = verdict(ms, {128: FLOOR, 2048: FLOOR}, {"inductor": 1.0, "rec_ascend": 1.2}, {128: ["the decision"]})
    assert notes[0] == "batch 128: rec_ascend 2.400 ms > min(eager, inductor) 2.000 ms (the decision)"
    assert notes[1].startswith("batch 128: 2.4x its floor 1.000 ms (GEMMs 0.750 + lookups 0.250): 1.400 ms")
    assert len(notes) == 2  # batch 2048 meets both; compile within 1.5x
    assert "no rec region" in verdict(ms, {128: FLOOR, 2048: FLOOR}, {}, {}, raced=False)[0]


def test_partial_run_is_marked_in_the_table(tmp_path):
    doc = tmp_path / "corpus.md"
    doc.write_text(f"head\n{TABLE_START}\nSTALE\n{TABLE_END}\ntail\n")
    row = {"case": "recbole/FM:loss", "regions_expected": [], "numbers_equal": True,
           "ms": {"128": {"eager": 2.0, "inductor": 1.0, "rec_ascend": 0.5}}, "floor": {"128": FLOOR},
           "compile_s": {"inductor": 2.0, "rec_ascend": 1.0}}
    write_doc(str(doc), {"date": "d", "machine": "m", "threads": 1, "commit": "c", "quick": False, "rounds": 5,
                         "cases": 48, "rows": [{**row, "commit": "abc"}], "clock": "cpu", "loadavg": [12.5, 1, 1]})
    text = doc.read_text()
    assert "1 of 48 cases measured (a partial run)" in text and "| recbole/FM:loss | none | yes | 128: 2.00x |" in text
    assert "CPU time per step" in text and "commit abc" in text and "load average 12.5" in text
    assert text.startswith("head\n") and text.endswith("tail\n") and "STALE" not in text


def test_inference_steps_run_under_no_grad_training_steps_with_grad():
    seen = []

    def fn(x):
        seen.append(torch.is_grad_enabled())
        return (x * 2).sum()

    x = torch.randn(3, requires_grad=True)
    module = torch.nn.Linear(1, 1)
    for training in (False, True):
        step_fn(Case("m/x", "e", training, None, None), fn, module, (x,))()
    assert seen == [False, True]


def test_resume_keeps_every_row_replace_only_the_other_cases(tmp_path):
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps({"rows": [{"case": "recbole/FM:loss"}, {"case": "recbole/FM:predict"}]}))
    fm_loss = [CASES["recbole/FM:loss"]]
    assert [r["case"] for r in kept_rows(str(path), fm_loss, resume=True, replace=False)] == ["recbole/FM:loss",
                                                                                                "recbole/FM:predict"]
    assert [r["case"] for r in kept_rows(str(path), fm_loss, resume=False, replace=True)] == ["recbole/FM:predict"]
    assert kept_rows(str(path), fm_loss, resume=False, replace=False) == []
    assert kept_rows(str(tmp_path / "none.json"), fm_loss, resume=True, replace=False) == []


def _tiny_case(make=lambda seed: torch.nn.Linear(4, 2)):
    return Case("m/tiny", "forward", False, make, lambda rows, seed: (torch.randn(rows, 4),))


def test_each_backends_cold_compile_runs_in_a_process_of_its_own(monkeypatch, tmp_path):
    """Forked, with caches of its own: the parent's recompile cache folder and Dynamo state stay as they were, and a
    failure comes back as the error, not as a dead benchmark."""
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    import os

    cold = own_process_compile(_tiny_case(), "eager", 8)
    assert cold.keys() == {"wall_s", "cpu_s"} and cold["wall_s"] >= 0 and cold["cpu_s"] >= 0
    assert os.environ["RECOMPILE_CACHE_DIR"] == str(tmp_path) and not list(tmp_path.iterdir())

    def broken(seed):
        raise ValueError("no such table")

    assert own_process_compile(_tiny_case(broken), "eager", 8) == {"error": "ValueError: no such table"}


def test_the_table_compares_cold_compiles_in_cpu_seconds_with_the_wall_clock_ratio_beside():
    row = {"case": "recbole/FM:loss", "regions_expected": [], "numbers_equal": True,
           "ms": {"128": {"eager": 2.0, "inductor": 1.0, "rec_ascend": 0.5}}, "floor": {"128": FLOOR},
           "compile_s": {"inductor": 8.0, "rec_ascend": 12.0}, "compile_cpu_s": {"inductor": 4.0, "rec_ascend": 5.0}}
    assert render_table([row], cpu=True).endswith("| 5.0 s / 4.0 s (1.25x; wall 1.50x) |")
    assert render_table([row]).endswith("| 12.0 s / 8.0 s (1.50x) |")
    del row["compile_cpu_s"]  # a row measured before: its one (wall-clock) figure
    assert render_table([row], cpu=True).endswith("| 12.0 s / 8.0 s (1.50x) |")
