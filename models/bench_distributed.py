"""All-to-all traffic of sharded embedding tables, measured and estimated.

1. Measured: a Criteo-shaped DLRM (26 tables of 1k-26k rows, dim 64, 1-8 ids per bag, power-law ids with
   alpha 1.05; synthetic data) trained on N local ranks (gloo); the bytes each rank sends per step in
   all-to-all (counts, ids, bag structure, pooled results, their gradients) and ms/step, for the planner's plan
   (one round of collectives for all tables per step, or one per table) and for all tables table-wise or
   row-wise, with and without per-rank deduplication of the ids.
2. Estimated, by the sharding planner's cost model: a Criteo-1TB-sized DLRM (26 tables, 882M rows, dim 128)
   on 8, 64 and 512 ranks sharing one global batch.
3. ``--context-parallel``: HSTU attention (causal, relative-position bias) forward and backward with each user's
   history split over 2 and 4 ranks (``recompile.distributed.context_parallel``) against one process
   (``recompile.hstu_attention``, its ``cpu`` and ``native`` kernels): per-rank peak memory of the attention
   (``torch.distributed._tools.mem_tracker.MemTracker``: every tensor the attention allocates, inputs included),
   the longest history that fits in a fixed per-rank budget, the largest relative difference from one process,
   and ms of the ring against the all_gather exchange, interleaved round by round. Writes
   docs/benchmarks/context_parallel.json unless ``--json`` says otherwise.

    python -m models.bench_distributed [--quick] [--nproc 2] [--batch 2048] [--steps 5] [--json out.json]
                                       [--criteo-batch 65536] [--estimate-only]
    python -m models.bench_distributed --context-parallel [--quick] [--budget-mib 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch

from .dlrm import DLRM, DLRMConfig
from .zoo import CTR_MODELS
from recompile.distributed import (
    STATS, Hardware, TableSpec, compile_lookups, distribute, embedding_tables, init_distributed, plan, table_specs,
    world,
)
from recompile.distributed.context_parallel import ContextParallelLayout, context_parallel_hstu_attention
from recompile.launch import spawn
from recompile.runtime.kernels import get_kernel

# Per-feature distinct values of the 26 categorical features of Criteo 1TB (no hashing), as counted by
# the DLRM reference implementation: 882.8M rows in all.
CRITEO_1TB_ROWS = [227605432, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 130229467, 3067956, 405282, 10, 2209,
                   11938, 155, 4, 976, 14, 292775614, 40790948, 187188510, 590152, 12973, 108, 36]
# An accelerator rank: 64 GB for tables (Ascend 910B HBM), 25 GB/s all-to-all (200 Gb/s), 1.5 TB/s HBM.
ACCELERATOR = Hardware(memory_bytes=64e9)
POWER_LAW_ALPHA = 1.05
DISTRIBUTED_MODELS = tuple(m for m in CTR_MODELS if m != "dlrm_torchrec")  # nn.EmbeddingBag / hkv tables


def bench_config(quick: bool) -> DLRMConfig:
    rows = torch.logspace(3, torch.log10(torch.tensor(26_000.0)), 26).round().long().tolist()
    return DLRMConfig(table_rows=rows, dim=16 if quick else 64, bottom=[64, 16 if quick else 64],
                      top=[64, 1], max_ids_per_bag=8)


def ctr_features(model: torch.nn.Module) -> Callable[..., dict]:
    """The ids a zoo CTR model (``forward(dense, indices, offsets)``) passes to each of its tables: every list of
    tables (DLRM's ``embeddings``, DeepFM's ``first_order``...) gets ``indices[i], offsets[i]`` in table i
    (``distribute(features=...)``: one lookup round per step)."""
    lists = [name for name, child in model.named_children()
             if isinstance(child, torch.nn.ModuleList) and any(True for _ in embedding_tables(child))]

    def features(dense, indices, offsets) -> dict:
        return {f"{name}.{i}": (ids, offs) for name in lists for i, (ids, offs) in enumerate(zip(indices, offsets))}

    return features


def shard_ctr_model(name: str, model: torch.nn.Module, global_batch: int, backend: str):
    """In a worker started by torch's launcher (``python -m models.train --nproc N``): zoo CTR model ``name``'s
    tables sharded as the planner chooses, its dense layers data-parallel, the owners' pooling compiled unless
    ``backend`` is eager. Returns (the wrapped model, rank, world size)."""
    if name not in DISTRIBUTED_MODELS:
        raise ValueError(f"--nproc: model {name!r} is not trained distributed; models that are: "
                         f"{', '.join(DISTRIBUTED_MODELS)}")
    init_distributed()
    rank, world_size = world()
    sharded = distribute(model, batch=global_batch // world_size, pooling=(1 + model.cfg.max_ids_per_bag) / 2,
                         features=ctr_features(model))
    if backend != "eager":  # one grouped lookup per round under rec_ascend
        compile_lookups(model, backend)
    return sharded, rank, world_size


def power_law_ids(rows: int, n: int, gen: torch.Generator, permutation: torch.Tensor) -> torch.Tensor:
    """``n`` ids of a table of ``rows`` with P(rank k) ~ k^-alpha, hot ids scattered by ``permutation``."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a = 1.0 - POWER_LAW_ALPHA
    ranks = ((rows ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return permutation[(ranks.long() - 1).clamp(0, rows - 1)]


def batches(cfg: DLRMConfig, steps: int, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(rows, generator=torch.Generator().manual_seed(t)) for t, rows in enumerate(cfg.table_rows)]
    for _ in range(steps):
        indices, offsets = [], []
        for rows, perm in zip(cfg.table_rows, perms):
            lengths = torch.randint(1, cfg.max_ids_per_bag + 1, (batch,), generator=gen)
            indices.append(power_law_ids(rows, int(lengths.sum()), gen, perm))
            offsets.append(torch.cumsum(lengths, 0) - lengths)
        yield torch.randn(batch, cfg.num_dense, generator=gen), indices, offsets, torch.rand(batch, generator=gen)


# What an all-to-all carries (``recompile.distributed.STATS`` kinds).
KINDS = ("counts", "ids", "bags", "pooled", "grads")
# (name, sharding kinds the planner may use, dedup, one lookup round per step for all tables rather than one per table)
VARIANTS = (("planned", ("table_wise", "row_wise"), True, True),
            ("planned, per table", ("table_wise", "row_wise"), True, False),
            ("table-wise", ("table_wise",), True, True), ("table-wise, no dedup", ("table_wise",), False, True),
            ("row-wise", ("row_wise",), True, True), ("row-wise, no dedup", ("row_wise",), False, True))


def measure(rank: int, world_size: int, quick: bool, batch: int, steps: int) -> dict:
    """Bytes sent per step by this rank, by kind, and ms/step, for each of VARIANTS."""
    cfg = bench_config(quick)
    out = {}
    for name, kinds, dedup, one_round in VARIANTS:
        torch.manual_seed(0)
        model = DLRM(cfg)
        sharding_plan = plan(table_specs(model, pooling=(1 + cfg.max_ids_per_bag) / 2), world_size, batch,
                             dedup=dedup, kinds=kinds)
        dmp = distribute(model, sharding_plan, dedup=dedup, features=ctr_features(model) if one_round else None)
        opt = torch.optim.SGD(dmp.parameters(), lr=0.01)
        for step, (dense, ids, offs, labels) in enumerate(batches(cfg, steps + 1, batch, seed=rank)):
            if step == 1:  # the first step warms up
                STATS.reset()
                start = time.perf_counter()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, ids, offs), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        elapsed = time.perf_counter() - start
        out[name] = {"calls": STATS.calls["ids"] / steps, "bytes": {k: v / steps for k, v in STATS.bytes.items()},
                     "ms": elapsed / steps * 1e3, "plan": str(sharding_plan),
                     "estimate": sharding_plan.loads()[rank].comm_bytes}
    return out


def criteo_1tb_estimates(global_batch: int) -> list[dict]:
    """The planner's plan and estimate on 8, 64 and 512 ranks for one global batch split over the ranks."""
    specs = [TableSpec(f"cat{i}", rows, 128, pooling=1.0, optimizer_slots=1 / 128)  # row-wise Adagrad
             for i, rows in enumerate(CRITEO_1TB_ROWS)]
    rows = []
    for world_size in (8, 64, 512):
        for dedup in (True, False):
            p = plan(specs, world_size, global_batch // world_size, ACCELERATOR, dedup=dedup)
            loads = p.loads()
            spans = [s.span(world_size) for s in p.shardings.values()]
            rows.append({"ranks": world_size, "batch_per_rank": global_batch // world_size, "dedup": dedup,
                         "table_wise": spans.count(1),
                         "row_wise_group": sum(1 < s < world_size for s in spans),
                         "row_wise": spans.count(world_size), "max_memory_gb": max(l.memory for l in loads) / 1e9,
                         "max_all_to_all_mb": max(l.comm_bytes for l in loads) / 1e6,
                         "est_ms": max(l.time_ms(ACCELERATOR) for l in loads)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m models.bench_distributed", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="dim 16, batch 256, 2 steps")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, help="bags per rank per step (default 2048, 256 with --quick)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--json")
    parser.add_argument("--criteo-batch", type=int, default=65536, help="global batch of the Criteo-1TB estimate")
    parser.add_argument("--estimate-only", action="store_true", help="only the Criteo-1TB estimate")
    parser.add_argument("--context-parallel", action="store_true",
                        help="context-parallel HSTU attention on 2 and 4 ranks against one process")
    parser.add_argument("--budget-mib", type=float, help="per-rank attention memory budget (default 8, 1 with --quick)")
    args = parser.parse_args(argv)
    if args.context_parallel:
        return context_parallel_main(args)
    report = {} if args.estimate_only else measured(args)
    report["criteo_1tb"] = criteo_1tb_estimates(args.criteo_batch)
    print_estimates(report["criteo_1tb"], args.criteo_batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def measured(args) -> dict:
    batch = args.batch or (256 if args.quick else 2048)
    steps = args.steps or (2 if args.quick else 5)
    outcomes, hung = spawn(measure, args.nproc, args.quick, batch, steps, timeout_s=600)
    failed = [(r, o.error if o else "no result") for r, o in enumerate(outcomes) if o is None or o.error]
    if hung or failed:
        raise SystemExit(f"bench_distributed: ranks failed: {failed}, did not finish: {hung}")
    results = [o.value for o in outcomes]
    cfg = bench_config(args.quick)
    print(f"DLRM, {len(cfg.table_rows)} tables of {cfg.table_rows[0]}-{cfg.table_rows[-1]} rows, dim {cfg.dim}, "
          f"1-{cfg.max_ids_per_bag} ids per bag, power-law ids (alpha {POWER_LAW_ALPHA}), synthetic data; "
          f"{args.nproc} ranks (gloo, CPU), batch {batch} per rank, mean over {steps} steps")
    print(results[0]["planned"]["plan"])
    print(f"  {'rank':<6}{'variant':<22}{'rounds':>7}" + "".join(f"{kind + ' KB':>11}" for kind in KINDS) +
          f"{'total KB':>10}{'model est KB':>14}{'ms/step':>10}")
    for rank, result in enumerate(results):
        for name, *_ in VARIANTS:
            r = result[name]
            b = r["bytes"]
            print(f"  {rank:<6}{name:<22}{r['calls']:>7.0f}" + "".join(f"{b.get(k, 0) / 1e3:>11.1f}" for k in KINDS) +
                  f"{sum(b.values()) / 1e3:>10.1f}{r['estimate'] / 2e3:>14.1f}{r['ms']:>10.2f}")
        total = {name: sum(r["bytes"].values()) for name, r in result.items()}
        print(f"  rank {rank}: dedup sends {total['table-wise'] / total['table-wise, no dedup']:.2f}x the bytes "
              f"table-wise, {total['row-wise'] / total['row-wise, no dedup']:.2f}x row-wise; one round for all "
              f"tables {result['planned, per table']['ms'] / result['planned']['ms']:.2f}x as fast as one per table")
    print("  (model est: the planner's estimate of bytes sent, half of sent + received, uniform ids: an upper bound)")
    return {"measured": [{str(k): v for k, v in r.items()} for r in results]}


def print_estimates(estimates: list[dict], global_batch: int) -> None:
    print(f"\nCriteo-1TB-sized DLRM, planner estimate: 26 tables, {sum(CRITEO_1TB_ROWS) / 1e6:.1f}M rows, dim 128, "
          f"fp32 + row-wise Adagrad, global batch {global_batch}, 1 id per bag; rank = 64 GB, 25 GB/s all-to-all, "
          f"1.5 TB/s")
    print(f"  {'ranks':>6}{'batch/rank':>11}{'dedup':>7}{'table-wise':>12}{'row-wise (group)':>18}"
          f"{'row-wise (all)':>16}{'GB/rank':>10}{'all-to-all MB/step':>20}{'est. ms/step':>14}")
    for e in estimates:
        print(f"  {e['ranks']:>6}{e['batch_per_rank']:>11}{'on' if e['dedup'] else 'off':>7}{e['table_wise']:>12}"
              f"{e['row_wise_group']:>18}{e['row_wise']:>16}{e['max_memory_gb']:>10.2f}{e['max_all_to_all_mb']:>20.1f}"
              f"{e['est_ms']:>14.2f}")



# ---------------------------------------------------------------------------------------------
# --context-parallel

CP_USERS, CP_HEADS, CP_BLOCK, CP_ALPHA = 2, 2, 64, 0.5
CP_WORLDS = (2, 4)
CP_GRID = 64  # history lengths searched: multiples of this


def cp_problem(length: int, dim: int, seed: int = 0) -> dict:
    """CP_USERS histories of ``length``: q, k, v, the gradient of the output and the relative-position bias."""
    gen = torch.Generator().manual_seed(seed)
    total = CP_USERS * length
    return {"offsets": torch.arange(CP_USERS + 1) * length, "length": length,
            **{n: torch.randn(total, CP_HEADS, dim, generator=gen) for n in ("q", "k", "v", "grad")},
            "rel_bias": torch.randn(2 * length - 1, generator=gen) * 0.1}


def peak_bytes(run: Callable[[], None]) -> int:
    """Peak bytes of the tensors ``run`` allocates (on every device), freed or not."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return sum(int(d["Total"]) for d in tracker.get_tracker_snapshot("peak").values())


def one_process_attention(p: dict, impl: str) -> dict:
    """Forward and backward of ``recompile.hstu_attention``'s kernel ``impl`` on the whole batch, called directly
    (the custom op would hide its temporaries from ``peak_bytes``)."""
    q, k, v, rel_bias = (p[n].clone() for n in ("q", "k", "v", "rel_bias"))
    args = (q, k, v, p["offsets"], p["length"], CP_ALPHA, True, None, 0, rel_bias, None, None)
    out = get_kernel("hstu_attention", impl)(*args)
    (dq, dk, dv), (drel, _) = get_kernel("hstu_attention_backward", impl)(p["grad"], *args)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv, "drel_bias": drel}


def cp_attention(rank: int, world_size: int, p: dict, exchange: str) -> dict:
    """This rank's rows of the forward and backward under context parallelism (rel_bias: this rank's part)."""
    layout = ContextParallelLayout(p["offsets"], world_size)
    local = {n: layout.shard(p[n], rank).requires_grad_() for n in ("q", "k", "v")}
    rel_bias = p["rel_bias"].clone().requires_grad_()
    out = context_parallel_hstu_attention(local["q"], local["k"], local["v"], layout, p["length"], CP_ALPHA, True,
                                          rel_bias=rel_bias, exchange=exchange, block_size=CP_BLOCK)
    out.backward(layout.shard(p["grad"], rank))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in local.items()}, "drel_bias": rel_bias.grad}


def longest_fitting(peak_of: Callable[[int], int], budget: int, start: int) -> tuple[int, int]:
    """The longest history (a multiple of CP_GRID) whose peak fits ``budget``, by doubling then bisection; with
    its peak. ``peak_of`` grows with the length."""
    fits, peak = 0, 0
    length = max(CP_GRID, start // CP_GRID * CP_GRID)
    while (p := peak_of(length)) <= budget:
        fits, peak, length = length, p, length * 2
    lo, hi = fits, length  # fits at lo (or lo == 0), not at hi
    while hi - lo > max(CP_GRID, lo // 8):
        mid = (lo + hi) // 2 // CP_GRID * CP_GRID
        if (p := peak_of(mid)) <= budget:
            lo, peak = mid, p
        else:
            hi = mid
    return lo, peak


def _all_reduce_max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def cp_measure(rank: int, world_size: int, dim: int, budget: int, start: int, check_length: int, rounds: int) -> dict:
    """On each rank: the longest history within ``budget`` (the ranks' largest peak), this rank's peak at
    ``check_length``, the difference from one process there and ms per exchange (slowest rank)."""
    def peak_of(length: int) -> int:
        p = cp_problem(length, dim)
        return int(_all_reduce_max(peak_bytes(lambda: cp_attention(rank, world_size, p, "ring"))))

    longest, longest_peak = longest_fitting(peak_of, budget, start)
    p = cp_problem(check_length, dim)
    peaks = {ex: peak_bytes(lambda: cp_attention(rank, world_size, p, ex)) for ex in ("ring", "all_gather")}
    got, ref = cp_attention(rank, world_size, p, "ring"), one_process_attention(p, "cpu")
    layout = ContextParallelLayout(p["offsets"], world_size)
    torch.distributed.all_reduce(got["drel_bias"])  # the ranks' parts of the replicated bias's gradient
    diff = max(float((got[n] - (ref[n] if n == "drel_bias" else layout.shard(ref[n], rank))).abs().max()
                     / ref[n].abs().max()) for n in got)
    ms = {"ring": [], "all_gather": []}
    for _ in range(rounds):  # interleaved round by round; a round's time is its slowest rank's
        for ex in ms:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            cp_attention(rank, world_size, p, ex)
            ms[ex].append(_all_reduce_max((time.perf_counter() - t0) * 1e3))
    return {"longest": longest, "longest_peak": longest_peak, "peak": peaks, "max_rel_diff": _all_reduce_max(diff),
            "ms": {ex: statistics.median(v) for ex, v in ms.items()}}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def context_parallel_main(args) -> dict:
    dim = 16 if args.quick else 32
    budget = int((args.budget_mib or (1 if args.quick else 8)) * 2**20)
    rounds = 1 if args.quick else 3
    torch.set_num_threads(1)  # as each rank
    single = {impl: longest_fitting(lambda n: peak_bytes(lambda: one_process_attention(cp_problem(n, dim), impl)),
                                    budget, CP_GRID) for impl in ("cpu", "native")}
    check_length = single["cpu"][0]
    single_peak = {impl: peak_bytes(lambda: one_process_attention(cp_problem(check_length, dim), impl))
                   for impl in single}
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads_per_rank": 1,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
              "users": CP_USERS, "heads": CP_HEADS, "dim": dim, "block_size": CP_BLOCK, "budget_bytes": budget,
              "check_length": check_length,
              "one_process": {impl: {"longest": n, "longest_peak": pk, "peak_at_check": single_peak[impl]}
                              for impl, (n, pk) in single.items()},
              "context_parallel": {}}
    print(f"HSTU attention (causal, relative-position bias) forward + backward, {CP_USERS} users, {CP_HEADS} heads, "
          f"dim {dim}, fp32; per-rank budget {budget / 2**20:.1f} MiB; gloo on CPU, 1 thread per rank")
    print(f"  {'':<28}{'longest history':>16}{'x one process':>14}{f'peak MiB @ {check_length}':>18}"
          f"{'max rel diff':>14}{'ring ms':>10}{'all_gather ms':>15}")
    for impl, (n, _) in single.items():
        print(f"  {'one process, ' + impl + ' kernel':<28}{n:>16}{n / single['cpu'][0]:>14.2f}"
              f"{single_peak[impl] / 2**20:>18.2f}")
    for world in CP_WORLDS:
        outcomes, hung = spawn(cp_measure, world, dim, budget, single["cpu"][0], check_length, rounds,
                               timeout_s=600, preload=[f"{__package__}.bench_distributed"])
        failed = [(r, o.error if o else "no result") for r, o in enumerate(outcomes) if o is None or o.error]
        if hung or failed:
            raise SystemExit(f"bench_distributed --context-parallel: ranks failed: {failed}, did not finish: {hung}")
        results = [o.value for o in outcomes]
        first = results[0]
        report["context_parallel"][str(world)] = {
            "longest": first["longest"], "longest_peak": first["longest_peak"], "max_rel_diff": first["max_rel_diff"],
            "ms": first["ms"], "peak_per_rank": [r["peak"] for r in results],
            "longest_vs_one_process": {impl: first["longest"] / n for impl, (n, _) in single.items()}}
        print(f"  {f'{world} ranks (context parallel)':<28}{first['longest']:>16}"
              f"{first['longest'] / single['cpu'][0]:>14.2f}{max(r['peak']['ring'] for r in results) / 2**20:>18.2f}"
              f"{first['max_rel_diff']:>14.1e}{first['ms']['ring']:>10.1f}{first['ms']['all_gather']:>15.1f}")
        print(f"      per-rank peak MiB @ {check_length}, ring: "
              + ", ".join(f"{r['peak']['ring'] / 2**20:.2f}" for r in results)
              + "; all_gather: " + ", ".join(f"{r['peak']['all_gather'] / 2**20:.2f}" for r in results))
    path = args.json or os.path.join("docs", "benchmarks", "context_parallel.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
