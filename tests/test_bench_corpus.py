"""The corpus benchmark's report: the verdict names the race's decision where rec_ascend is slower than
min(eager, Inductor) and the floor's parts where it is above 1.5x its floor; a partial run's table says so. Its
timing: inference steps under no_grad, each sample a run of back-to-back calls (the same count per backend), the
rounds pooled from two processes of opposite compile orders, one torch thread; a stopped run resumes, a shard
replaces only its own rows. Its floor: the GEMMs' math, whatever their spelling (a convolution's its im2col GEMM), a
memory-bound GEMM's no more than its bytes over the bandwidth."""
import collections
import json

import pytest
import torch

import models.bench_corpus as bench_corpus
from models.bench_corpus import (TABLE_END, TABLE_START, _matmul_dims, call_ms, capture, describe_decision,
                                 floor_gemms, floor_ms, kept_rows, own_process_compile, paired, race,
                                 render_table, step_fn, timed_in_orders, verdict, write_doc)
from models.corpus.harness import CASES, Case
from models import timing
from models.timing import autorange, race_ms, race_rounds

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


class _TickClock:
    """A clock that advances only when a fake step runs: each step costs its ``ms``."""

    def __init__(self):
        self.now = 0.0

    def step(self, ms: float):
        def run():
            self.now += ms / 1e3
        return run

    def __call__(self) -> float:
        return self.now


def test_autorange_picks_the_first_count_whose_sample_of_the_fastest_step_lasts_long_enough():
    clock = _TickClock()
    steps = {"fast": clock.step(0.3), "slow": clock.step(3.0)}
    assert autorange(steps, min_ms=10.0, clock=clock) == 50  # 0.3 ms x 20 < 10 ms <= 0.3 ms x 50
    assert autorange({"slow": clock.step(30.0)}, min_ms=10.0, clock=clock) == 1


def test_race_times_runs_of_back_to_back_calls_the_same_count_for_every_backend(monkeypatch):
    monkeypatch.setattr(bench_corpus, "ROUNDS_BUDGET_S", 0.0)  # the rounds asked for, no more
    clock, calls = _TickClock(), []

    def counted(name, ms):
        tick = clock.step(ms)
        return lambda: (calls.append(name), tick())

    def broken():
        raise RuntimeError("no kernel")

    steps = {"eager": counted("eager", 2.0), "rec_ascend": counted("rec_ascend", 0.5), "inductor": broken}
    ms, iters, errors, rounds = race(steps, 2, clock)
    assert iters == 20 and ms == pytest.approx({"eager": 2.0, "rec_ascend": 0.5})
    assert rounds == {"eager": pytest.approx([2.0, 2.0]), "rec_ascend": pytest.approx([0.5, 0.5])}
    assert errors == {"inductor": "RuntimeError: no kernel"}
    timed = calls[-4 * iters:]  # two rounds, each backend's run of iters calls in turn, the second starting further
    assert timed == ["eager"] * iters + ["rec_ascend"] * iters + ["rec_ascend"] * iters + ["eager"] * iters


def test_rounds_rotate_and_short_steps_get_more_rounds_within_the_budget(monkeypatch):
    """Each round starts one backend further; past the rounds asked for, rounds go on while the wall-clock budget
    lasts (up to ``MAX_ROUNDS``), so a cell of short steps is timed in many rounds and one of long steps in few."""
    wall = _TickClock()
    monkeypatch.setattr(timing.time, "perf_counter", wall)
    order = []

    def steps(ms):
        ticks = {name: wall.step(ms) for name in "abc"}
        return {name: (lambda name=name: (order.append(name), ticks[name]())) for name in "abc"}

    samples = race_rounds(steps(100.0), 3, warmup=0, clock=wall, budget_s=1.0)
    assert order[:9] == list("abc" "bca" "cab") and all(len(ms) == 4 for ms in samples.values())  # 1.2 s: 4 rounds
    assert samples["a"] == pytest.approx([100.0] * 4)
    assert all(len(ms) == 5 for ms in race_rounds(steps(100.0), 5, warmup=0, clock=wall, budget_s=0.0).values())
    assert all(len(ms) == timing.MAX_ROUNDS for ms in race_rounds(steps(0.1), 3, warmup=0, clock=wall,
                                                                   budget_s=1.0).values())
    assert race_ms(steps(0.1), 3, warmup=0, clock=wall) == pytest.approx(dict.fromkeys("abc", 0.1))


def test_the_rounds_are_pooled_from_two_processes_of_opposite_compile_orders(monkeypatch):
    """A backend compiled first in its process runs slower (as the same code of a cell read 1.08x or 0.97x by the
    compile order): timed in one order only, one of Inductor and rec_ascend would always pay it. Each order's
    process times half the rounds at the first one's sample count; the pooled rounds say which order each came
    from, and the two backends' best rounds are equal."""
    monkeypatch.setattr(bench_corpus, "ROUNDS_BUDGET_S", 0.0)  # the rounds asked for, no more
    clock = _TickClock()
    cost = {"eager": 3.0, "first": 1.2, "second": 1.0}  # ms per call
    compiled_first = []  # per process (forked: each starts from this empty list)

    def stub(backend, module):
        def run(*args):
            if backend != "eager" and not compiled_first:
                compiled_first.append(backend)
            clock.step(cost["eager" if backend == "eager" else
                            "first" if compiled_first[0] == backend else "second"])()
            return module(*args)

        return run

    monkeypatch.setattr(bench_corpus, "compiled", stub)
    seeded = _tiny_case(lambda seed: (torch.manual_seed(seed), torch.nn.Linear(4, 2))[1])  # eager's numbers
    timed = timed_in_orders(seeded, (1, 128), 5, clock)
    assert timed["errors"] == {} and timed["numbers_equal"] and timed["shared_s"].keys() == {"inductor", "rec_ascend"}
    for b in (1, 128):
        assert timed["compiled_first"][b] == ["inductor"] * 3 + ["rec_ascend"] * 3
        assert timed["rounds_ms"][b]["inductor"] == pytest.approx([1.2] * 3 + [1.0] * 3)
        assert timed["rounds_ms"][b]["rec_ascend"] == pytest.approx([1.0] * 3 + [1.2] * 3)
        assert timed["ms"][b] == pytest.approx({"eager": 3.0, "inductor": 1.0, "rec_ascend": 1.0})
        assert timed["iters"][b] == 10  # 1.0 ms x 10 calls: the first process's count, the second's too
        assert paired(timed["rounds_ms"][b]) == "slower in 3 of 6 rounds, median 1.02x"  # (5/6 + 6/5) / 2


def test_the_verdict_compares_a_slower_cells_rounds_pair_by_pair():
    """Where rec_ascend's best round is behind, the verdict says in how many rounds it was slower than the faster
    baseline of the same round, and the median ratio: a load spike on one round is told from a steady cost."""
    ms = {1: {"eager": 1.0, "inductor": 1.2, "rec_ascend": 1.1}}
    rounds = {1: {"eager": [1.0, 1.3, 1.4], "inductor": [1.2, 1.25, 1.5], "rec_ascend": [1.1, 1.2, 1.3]}}
    [note] = verdict(ms, {1: {"ms": 0.0}}, {}, {1: ["kept eager"]}, calls={1: 0.04}, rounds_ms=rounds)
    assert note == ("batch 1: rec_ascend 1.100 ms > min(eager, inductor) 1.000 ms (kept eager); slower in 1 of 3 "
                    "rounds, median 0.96x; the compiled call's own cost 0.040 ms")
    assert paired({"eager": [1.0], "rec_ascend": [2.0]}) == "slower in 1 of 1 rounds, median 2.00x"
    assert paired({"rec_ascend": [2.0]}) is None


D = 64


class _ColumnGemm(torch.nn.Module):
    """RecBole's spelling (DCNV2, its cross nets): ``W @ x_l`` over columns, which ATen runs by copying W per row."""

    def __init__(self):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        return torch.matmul(self.W, x.unsqueeze(2)).squeeze(2).sum()


class _RowGemm(_ColumnGemm):
    def forward(self, x):
        return (x @ self.W.T).sum()


class _EinsumGemm(_ColumnGemm):
    def forward(self, x):
        return torch.einsum("bd,ed->be", x, self.W).sum()


class _LinearGemm(_ColumnGemm):
    def forward(self, x):
        return torch.nn.functional.linear(x, self.W).sum()


class _TensordotGemm(_ColumnGemm):
    def forward(self, x):
        return torch.tensordot(x, self.W, dims=([1], [1])).sum()


def _graphs(module_type, training: bool, rows: int = 512):
    case = Case("m/gemm", "loss", training, lambda seed: module_type(), lambda rows, seed: (torch.randn(rows, D),))
    return capture(case, case.inputs(rows, 0))[0]


def test_the_floor_counts_a_gemms_math_not_its_spelling():
    for training in (False, True):
        forward = (1, 512, D, D, torch.float32)
        weight_grad = (1, D, 512, D, torch.float32)  # dW = dC^T x: the input needs none
        for spelling in (_ColumnGemm, _RowGemm, _EinsumGemm, _LinearGemm, _TensordotGemm):
            gemms = floor_gemms(_graphs(spelling, training), training)
            assert gemms == ({forward: 1, weight_grad: 1} if training else {forward: 1}, []), spelling


def test_the_floor_keeps_a_truly_batched_gemm_batched_and_folds_a_broadcast_one():
    assert _matmul_dims([8, 2, 12, 16], [8, 2, 16, 12], torch.float32) == (16, 12, 16, 12, torch.float32)  # q k^T
    assert _matmul_dims([8, 2, 12, 16], [16, 32], torch.float32) == (1, 192, 16, 32, torch.float32)
    assert _matmul_dims([32, 16], [8, 16, 1], torch.float32) == (1, 32, 16, 8, torch.float32)
    assert _matmul_dims([8, 1, 12, 16], [1, 2, 16, 12], torch.float32) == (1, 96, 16, 24, torch.float32)


class _Conv1x1(_ColumnGemm):
    """xDeepFM's CIN: a kernel-1 conv1d over [B, C_in, L], the GEMM ``W @ x`` of its ``matmul`` spelling."""

    def __init__(self, conv: bool):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        x = x.view(x.shape[0], D // 4, 4)
        if self.conv:
            return torch.conv1d(x, self.W[:, :D // 4, None]).sum()
        return torch.matmul(self.W[:, :D // 4], x).sum()


def test_a_kernel_1_convolution_is_the_gemm_of_its_matmul_spelling_another_the_gemm_of_its_im2col():
    for training in (False, True):
        gemms = [floor_gemms(_graphs(lambda: _Conv1x1(conv), training), training) for conv in (True, False)]
        assert gemms[0] == gemms[1] and gemms[0][0][(1, 512 * 4, D // 4, D, torch.float32)] == 1, training
        assert sum(gemms[0][0].values()) == (2 if training else 1)  # dW: the input needs no gradient

    class Conv2d(torch.nn.Module):  # 3x3, stride 2, padded, two groups: [8, 18] x [18, B * 4 * 4] per group
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 16, 3, stride=2, padding=1, groups=2)

        def forward(self, x):
            return self.conv(x.view(x.shape[0], 4, 8, 2)).sum()

    assert floor_gemms(_graphs(Conv2d, False), False) == ({(2, 512 * 4 * 1, 18, 8, torch.float32): 1}, [])


def test_a_memory_bound_gemms_floor_is_its_bytes_over_the_bandwidth_where_mm_is_slower(monkeypatch):
    monkeypatch.setattr(bench_corpus, "_canonical_ms", lambda shape, rounds, clock: 1.0)  # mm alone: 1 ms each
    gbs, gflops = 10.0, 100.0
    gemv = (1, 4096, 256, 1, torch.float32)  # 2 MFLOP: 0.02 ms of math, 4.2 MB: 0.42 ms of bytes
    square = (1, 1024, 1024, 1024, torch.float32)  # 2.1 GFLOP: 21 ms of math, 12.6 MB: 1.26 ms of bytes
    assert bench_corpus._gemm_floor_ms(gemv, gbs, gflops, 1, None) == pytest.approx(
        (4096 * 256 + 256 + 4096) * 4 / gbs / 1e6)
    assert bench_corpus._gemm_floor_ms(square, gbs, gflops, 1, None) == 1.0  # compute bound: the timed mm
    monkeypatch.setattr(bench_corpus, "_canonical_ms", lambda shape, rounds, clock: 0.1)
    assert bench_corpus._gemm_floor_ms(gemv, gbs, gflops, 1, None) == 0.1  # mm faster than the bound: mm
    monkeypatch.setattr(bench_corpus, "_canonical_ms", lambda shape, rounds, clock: 1.0)
    floor = floor_ms(_graphs(_RowGemm, False, rows=4096), False, gbs, 1e9, 1)  # every GEMM memory bound
    assert floor["gemm_ms"] == pytest.approx((4096 * D + D * D + 4096 * D) * 4 / gbs / 1e6)


def test_the_compiled_calls_own_cost_is_its_own_field_beside_the_floor():
    ms = {1: {"eager": 0.2, "inductor": 0.15, "rec_ascend": 0.1}}
    note = verdict(ms, {1: {"ms": 0.01, "gemm_ms": 0.01, "lookup_ms": 0.0}}, {}, {}, calls={1: 0.06})[0]
    assert note.endswith("per-op dispatch; the compiled call's own cost 0.060 ms)")
    row = {"case": "recbole/FM:predict", "regions_expected": [], "numbers_equal": True, "ms": {"1": ms[1], "128": ms[1]},
           "floor": {"1": FLOOR, "128": FLOOR}, "call_ms": {"1": 0.06}, "compile_s": {"inductor": 2.0, "rec_ascend": 1.0}}
    assert "| 1: 0.10x, 128: 0.10x | 1: 0.060, 128: n/a | 1.0 s / 2.0 s" in render_table([row])


class _LookupAfterBreak(torch.nn.Module):
    """Two graphs, the second indexing a table with the first one's output (TorchRec's KJT, RecBole's targets)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(4, D)

    def forward(self, x):
        ids = (x.abs() * 3).long().clamp(max=3)
        torch._dynamo.graph_break()
        return self.table(ids).sum()


def test_the_call_cost_runs_the_compiled_step_without_its_kernels():
    for make in (lambda seed: _ColumnGemm(), lambda seed: _LookupAfterBreak()):
        for training in (False, True):
            case = Case("m/gemm", "loss", training, make, lambda rows, seed: (torch.randn(rows, D),))
            assert 0 < call_ms(case, case.inputs(4, 0), 1) < float("inf")


def test_a_gemms_floor_is_the_faster_of_its_two_orders(monkeypatch):
    timed = {}

    def fake(g, m, k, n, dtype, rounds, clock):
        timed[(m, k, n)] = 5.0 if n < m else 1.0  # the narrow output slow, as MKL's SGEMM runs it
        return timed[(m, k, n)]

    monkeypatch.setattr(bench_corpus, "_mm_ms", fake)
    assert bench_corpus._canonical_ms((1, 1683, 2048, 8, torch.float32), 3, None) == 1.0
    assert set(timed) == {(1683, 2048, 8), (8, 2048, 1683)}


class _GRU(torch.nn.Module):
    """Two GRU layers over [B, 4, D // 4] histories whose input needs no gradient (as embeddings' would)."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(D // 4, 6, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.gru(x.view(x.shape[0], 4, D // 4))[0].sum()


def test_a_recurrent_layers_floor_is_its_input_projection_and_one_hidden_product_per_step():
    for training in (False, True):
        gemms, spelled = floor_gemms(_graphs(_GRU, training), training)
        rows, k = 512 * 4, (D // 4, 6)  # every step's rows; each layer's input size
        forward = {(1, rows, k[0], 18, torch.float32): 1, (1, rows, 6, 18, torch.float32): 1,
                   (1, 512, 6, 18, torch.float32): 2 * 4}
        backward = {(1, rows, 18, 6, torch.float32): 1,  # the second layer's input gradient; the first's needs none
                    (1, 512, 18, 6, torch.float32): 2 * 4,  # the hidden state's at each step
                    (1, 18, rows, k[0], torch.float32): 1, (1, 18, rows, 6, torch.float32): 3}  # the weights'
        assert spelled == [] and gemms == collections.Counter(forward) + collections.Counter(backward if training else {})


def test_the_bench_runs_on_one_torch_thread(monkeypatch, tmp_path):
    """Its compiles and timing run in forked processes, which hang in OpenMP once the parent has run a parallel
    region on more threads (the copy bandwidth's copy, the floor's GEMMs): more threads are refused up front."""
    def started():
        raise AssertionError("the run started")

    monkeypatch.setattr(bench_corpus, "cold_caches", started)
    with pytest.raises(SystemExit):
        bench_corpus.main(["--threads", "2", "--json", str(tmp_path / "corpus.json"), "--doc", ""])
