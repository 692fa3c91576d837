"""Quantized tables: accuracy and speed of int8 / int4 row-wise tables against fp32.

``python -m models.bench_quantize [--quick]``:

- accuracy: a CTR model (DLRM and DCN-v2 of the zoo) trained in fp32 on the synthetic Criteo-shaped set
  (models/data.py), then evaluated on held-out rows with its tables fp32, int8 and int4 (``recompile.quantize``):
  AUC and log-loss;
- speed: the grouped lookup of 26 tables at batch 2048 (the zoo's "bench" CTR size: 100k rows, dim 64), timed side
  by side and interleaved round by round: the int8 and int4 quantized lookups (native kernel), the fp32 grouped
  lookup (native kernel), and FBGEMM's CPU int8 TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``) on the same codes,
  in its own storage and copied onto transparent huge pages as ``recompile.quantize`` stores tables (the kernels
  compared on the same pages);
- memory: the bytes of the tables in each format, with the scale/bias overhead;
- ``--hkv-find`` (only this timing): hkv hash tables storing int8 / int4 rows, ``find`` by the CPU kernel (probe, then
  the row dequantized into fp32 as it is copied out) with each dequantize path this CPU has (``generic``: the
  portable loop, the only path before; ``avx2``; ``avx512``), interleaved round by round, beside an fp32 table's
  find (a plain copy);
- ``--accuracy [all|ctr|ranking]`` (only the accuracy, no timing): the CTR accuracy above, and / or ranking accuracy on ML-100k: the zoo's
  HSTU trained in fp32 with a fixed seed, then its item and position tables served fp32, int8 and int4: HR@10 and
  NDCG@10 of every user's held-out item ranked among all items (``ranking_accuracy``).

The accuracy models include DLRM over hkv hash tables (``dlrm_hkv``: its tables quantized inside the hash table).
Writes docs/benchmarks/quantize.json (machine, threads, date, commit; keys merged into what is there), except with
--quick.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F

import recompile
from models import data as D
from models.ctr import DCNConfig, DCNv2
from models.dlrm import DLRM, DLRMConfig
from models.metrics import auc, log_loss, ranking_metrics
from models.timing import race_ms
from models.train import write_json
from recompile.runtime.native import ISAS, use_isa
from recompile.runtime.quantized import dequantize_rows, on_huge_pages, quantize_rows, row_storage, scale_bias

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "quantize.json")
QOP = torch.ops.recompile.grouped_embedding_bag_quantized.default


def _models(table_rows: list[int], dim: int) -> dict:
    return {"dlrm": DLRM(DLRMConfig(table_rows=table_rows, dim=dim, bottom=[64, dim], top=[64, 32, 1])),
            "dcn_v2": DCNv2(DCNConfig(table_rows=table_rows, dim=dim, deep=[64, 32])),
            "dlrm_hkv": DLRM(DLRMConfig(table_rows=table_rows, dim=dim, bottom=[64, dim], top=[64, 32, 1],
                                        dynamic_embeddings=True))}


def accuracy(rows: int, steps_per_epoch_rows: int, epochs: int, batch: int, seed: int = 0) -> dict:
    """AUC and log-loss on held-out rows of each model trained in fp32, with its tables fp32, int8, int4."""
    table_rows, dim = [1000, 5000, 20000, 200, 50, 10000, 3000, 100], 16
    data = D.criteo_synthetic(rows + rows // 5, table_rows, seed=seed)
    test = data.batch(np.arange(rows, rows + rows // 5))
    torch.manual_seed(seed)
    result = {}
    for name, model in _models(table_rows, dim).items():
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for index in D.batches(steps_per_epoch_rows, batch, g):
                dense, indices, offsets, labels = data.batch(index)
                optimizer.zero_grad()
                F.binary_cross_entropy_with_logits(model(dense, indices, offsets), labels).backward()
                optimizer.step()
        model.eval().requires_grad_(False)
        result[name] = {}
        for qdtype in ("fp32", "int8", "int4"):
            served = model if qdtype == "fp32" else recompile.quantize(model, qdtype)
            with torch.no_grad():
                logits = served(*test[:3])
            result[name][qdtype] = {"AUC": auc(test[3], logits), "log_loss": log_loss(test[3], logits)}
        for qdtype in ("int8", "int4"):
            result[name][qdtype]["AUC_delta"] = result[name][qdtype]["AUC"] - result[name]["fp32"]["AUC"]
    return result


RANKING_K = 10


def _served_ranker(task, qdtype: str):
    """A copy of the next-item ``task`` with its encoder's tables quantized; items are scored against the
    dequantized item table (what a retrieval index built from the served table holds)."""
    served = recompile.quantize(task, qdtype)
    served.item_embeddings = lambda: F.normalize(served.encoder.item_emb.dequantized()[1:], dim=-1)
    return served


def ranking_accuracy(epochs: int, seed: int = 0, model: str = "hstu") -> dict:
    """HR@10 / NDCG@10 on ML-100k's held-out test item of the zoo's ``model`` trained in fp32 (eager, ``seed``),
    with its tables fp32, int8 and int4 (``recompile.quantize``); every user's item ranked among all items."""
    from models.train import Run, parser, sequential_ranks, train_sequential

    args = parser().parse_args(["--model", model, "--backend", "eager", "--epochs", str(epochs), "--seed", str(seed),
                                "--batch-size", "256", "--max-len", "20", "--quiet"])
    split = D.leave_one_out(D.load_ratings(D.ML100K))
    torch.manual_seed(seed)
    task, _ = train_sequential(args, split, Run())
    task.eval().requires_grad_(False)
    ranks = {q: sequential_ranks(task if q == "fp32" else _served_ranker(task, q), split,
                                 task.encoder.input_format, args.max_len)
             for q in ("fp32", "int8", "int4")}
    result = {"model": model, "data": "ml-100k, leave-one-out, test item", "epochs": epochs, "seed": seed,
              "dim": args.dim, "max_len": args.max_len, "users": len(ranks["fp32"])}
    for q, r in ranks.items():
        result[q] = ranking_metrics(r, (RANKING_K,))
        if q != "fp32":
            result[q].update({f"{m}_delta": result[q][m] - result["fp32"][m] for m in list(result[q])})
            result[q]["users_rank_changed"] = float((r != ranks["fp32"]).float().mean())
    return result


def _merged(path: str, result: dict) -> dict:
    """``result`` over the keys already in the JSON at ``path`` (each part of the benchmark writes its own)."""
    if not os.path.exists(path):
        return result
    with open(path) as f:
        return {**json.load(f), **result}


def _tbe(tables: list[torch.Tensor], dim: int):
    """FBGEMM's CPU int8 TBE holding the same codes (its fp16 scale/bias: ours rounded)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(f"t{i}", t.shape[0], dim, SparseType.INT8, EmbeddingLocation.HOST) for i, t in enumerate(tables)],
        device="cpu", pooling_mode=PoolingMode.SUM, output_dtype=SparseType.FP32)
    tbe.initialize_weights()
    for packed, (codes, sb) in zip(tables, tbe.split_embedding_weights()):
        codes.copy_(packed[:, :dim])
        sb.copy_(scale_bias(packed, "int8").half().view(torch.uint8))
    return tbe


def _on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in storage like the packed tables' (runtime.quantized: on transparent huge pages), so that
    FBGEMM's kernel can be timed on the same pages as ours."""
    return on_huge_pages(row_storage(1, t.numel()).view(t.shape).copy_(t))


def _huge_page_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return 0


def speed(num_tables: int, rows: int, dim: int, batch: int, bag: int, rounds: int, clock=time.perf_counter,
          seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    floats = [torch.randn(rows, dim, generator=g) for _ in range(num_tables)]
    before = _huge_page_bytes()
    packed = {q: [quantize_rows(w, q) for w in floats] for q in ("int8", "int4")}
    on_huge_pages = min(1.0, (_huge_page_bytes() - before) / sum(t.nbytes for ts in packed.values() for t in ts))
    lengths = [torch.randint(1, 2 * bag, (batch,), generator=g) if bag > 1 else torch.ones(batch, dtype=torch.long)
               for _ in floats]
    indices = [torch.randint(0, rows, (int(n.sum()),), generator=g) for n in lengths]
    offsets = [F.pad(n.cumsum(0), (1, 0)) for n in lengths]
    lookup = (indices, offsets, [torch.empty(0)] * num_tables, [0] * num_tables, [-1] * num_tables,
              [True] * num_tables)
    names = ",".join(f"t{i}" for i in range(num_tables))
    tbe, tbe_huge = _tbe(packed["int8"], dim), _tbe(packed["int8"], dim)
    tbe_huge.weights_host = _on_huge_pages(tbe_huge.weights_host)
    tbe_ids, tbe_offsets = torch.cat(indices).int(), F.pad(torch.cat(lengths).cumsum(0), (1, 0)).int()
    steps = {
        "fp32 grouped (native)": lambda: torch.ops.recompile.grouped_embedding_bag(
            floats, *lookup, [False] * num_tables, "concat", names, "fatal", "native"),
        "int8 grouped (native)": lambda: QOP(packed["int8"], *lookup, "int8", "concat", names, "fatal", "native"),
        "int4 grouped (native)": lambda: QOP(packed["int4"], *lookup, "int4", "concat", names, "fatal", "native"),
        "fbgemm int8 TBE (CPU)": lambda: tbe(tbe_ids, tbe_offsets),
        "fbgemm int8 TBE (CPU), huge pages": lambda: tbe_huge(tbe_ids, tbe_offsets),
    }
    outs = {name: step() for name, step in steps.items()}
    reference = torch.cat([F.embedding_bag(ids, dequantize_rows(w, "int8"), offs, mode="sum", include_last_offset=True)
                           for w, ids, offs in zip(packed["int8"], indices, offsets)], 1)
    errors = {name: float((out - reference).abs().max()) for name, out in outs.items() if "int8" in name}
    ms = race_ms(steps, rounds, clock=clock)
    fp32, int8 = ms["fp32 grouped (native)"], ms["int8 grouped (native)"]
    memory = {"fp32": sum(w.nbytes for w in floats), **{q: sum(t.nbytes for t in ts) for q, ts in packed.items()},
              "fbgemm_int8_tbe": int(tbe.weights_host.nbytes)}
    return {"tables": num_tables, "rows": rows, "dim": dim, "batch": batch, "mean_ids_per_bag": bag, "ms": ms,
            "int8_speedup_vs_fp32": fp32 / int8, "int8_speedup_vs_fbgemm_tbe": ms["fbgemm int8 TBE (CPU)"] / int8,
            "int8_speedup_vs_fbgemm_tbe_on_huge_pages": ms["fbgemm int8 TBE (CPU), huge pages"] / int8,
            "packed_tables_on_huge_pages": on_huge_pages,
            "max_abs_error_vs_dequantized_reference": errors, "bytes": memory,
            "bytes_ratio_to_fp32": {q: b / memory["fp32"] for q, b in memory.items()},
            "scale_bias_bytes_per_row": {"int8": 8, "int4": 4, "fbgemm_int8_tbe": 4}}


def hkv_find_speed(rows: int, dim: int, probes: int, rounds: int, clock=time.perf_counter, seed: int = 0) -> dict:
    """ms of ``find`` on hkv tables of ``rows`` keys: int8 and int4 per dequantize ISA, and fp32."""
    import hkv

    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(4 * rows, generator=g)[:rows] * 7919 + 3
    values = torch.randn(rows, dim, generator=g)
    probe = keys[torch.randint(0, rows, (probes,), generator=g)]
    tables = {}
    for dtype in ("int8", "int4", torch.float32):
        tables[dtype] = hkv.HashTable(dim=dim, init_capacity=2 * rows, max_capacity=2 * rows, dtype=dtype,
                                      kernel="cpu")
        tables[dtype].insert_or_assign(keys, values)

    def find(dtype, isa=None):
        def step():
            with use_isa(isa) if isa else contextlib.nullcontext():
                return tables[dtype].find(probe)[0]
        return step

    isas = [name for name in ISAS if torch.ops.hkv_native.isa_available(name)]
    steps = {f"{q} find ({name})": find(q, name) for q in ("int8", "int4") for name in isas}
    steps["fp32 find (copy)"] = find(torch.float32)
    outs = {name: step() for name, step in steps.items()}
    equal = all(torch.equal(outs[f"{q} find ({name})"], outs[f"{q} find (generic)"]) for q in ("int8", "int4")
                for name in isas)
    ms = race_ms(steps, rounds, clock=clock)
    speedups = {f"{q} {name} vs generic": ms[f"{q} find (generic)"] / ms[f"{q} find ({name})"]
                for q in ("int8", "int4") for name in isas if name != "generic"}
    return {"rows": rows, "dim": dim, "probes": probes, "isas": isas, "ms": ms, "speedups": speedups,
            "paths_equal_bit_for_bit": equal}


def _hkv_find_main(args, result: dict) -> dict:
    sizes = dict(rows=20_000, probes=4_096) if args.quick else dict(rows=500_000, probes=65_536)
    for dim in (64, 128):
        r = result[f"hkv_find_dim{dim}"] = hkv_find_speed(dim=dim, **sizes, rounds=3 if args.quick else args.rounds,
                                                         clock=time.thread_time if args.cpu_time else time.perf_counter)
        print(f"hkv find: {r['probes']} keys of {r['rows']} in the table, dim {dim}, {result['threads']} threads "
              f"(best of interleaved rounds, {result['clock']}); paths equal bit for bit: {r['paths_equal_bit_for_bit']}")
        for name, ms in r["ms"].items():
            print(f"  {name:20s} {ms:8.3f} ms")
        print("  " + ", ".join(f"{name} {x:.2f}x" for name, x in r["speedups"].items()))
    if not args.quick:
        write_json(OUT, _merged(OUT, {"hkv_find": result}))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few rounds, no JSON (a smoke run)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bag", type=int, default=1, help="mean ids per bag (1: Criteo's one id per feature)")
    parser.add_argument("--note", default="", help="how the machine was loaded, for the JSON")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (with --threads 1 on a loaded machine), not wall time")
    parser.add_argument("--accuracy", nargs="?", const="all", choices=("all", "ctr", "ranking"),
                        help="only the accuracy, no timing: CTR AUC / log-loss and / or ML-100k ranking (HSTU: HR@10, "
                             "NDCG@10), each fp32 / int8 / int4")
    parser.add_argument("--hkv-find", action="store_true",
                        help="only the hkv dequantize-on-copy timing: find on int8 / int4 hash tables per ISA")
    parser.add_argument("--ranking-epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "isa": torch.ops.recompile_native.isa(), "note": args.note,
              "clock": "thread CPU time" if args.cpu_time else "wall"}
    if args.accuracy:
        return _accuracy_main(args, result)
    if args.hkv_find:
        return _hkv_find_main(args, result)
    sizes = dict(num_tables=26, rows=2_000 if args.quick else 100_000, dim=64, batch=2048)
    for bag in sorted({1, args.bag}):
        key = f"speed_bag{bag}"
        result[key] = speed(**sizes, bag=bag, rounds=3 if args.quick else args.rounds,
                            clock=time.thread_time if args.cpu_time else time.perf_counter)
        r = result[key]
        print(f"lookup: {r['tables']} tables x {r['rows']} rows x dim {r['dim']}, batch {r['batch']}, "
              f"~{bag} ids per bag, {result['threads']} threads, ISA {result['isa']} (best of interleaved rounds, "
              f"{result['clock']})")
        for name, ms in r["ms"].items():
            print(f"  {name:24s} {ms:8.3f} ms")
        print(f"  int8 vs fp32 grouped: {r['int8_speedup_vs_fp32']:.2f}x; int8 vs FBGEMM int8 TBE: "
              f"{r['int8_speedup_vs_fbgemm_tbe']:.2f}x (its own storage), "
              f"{r['int8_speedup_vs_fbgemm_tbe_on_huge_pages']:.2f}x (on huge pages as ours; "
              f"{r['packed_tables_on_huge_pages']:.0%} of the packed bytes are); max |error| vs dequantized reference "
              f"{r['max_abs_error_vs_dequantized_reference']}")
    memory = result["speed_bag1"]
    print("memory: " + ", ".join(f"{q} {b / 2**20:.1f} MiB ({memory['bytes_ratio_to_fp32'][q]:.3f} of fp32)"
                                 for q, b in memory["bytes"].items())
          + "; scale+bias per row: int8 8 B (fp32 pair), int4 4 B (fp16 pair), TBE 4 B (+ row alignment)")
    result["accuracy"] = _ctr_accuracy(args)
    if not args.quick:
        write_json(OUT, _merged(OUT, result))
    return result


def _ctr_accuracy(args) -> dict:
    result = accuracy(rows=4_000 if args.quick else 200_000, steps_per_epoch_rows=4_000 if args.quick else 200_000,
                      epochs=1 if args.quick else 2, batch=512)
    for name, per in result.items():
        print(f"accuracy {name}: " + "; ".join(f"{q} AUC {m['AUC']:.4f} log-loss {m['log_loss']:.4f}"
                                               for q, m in per.items()))
    return result


def _accuracy_main(args, header: dict) -> dict:
    """``--accuracy``: the CTR and / or ML-100k ranking accuracy, printed, merged into the JSON ("accuracy",
    "ranking_accuracy", each with its run's date and commit in "<key>_run"); the timing keys are left as they are."""
    run = {k: header[k] for k in ("date", "commit", "threads", "machine", "note")}
    result = {}
    if args.accuracy in ("all", "ctr"):
        result.update(accuracy=_ctr_accuracy(args), accuracy_run=run)
    if args.accuracy in ("all", "ranking"):
        result.update(ranking_accuracy=_ranking_accuracy(args), ranking_accuracy_run=run)
    if not args.quick:
        write_json(OUT, _merged(OUT, result))
    return result


def _ranking_accuracy(args) -> dict:
    ranking = ranking_accuracy(1 if args.quick else args.ranking_epochs, args.seed)
    print(f"ranking accuracy, {ranking['model']} on {ranking['data']} ({ranking['users']} users, "
          f"{ranking['epochs']} epochs, seed {ranking['seed']}): "
          + "; ".join(f"{q} HR@{RANKING_K} {ranking[q][f'HR@{RANKING_K}']:.4f} NDCG@{RANKING_K} "
                      f"{ranking[q][f'NDCG@{RANKING_K}']:.4f}" for q in ("fp32", "int8", "int4")))
    return ranking


if __name__ == "__main__":
    main()
