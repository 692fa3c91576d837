"""Quantized tables: accuracy and speed of int8 / int4 row-wise tables against fp32.

``python -m models.bench_quantize [--quick]``:

- accuracy: a CTR model (DLRM and DCN-v2 of the zoo) trained in fp32 on the synthetic Criteo-shaped set
  (models/data.py), then evaluated on held-out rows with its tables fp32, int8 and int4 (``recompile.quantize``):
  AUC and log-loss;
- speed: the grouped lookup of 26 tables at batch 2048 (the zoo's "bench" CTR size: 100k rows, dim 64), timed side
  by side and interleaved round by round: the int8 and int4 quantized lookups (native kernel), the fp32 grouped
  lookup (native kernel), and FBGEMM's CPU int8 TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``) on the same codes;
- memory: the bytes of the tables in each format, with the scale/bias overhead.

Writes docs/benchmarks/quantize.json (machine, threads, date, commit), except with --quick.
"""
from __future__ import annotations

import argparse
import datetime
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
from models.metrics import auc, log_loss
from models.timing import race_ms
from models.train import write_json
from recompile.runtime.quantized import dequantize_rows, quantize_rows, scale_bias

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "quantize.json")
QOP = torch.ops.recompile.grouped_embedding_bag_quantized.default


def _models(table_rows: list[int], dim: int) -> dict:
    return {"dlrm": DLRM(DLRMConfig(table_rows=table_rows, dim=dim, bottom=[64, dim], top=[64, 32, 1])),
            "dcn_v2": DCNv2(DCNConfig(table_rows=table_rows, dim=dim, deep=[64, 32]))}


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


def speed(num_tables: int, rows: int, dim: int, batch: int, bag: int, rounds: int, clock=time.perf_counter,
          seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    floats = [torch.randn(rows, dim, generator=g) for _ in range(num_tables)]
    packed = {q: [quantize_rows(w, q) for w in floats] for q in ("int8", "int4")}
    lengths = [torch.randint(1, 2 * bag, (batch,), generator=g) if bag > 1 else torch.ones(batch, dtype=torch.long)
               for _ in floats]
    indices = [torch.randint(0, rows, (int(n.sum()),), generator=g) for n in lengths]
    offsets = [F.pad(n.cumsum(0), (1, 0)) for n in lengths]
    lookup = (indices, offsets, [torch.empty(0)] * num_tables, [0] * num_tables, [-1] * num_tables,
              [True] * num_tables)
    names = ",".join(f"t{i}" for i in range(num_tables))
    tbe = _tbe(packed["int8"], dim)
    tbe_ids, tbe_offsets = torch.cat(indices).int(), F.pad(torch.cat(lengths).cumsum(0), (1, 0)).int()
    steps = {
        "fp32 grouped (native)": lambda: torch.ops.recompile.grouped_embedding_bag(
            floats, *lookup, [False] * num_tables, "concat", names, "fatal", "native"),
        "int8 grouped (native)": lambda: QOP(packed["int8"], *lookup, "int8", "concat", names, "fatal", "native"),
        "int4 grouped (native)": lambda: QOP(packed["int4"], *lookup, "int4", "concat", names, "fatal", "native"),
        "fbgemm int8 TBE (CPU)": lambda: tbe(tbe_ids, tbe_offsets),
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
            "max_abs_error_vs_dequantized_reference": errors, "bytes": memory,
            "bytes_ratio_to_fp32": {q: b / memory["fp32"] for q, b in memory.items()},
            "scale_bias_bytes_per_row": {"int8": 8, "int4": 4, "fbgemm_int8_tbe": 4}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few rounds, no JSON (a smoke run)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bag", type=int, default=1, help="mean ids per bag (1: Criteo's one id per feature)")
    parser.add_argument("--note", default="", help="how the machine was loaded, for the JSON")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (with --threads 1 on a loaded machine), not wall time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "isa": torch.ops.recompile_native.isa(), "note": args.note,
              "clock": "thread CPU time" if args.cpu_time else "wall"}
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
              f"{r['int8_speedup_vs_fbgemm_tbe']:.2f}x; max |error| vs dequantized reference "
              f"{r['max_abs_error_vs_dequantized_reference']}")
    memory = result["speed_bag1"]
    print("memory: " + ", ".join(f"{q} {b / 2**20:.1f} MiB ({memory['bytes_ratio_to_fp32'][q]:.3f} of fp32)"
                                 for q, b in memory["bytes"].items())
          + "; scale+bias per row: int8 8 B (fp32 pair), int4 4 B (fp16 pair), TBE 4 B (+ row alignment)")
    result["accuracy"] = accuracy(rows=4_000 if args.quick else 200_000, steps_per_epoch_rows=4_000 if args.quick
                                  else 200_000, epochs=1 if args.quick else 2, batch=512)
    for name, per in result["accuracy"].items():
        print(f"accuracy {name}: " + "; ".join(f"{q} AUC {m['AUC']:.4f} log-loss {m['log_loss']:.4f}"
                                               for q, m in per.items()))
    if not args.quick:
        write_json(OUT, result)
    return result


if __name__ == "__main__":
    main()
