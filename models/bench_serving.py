"""Serving, measured side by side: ``python -m models.bench_serving [--quick]`` -> docs/benchmarks/serving.json.

1. HSTU block: the layers over one user's 4,096-token history (3,968 cached, 128 new) with 256 candidates, and
   without candidates: ``CachedHSTURanker`` (paged attention over the cache) against ``HSTURanker``
   recomputing the whole sequence (the native HSTU attention kernel); at this run's model and at the issue's
   anchor block (one layer of dim 1024), each beside its work-ratio ceiling (FLOPs recomputing over FLOPs of
   the cached step, linear layers and attention).
2. End to end, ranking requests replayed per user (ML-100k histories, and synthetic long-tailed histories up
   to 4,096), each request 8 new actions and 256 candidates, batch 1 to 8: with the cache (every timed
   request appends its 8 actions to a warm cache; the cache is rolled back between rounds) and without,
   each eager, ``torch.compile`` (Inductor), ``backend="rec_ascend"`` and as an AOTInductor package
   (``recompile.package``); p50/p99 latency per batch and requests per second.
3. Retrieval: top-100 over 1M synthetic items of dim 64: the native int8-bounded exact top-k
   (``QuantizedItems``) and the blocked torch top-k (``blocked_topk``) against ``torch.topk`` of the full score
   matrix, batch 1 and 8, results compared; and the MoL head's
   dot-shortlist recall against its exact top-100.

Every comparison is timed in interleaved rounds (load falls on all candidates alike); --quick shrinks the
model, the number of users and rounds, not the history lengths of part 1 or the corpus of part 3.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch
from torch.export import Dim

import recompile
from .data import UserSequences, load_ratings
from .layers_jagged import long_tailed_lengths
from .retrieval import TwoTower, TwoTowerConfig
from .retrieval_serving import ItemIndex, QuantizedItems, blocked_topk, matmul_scores, recall
from .sequential import HSTU, HSTUConfig
from .serving import (CachedHSTURanker, HSTURanker, RankingServer, Request, compile_step, make_cache,
                            no_cache_inputs, rank_without_cache)
from .timing import race_ms
from .train import write_json
from recompile.export import load

MODELS = {"quick": dict(num_layers=2, dim=64, num_heads=2, attn_dim=32, linear_dim=32),
          "full": dict(num_layers=4, dim=256, num_heads=4, attn_dim=64, linear_dim=64),
          # the issue's anchor block (dim 1024; 4 heads of 256 as generative-recommenders' HSTU at that width)
          "anchor": dict(num_layers=1, dim=1024, num_heads=4, attn_dim=256, linear_dim=256)}
HISTORY, CACHED, CANDIDATES, NEW_ACTIONS = 4096, 3968, 256, 8
NUM_ITEMS = 10_000
TARGETS = {"block_with_candidates": 8.0, "block_without_candidates": 20.0, "end_to_end_batch1": 2.6,
           "package_vs_compiled_max_slowdown": 1.05, "topk_1m": 2.0}


def environment(threads: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    return {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit}


def make_encoder(model: dict) -> HSTU:
    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=NUM_ITEMS, max_len=HISTORY + CANDIDATES, dropout=0.0, **model)
    return HSTU(cfg).eval()


def random_history(g: torch.Generator, n: int, start: int = 0):
    return (torch.randint(1, NUM_ITEMS + 1, (n,), generator=g),
            start + torch.randint(1, 3600, (n,), generator=g).cumsum(0))


def request(user, ids, ts, g, candidates=CANDIDATES) -> Request:
    """The user's history and ``candidates`` random items, all at the time of the request."""
    cand = torch.randint(1, NUM_ITEMS + 1, (candidates,), generator=g)
    return Request(user, ids, ts, cand, torch.full((candidates,), int(ts[-1]) + 60))


# ---------------------------------------------------------------------------------------------
# 1. the HSTU block


def work(model: dict, history: int, first_row: int, candidates: int) -> dict:
    """FLOPs of one HSTU step computing the history rows from ``first_row`` on and ``candidates`` (the rows before
    ``first_row`` cached): the linear layers (``uvqk`` and ``out``, per token) and the attention (``q.k`` and
    ``w.v``, per (query, key) entry: a history row at position i sees i + 1 keys, a candidate the history and
    itself). Layer norms, SiLU and biases are left out (linear in the tokens, a few percent)."""
    dim, heads, d, dv = model["dim"], model["num_heads"], model["attn_dim"], model["linear_dim"]
    tokens = history - first_row + candidates
    entries = (history * (history + 1) - first_row * (first_row + 1)) // 2 + candidates * (history + 1)
    linear = 2 * tokens * (dim * heads * (2 * d + 2 * dv) + heads * dv * dim)
    attention = 2 * entries * heads * (d + dv)
    return {"linear_flops": linear * model["num_layers"], "attention_flops": attention * model["num_layers"]}


def work_ratio(model: dict, history: int, cached: int, candidates: int) -> float:
    """FLOPs recomputing the whole sequence over FLOPs of the cached step: the speedup the cache can give at
    equal speed per FLOP (the ceiling of the measured ratio)."""
    full, step = work(model, history, 0, candidates), work(model, history, cached, candidates)
    return sum(full.values()) / sum(step.values())


def bench_block(model: dict, rounds: int, warmup: int = 3, clock=time.perf_counter) -> dict:
    encoder = make_encoder(model)
    g = torch.Generator().manual_seed(1)
    ids, ts = random_history(g, HISTORY)
    cache = make_cache(encoder, num_pages=HISTORY // 32 + 8, page_size=32)
    server = RankingServer(CachedHSTURanker(encoder), cache)
    server.rank([Request(0, ids[:CACHED], ts[:CACHED], ids[:0], ts[:0])])  # the cached prefix
    recompute, result = HSTURanker(encoder), {"model": model}
    for name, candidates in (("with_candidates", CANDIDATES), ("without_candidates", 0)):
        req = request(0, ids, ts, torch.Generator().manual_seed(2), candidates)
        step = server.prepare([req])
        full = no_cache_inputs([req])
        with torch.no_grad():
            torch.testing.assert_close(server.model(*step.args)[0][-max(candidates, 1):],
                                       recompute(*full)[-max(candidates, 1):], rtol=1e-4, atol=1e-4)
            ms = race_ms({"cached": lambda: server.model(*step.args), "recompute": lambda: recompute(*full)}, rounds,
                         warmup=warmup, clock=clock)
        cached_work = work(model, HISTORY, CACHED, candidates)
        result[name] = {**ms, "speedup": ms["recompute"] / ms["cached"], "cached_tokens": CACHED,
                        "new_tokens": HISTORY - CACHED, "candidates": candidates,
                        "work_ratio": work_ratio(model, HISTORY, CACHED, candidates),
                        "cached_gflops_per_s": sum(cached_work.values()) / ms["cached"] / 1e6,
                        "recompute_gflops_per_s": sum(work(model, HISTORY, 0, candidates).values()) / ms["recompute"] / 1e6}
        r = result[name]
        print(f"block dim {model['dim']} x {model['num_layers']} layers {name}: cached {ms['cached']:.1f} ms "
              f"({r['cached_gflops_per_s']:.0f} GFLOP/s), recompute {ms['recompute']:.1f} ms "
              f"({r['recompute_gflops_per_s']:.0f} GFLOP/s): {r['speedup']:.1f}x (work-ratio ceiling "
              f"{r['work_ratio']:.1f}x)")
    return result


# ---------------------------------------------------------------------------------------------
# 2. end to end


def ml100k_histories(limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seqs = UserSequences.from_ratings(load_ratings())
    users = np.random.default_rng(0).permutation(len(seqs))[:limit]
    return [(torch.from_numpy(seqs.items[u][-HISTORY:]).long().clamp(max=NUM_ITEMS),
             torch.from_numpy(seqs.timestamps[u][-HISTORY:]).long()) for u in users]


def synthetic_histories(count: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    lengths = long_tailed_lengths(count, max_len, g).clamp(min=NEW_ACTIONS + 1)
    return [random_history(g, int(n)) for n in lengths]


def packaged(model, example_args, dims, folder: str, name: str):
    model.choose_kernel(*example_args)
    return load(recompile.package(model, example_args, os.path.join(folder, f"{name}.pt2"), dynamic_shapes=dims))


ROWS, BATCH = Dim("rows"), Dim("batch")
NO_CACHE_DIMS = ({0: ROWS}, {0: ROWS}, {0: ROWS}, {0: BATCH + 1}, {0: BATCH})
CACHED_DIMS = NO_CACHE_DIMS + ({0: BATCH, 1: Dim("pages")}, {0: BATCH}, None, None, None)


def percentiles(samples: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(samples, 50)), "p99_ms": float(np.percentile(samples, 99)),
            "mean_ms": statistics.fmean(samples)}


def dataset_work_ratio(model: dict, histories: list) -> float:
    """The work-ratio ceiling of a dataset's requests (each history, its last NEW_ACTIONS new, CANDIDATES
    candidates): their FLOPs without the cache over those with it. Short histories leave it near 1: the candidates'
    attention to the history and their linear layers are computed either way."""
    def flops(first_new) -> int:
        return sum(sum(work(model, len(ids), first_new(len(ids)), CANDIDATES).values()) for ids, _ in histories)

    return flops(lambda n: 0) / flops(lambda n: n - NEW_ACTIONS)


def bench_end_to_end(encoder: HSTU, model: dict, datasets: dict, batches: list[int], rounds: int,
                     variants: list[str], folder: str) -> dict:
    g = torch.Generator().manual_seed(4)
    plain, cached_model = HSTURanker(encoder), CachedHSTURanker(encoder)
    total_tokens = sum(int(ids.numel()) for hs in datasets.values() for ids, _ in hs)
    page_size = 32
    cache = make_cache(encoder, num_pages=total_tokens // page_size + 4 * sum(len(h) for h in datasets.values()) + 8,
                       page_size=page_size)
    result = {}
    # warm every user's cache with its history but the last NEW_ACTIONS, then build the replayed batches
    plans = {}
    warm = RankingServer(cached_model, cache)
    for data, histories in datasets.items():
        users = [(data, i) for i in range(len(histories))]
        for user, (ids, ts) in zip(users, histories):
            warm.rank([Request(user, ids[:-NEW_ACTIONS], ts[:-NEW_ACTIONS], ids[:0], ts[:0])])
        reqs = [request(u, ids, ts, g) for u, (ids, ts) in zip(users, histories)]
        plans[data] = {b: [reqs[i : i + b] for i in range(0, len(reqs) - b + 1, b)] for b in batches}
    example = plans[next(iter(plans))][max(batches)][0]
    steps = {"no_cache": {}, "cache": {}}
    for variant in variants:
        if variant == "eager":
            steps["no_cache"][variant], steps["cache"][variant] = plain, cached_model
        elif variant in ("inductor", "rec_ascend"):
            steps["no_cache"][variant], steps["cache"][variant] = compile_step(plain, variant), compile_step(cached_model, variant)
        elif variant == "package":
            start = time.perf_counter()
            steps["no_cache"][variant] = packaged(plain, no_cache_inputs(example), NO_CACHE_DIMS, folder, "no_cache")
            server = RankingServer(cached_model, cache)
            args = server.prepare(example).args
            for r in example:
                cache.truncate(r.user, r.history.numel() - NEW_ACTIONS)
            steps["cache"][variant] = packaged(cached_model, args, CACHED_DIMS, folder, "cache")
            print(f"packages built in {time.perf_counter() - start:.0f} s")
    servers = {v: RankingServer(cached_model, cache, step) for v, step in steps["cache"].items()}

    def serve(mode: str, variant: str, batch: list[Request]):
        if mode == "no_cache":
            return rank_without_cache(steps["no_cache"][variant], batch)
        try:
            return servers[variant].rank(batch)
        finally:  # roll the cache back: the next round appends the same actions again
            for r in batch:
                cache.truncate(r.user, r.history.numel() - NEW_ACTIONS)

    for data, by_batch in plans.items():
        for b, batches_of_requests in by_batch.items():
            for mode in steps:  # warm-up (compiles), results checked against eager without the cache
                for variant in variants:
                    for batch in batches_of_requests[:2]:
                        with torch.no_grad():
                            want = rank_without_cache(plain, batch)
                            for got, w in zip(serve(mode, variant, batch), want):
                                torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)
            samples = {(m, v): [] for m in steps for v in variants}
            for _ in range(rounds):
                for batch in batches_of_requests:
                    for key in samples:
                        start = time.perf_counter()
                        serve(*key, batch)
                        samples[key].append((time.perf_counter() - start) * 1e3)
            for (mode, variant), times in samples.items():
                stats = percentiles(times)
                stats["requests_per_s"] = b / stats["mean_ms"] * 1e3
                result.setdefault(data, {}).setdefault(f"batch{b}", {}).setdefault(mode, {})[variant] = stats
            row = result[data][f"batch{b}"]
            row["work_ratio"] = dataset_work_ratio(model, datasets[data])
            for variant in variants:
                row.setdefault("cache_speedup", {})[variant] = (row["no_cache"][variant]["mean_ms"]
                                                                / row["cache"][variant]["mean_ms"])
            print(f"{data} batch {b}: " + "  ".join(
                f"{v} p50 {row['no_cache'][v]['p50_ms']:.1f} -> {row['cache'][v]['p50_ms']:.1f} ms "
                f"({row['cache_speedup'][v]:.1f}x)" for v in variants) + f"  (work-ratio ceiling {row['work_ratio']:.2f}x)")
    return result


# ---------------------------------------------------------------------------------------------
# 3. retrieval


def bench_retrieval(items: int, dim: int, k: int, rounds: int, mol_items: int) -> dict:
    g = torch.Generator().manual_seed(5)
    corpus = torch.randn(items, dim, generator=g)
    result = {"items": items, "dim": dim, "k": k}
    start = time.perf_counter()
    index = QuantizedItems(corpus)
    result["index_build_s"] = time.perf_counter() - start
    for batch in (1, 8):
        queries = torch.randn(batch, dim, generator=g)
        values, indices = index.topk(queries, k)
        full = (queries @ corpus.t()).topk(k, dim=1)
        torch.testing.assert_close(values, full.values, rtol=1e-5, atol=1e-5)
        ms = race_ms({"quantized": lambda: index.topk(queries, k),
                      "blocked": lambda: blocked_topk(matmul_scores(queries, corpus), items, k),
                      "full_topk": lambda: (queries @ corpus.t()).topk(k, dim=1)}, rounds)
        result[f"batch{batch}"] = {**ms, "speedup": ms["full_topk"] / ms["quantized"],
                                   "blocked_speedup": ms["full_topk"] / ms["blocked"],
                                   "recall_vs_full": recall(indices, full.indices)}
        print(f"top-{k} of {items} x {dim}, batch {batch}: int8-bounded {ms['quantized']:.1f} ms, blocked "
              f"{ms['blocked']:.1f} ms, torch.topk on the full matrix {ms['full_topk']:.1f} ms "
              f"({result[f'batch{batch}']['speedup']:.2f}x, recall {result[f'batch{batch}']['recall_vs_full']:.3f})")
    torch.manual_seed(0)
    model = TwoTower(TwoTowerConfig(num_users=100, num_items=mol_items, dim=dim, tower=[128, dim], head="mol")).eval()
    index = ItemIndex(model)
    users = torch.arange(1, 9)
    history, offsets = torch.randint(1, mol_items + 1, (40,), generator=g), torch.arange(0, 40, 5)
    ms = {"exact": lambda: index.topk(users, history, offsets, k)}
    _, exact = index.topk(users, history, offsets, k)
    mol = {"items": mol_items, "batch": 8}
    for shortlist in (4 * k, 16 * k):
        _, found = index.topk(users, history, offsets, k, shortlist=shortlist)
        mol[f"shortlist{shortlist}_recall"] = recall(found, exact)
        ms[f"shortlist{shortlist}"] = lambda s=shortlist: index.topk(users, history, offsets, k, shortlist=s)
    mol["ms"] = race_ms(ms, max(1, rounds // 2))
    print(f"MoL top-{k} of {mol_items}: " + "  ".join(f"{n} {t:.1f} ms" for n, t in mol["ms"].items()) + "  " +
          "  ".join(f"{n} {v:.3f}" for n, v in mol.items() if n.endswith("recall")))
    result["mol_shortlist"] = mol
    return result


def summarize(result: dict) -> dict:
    """Each target of TARGETS against what was measured (None where its part did not run)."""
    blocks, e2e, retrieval = result.get("block", {}), result.get("end_to_end", {}), result.get("retrieval")

    def block(name: str) -> dict:
        return {shape: {"speedup": b[name]["speedup"], "work_ratio_ceiling": b[name]["work_ratio"]}
                for shape, b in blocks.items()}

    measured = {
        "block_with_candidates": block("with_candidates"),
        "block_without_candidates": block("without_candidates"),
        "end_to_end_batch1": {data: {"speedup": rows["batch1"]["cache_speedup"],
                                     "work_ratio_ceiling": rows["batch1"]["work_ratio"]}
                              for data, rows in e2e.items() if "batch1" in rows},
        "package_vs_compiled_max_slowdown": {
            f"{data} {batch} {mode}": row[mode]["package"]["mean_ms"] / row[mode]["inductor"]["mean_ms"]
            for data, rows in e2e.items() for batch, row in rows.items() for mode in ("no_cache", "cache")
            if {"package", "inductor"} <= set(row[mode])},
        "topk_1m": retrieval and {b: retrieval[b]["speedup"] for b in ("batch1", "batch8")},
    }
    return {name: {"target": TARGETS.get(name), "measured": value} for name, value in measured.items()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few users and rounds")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--variants", nargs="+", default=["eager", "inductor", "rec_ascend", "package"])
    p.add_argument("--parts", nargs="+", default=["block", "end_to_end", "retrieval"])
    p.add_argument("--no-anchor", dest="anchor", action="store_false",
                   help="skip the anchor block (dim 1024, one layer: a couple of minutes on one core)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the block by the thread's CPU time (with --threads 1: other processes' load left out)")
    p.add_argument("--json", default=os.path.join("docs", "benchmarks", "serving.json"))
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    rounds = 3 if args.quick else 10
    result = {"environment": environment(args.threads), "quick": args.quick, "model": MODELS[size],
              "targets": TARGETS}
    if "block" in args.parts:  # this run's model, then the anchor block (few rounds: ~1 s a recompute)
        if args.cpu_time and args.threads != 1:
            raise SystemExit("--cpu-time counts the calling thread's CPU time: it needs --threads 1")
        clock = time.thread_time if args.cpu_time else time.perf_counter
        result["block_clock"] = "cpu" if args.cpu_time else "wall"
        result["block"] = {size: bench_block(MODELS[size], rounds, clock=clock)}
        if args.anchor:
            result["block"]["anchor"] = bench_block(MODELS["anchor"], rounds=2, warmup=1, clock=clock)
    encoder = make_encoder(MODELS[size])
    if "end_to_end" in args.parts:
        users = 8 if args.quick else 64
        datasets = {"ml-100k": ml100k_histories(users),
                    "synthetic": synthetic_histories(users, 2048 if args.quick else HISTORY)}
        batches = [1, 8] if args.quick else [1, 2, 4, 8]
        with tempfile.TemporaryDirectory() as folder:
            result["end_to_end"] = bench_end_to_end(encoder, MODELS[size], datasets, batches, rounds,
                                                    args.variants, folder)
    if "retrieval" in args.parts:
        result["retrieval"] = bench_retrieval(1_000_000, 64, 100, rounds, 20_000 if args.quick else 100_000)
    result["summary"] = summarize(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
