"""Imported TensorFlow models: TensorFlow vs the imported graph eager, under Inductor and under rec_ascend.

``python -m models.bench_tf [--quick] [--batch N]`` builds the models of ``models/tf_models.py``
in a TensorFlow subprocess (which also times TensorFlow's own forward on the same inputs), imports
the frozen graphs, checks every variant against TensorFlow's outputs and prints ms and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np
import torch

import recompile
from recompile.frontends.tensorflow import import_graph

MODELS = ("wide_deep", "dlrm", "dcn", "transformer")


def time_ms(fn, args, iters: int) -> float:
    fn(*args), fn(*args)  # warm up
    return timeit.timeit(lambda: fn(*args), number=iters) / iters * 1e3


def build(out_dir: str, batch: int, iters: int, threads: int) -> dict:
    script = Path(__file__).with_name("tf_models.py")
    cmd = [sys.executable, str(script), out_dir, "--batch", str(batch), "--time-iters", str(iters)]
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"building the TensorFlow models failed:\n{proc.stderr[-3000:]}")
    return json.loads((Path(out_dir) / "models.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, few iterations")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both frameworks")
    args = parser.parse_args()
    batch = args.batch or (64 if args.quick else 1024)
    iters = 10 if args.quick else 50
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out, torch.no_grad():
        index = build(out, batch, iters, args.threads)
        print(f"forward ms, batch {batch}, {args.threads} thread(s) (ratios: TensorFlow's time / this one's)")
        print(f"{'model':12} {'tensorflow':>11} {'eager':>9} {'inductor':>9} {'rec_ascend':>11}")
        for name in MODELS:
            entry = index[name]
            arrays = np.load(Path(out) / f"{name}.npz")
            inputs = [torch.from_numpy(arrays[f"in:{i}"]) for i in range(len(entry["inputs"]))]
            expected = torch.from_numpy(arrays["out:0"])
            gm = import_graph(Path(out) / f"{name}.pb", entry["inputs"], entry["outputs"])
            variants = {
                "eager": gm,
                "inductor": torch.compile(gm, backend="inductor"),
                "rec_ascend": recompile.compile_tf(Path(out) / f"{name}.pb", entry["inputs"], entry["outputs"]),
            }
            times = {}
            for variant, fn in variants.items():
                torch.testing.assert_close(fn(*inputs), expected, rtol=1e-5, atol=1e-5)
                times[variant] = time_ms(fn, inputs, iters)
            tf_ms = entry["tf_ms"]
            cells = " ".join(f"{times[v]:6.3f} ({tf_ms / times[v]:4.2f}x)" for v in variants)
            print(f"{name:12} {tf_ms:11.3f} {cells}")


if __name__ == "__main__":
    main()
