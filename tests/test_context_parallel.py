"""Context-parallel HSTU attention on 1, 2 and 4 spawned gloo processes equals one process, forward and backward."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.distributed.context_parallel import ContextParallelLayout, context_parallel_hstu_attention
from recompile.launch import spawn
from tests.cp_workers import cases, context_parallel, data_and_context_parallel, one_process, problem

# Lengths include 0, 1 and others shorter than 2 * world (empty chunks) and some of uneven chunks.
LENGTHS = [13, 1, 0, 7, 3, 16, 5]
MAX_SEQ_LEN = 16
FEATURES = {
    "causal_rel_bias": ("rel_bias",),
    "non_causal_rel_bias": ("non_causal", "rel_bias"),
    "time_bias_targets_contextual": ("rel_bias", "time_bias", "num_targets", "contextual"),
}


def _problems():
    return [problem(seed, LENGTHS, MAX_SEQ_LEN, feats) for seed, feats in enumerate(FEATURES.values())]


def _ok(outcomes, hung) -> list:
    assert not hung, f"ranks {hung} did not finish"
    for rank, o in enumerate(outcomes):
        assert o is not None and o.error is None, f"rank {rank}: {o and o.trace}"
    return [o.value for o in outcomes]


def _check(results_per_rank: list[list[dict]], problems: list[dict], world_size: int, names=FEATURES) -> None:
    for case, (name, p) in enumerate(zip(names, problems)):
        layout = ContextParallelLayout(p["offsets"], world_size)
        ref = one_process(p)
        parts = [rank_results[case] for rank_results in results_per_rank]
        for key, expected in ref.items():
            if key in ("drel_bias", "dtime_bias"):  # each rank's part of a replicated parameter's gradient
                got = torch.stack([part[key] for part in parts]).sum(0)
            else:
                got = layout.unshard([part[key] for part in parts])
            assert float(expected.abs().max()) > 1e-3, (name, key)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()),
                                       msg=f"{name}: {key} on {world_size} ranks")


# block_size 2: chunks attended in blocks of 2 positions (several blocks per chunk).
@pytest.mark.parametrize("world_size, exchange, block_size", [(2, "ring", 256), (4, "ring", 2), (4, "all_gather", 256)])
def test_context_parallel_equals_one_process(world_size, exchange, block_size):
    problems = _problems()
    results = _ok(*spawn(cases, world_size, problems, exchange, block_size, timeout_s=60, collective_timeout_s=30,
                         preload=["tests.cp_workers"]))
    _check(results, problems, world_size)


def test_data_parallel_replicas_each_on_a_context_parallel_group_of_two():
    """4 ranks as a 2 x 2 grid: ranks 0-1 and 2-3 are two context-parallel groups, each with its own batch."""
    problems = [problem(10 + replica, LENGTHS[replica:], MAX_SEQ_LEN, FEATURES["time_bias_targets_contextual"])
                for replica in range(2)]
    results = _ok(*spawn(data_and_context_parallel, 4, problems, 2, timeout_s=60, collective_timeout_s=30,
                         preload=["tests.cp_workers"]))
    for replica, p in enumerate(problems):
        _check([[r] for r in results[2 * replica: 2 * replica + 2]], [p], 2, [f"replica {replica}"])


def test_one_rank_without_a_process_group_equals_one_process():
    problems = _problems()
    _check([[context_parallel(0, 1, p, block_size=3) for p in problems]], problems, 1)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=5), st.integers(1, 5))
def test_layout_chunks_partition_every_sequence(lengths, world_size):
    offsets = torch.tensor([0] + lengths).cumsum(0)
    layout = ContextParallelLayout(offsets, world_size)
    rows = torch.cat([layout.global_rows(r) for r in range(world_size)])
    assert torch.equal(rows.sort().values, torch.arange(sum(lengths)))
    assert torch.equal(layout.chunk_lengths.sum(1), torch.tensor(lengths))
    assert int((layout.chunk_lengths.max(1).values - layout.chunk_lengths.min(1).values).max()) <= 1
    for r in range(world_size):
        chunks = layout.chunks(r, "cpu", 2)
        assert sum(int(c.valid.sum()) for c in chunks) == layout.local_total(r)
        assert all(c.pos.shape[1] <= 2 for c in chunks)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 4), st.sampled_from(list(FEATURES)))
def test_one_rank_any_lengths_and_blocks_equals_one_process(lengths, block_size, name):
    p = problem(sum(lengths), lengths, 9, FEATURES[name])
    got = context_parallel(0, 1, p, block_size=block_size)
    if sum(lengths) == 0:  # (the reference's backward cannot run on an empty batch: its output has no grad_fn)
        assert got["out"].shape == (0, *p["v"].shape[1:]) and not got["drel_bias"].any()
        return
    ref = one_process(p)
    for key, expected in ref.items():
        torch.testing.assert_close(got[key], expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())))


def test_layout_balances_the_causal_triangle_and_covers_every_row():
    offsets = torch.tensor([0, 100, 103, 103, 403])
    layout = ContextParallelLayout(offsets, 4)
    rows = torch.cat([layout.global_rows(r) for r in range(4)])
    assert torch.equal(rows.sort().values, torch.arange(403))
    assert [layout.chunk_ids(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # a rank's causal work: the keys at or before each of its queries
    positions = torch.arange(403) - offsets[:-1][torch.bucketize(torch.arange(403), offsets[1:], right=True)]
    causal = [int((positions[layout.global_rows(r)] + 1).sum()) for r in range(4)]
    assert max(causal) / min(causal) < 1.05, causal
    x = torch.randn(403, 3)
    assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(4)]), x)


def test_bad_arguments_are_named():
    p = problem(0, [4, 2], 4, ("rel_bias",))
    layout = ContextParallelLayout(p["offsets"], 1)
    with pytest.raises(ValueError, match="layout is for 2 ranks"):
        context_parallel_hstu_attention(p["q"], p["k"], p["v"], ContextParallelLayout(p["offsets"], 2), 4, 1.0)
    with pytest.raises(ValueError, match="longer than max_seq_len 3"):
        context_parallel_hstu_attention(p["q"], p["k"], p["v"], layout, 3, 1.0)
    with pytest.raises(ValueError, match=r"q, k must be \[6, heads, D\]"):
        context_parallel_hstu_attention(p["q"][:5], p["k"], p["v"], layout, 4, 1.0)
    with pytest.raises(ValueError, match="exchange must be one of"):
        context_parallel_hstu_attention(p["q"], p["k"], p["v"], layout, 4, 1.0, exchange="broadcast")


def test_bench_search_finds_the_longest_history_within_the_budget():
    from models.bench_distributed import CP_GRID, longest_fitting

    calls = []

    def peak_of(n):
        calls.append(n)
        return n * n

    length, peak = longest_fitting(peak_of, 1000 ** 2, 100)
    assert length % CP_GRID == 0 and length <= 1000 < length + max(CP_GRID, length // 8) and peak == length ** 2
    assert len(calls) < 12, calls
    assert longest_fitting(peak_of, 10, CP_GRID) == (0, 0)  # nothing fits
