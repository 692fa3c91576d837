"""Jagged vs padded, measured side by side: ``python -m models.bench_jagged [--quick]``.

1. An HSTU layer (models/layers_jagged.py) over 64 long-tailed histories padded to 256: forward
   time and peak memory, and a training step (forward + backward), for the padded layer in eager,
   under ``backend="inductor"``, and under ``backend="rec_ascend"`` (whose jagged pass runs it on the
   jagged values), with rec_ascend's output checked against eager.
2. HSTU attention alone, jagged (``recompile.hstu_attention``: the native C kernel and the
   length-bucketed ATen kernel) against the padded formulation (pad, dense attention over
   [B, H, N, N], unpad), as the longest history grows to 4096; forward, and forward + backward.
3. With ``--main-job``: the main job's HSTU training step (near-full ML-100k histories), eager vs
   Inductor vs the rewrite.
4. With ``--padded`` (alone): ``recompile.padded_softmax_attention`` at RecBole's SASRec sizes in the corpus
   ([B, 2, 12, 8], causal mask over long-tailed histories, read rows), its kernels side by side, forward and
   backward, one thread's CPU time.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import itertools
import os
import threading
import time

import torch

from .layers_jagged import HSTULayer, jagged_batch, long_tailed_lengths
from .timing import autorange, race_ms
from recompile.runtime.jagged_attention import HSTUBucket, HSTUArgs
from recompile.runtime.jagged import jagged_to_padded_dense_reference, dense_to_jagged_reference


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# glibc: tensors over 64 KB mmapped at a fixed threshold (no dynamic raise), freed memory trimmed, so
# that the resident set follows the live tensors.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def track_resident_memory() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 16)


def best_ms(fn, repeats: int) -> float:
    """Best CPU time of ``fn`` in ms (process time: steadier than wall time on a shared machine)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def peak_bytes(fn) -> int:
    """Peak resident memory above the level before ``fn``, sampled by a thread while ``fn`` runs.

    (Large tensors are mmapped and returned to the system when freed, so the resident set follows
    the live tensors; the profiler's per-op figures miss what compiled regions allocate inside.)
    """
    gc.collect()
    base, peak, done = _resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0] - base, 0)


def layer_benchmark(repeats: int, batch: int, max_len: int) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = HSTULayer(dim=128, heads=4, head_dim=32, max_seq_len=max_len)
    values, lengths = jagged_batch(batch, max_len, 128, gen)
    print(f"HSTU layer: {batch} histories padded to {max_len}, {values.shape[0]} items "
          f"({values.shape[0] / (batch * max_len):.0%} of the padded batch)")
    variants = {
        "eager": model,
        "inductor": torch.compile(model, backend="inductor"),
        "rec_ascend": torch.compile(model, backend="rec_ascend"),
    }
    with torch.no_grad():
        want = model(values, lengths)
        for name in ("inductor", "rec_ascend"):
            got = variants[name](values, lengths)
            err = ((got - want).norm() / want.norm()).item()
            print(f"  {name:10s} relative error vs eager {err:.2e}")
    leaf = values.clone().requires_grad_()

    def train_step(fn):
        model.zero_grad()
        fn(leaf, lengths).pow(2).mean().backward()

    rows = []
    for name, fn in variants.items():
        with torch.no_grad():
            fwd = best_ms(lambda: fn(values, lengths), repeats)
            mem = peak_bytes(lambda: fn(values, lengths))
        train = best_ms(lambda: train_step(fn), repeats)
        rows.append((name, fwd, mem, train))
    eager = rows[0]
    print(f"  {'':10s} {'forward ms':>11s} {'x eager':>8s} {'peak MB':>8s} {'/ eager':>8s} {'train ms':>9s} {'x eager':>8s}")
    for name, fwd, mem, train in rows:
        print(f"  {name:10s} {fwd:11.2f} {eager[1] / fwd:8.2f} {mem / 2**20:8.1f} {mem / eager[2]:8.2f} "
              f"{train:9.2f} {eager[3] / train:8.2f}")
    rec, ind = rows[2], rows[1]
    print(f"  rec_ascend vs inductor: forward {ind[1] / rec[1]:.2f}x, training step {ind[3] / rec[3]:.2f}x")


def padded_hstu(q, k, v, offsets, lengths, n, rel_bias, args: HSTUArgs):
    """The padded formulation: every sequence padded to n, dense attention, gathered back."""
    padded = [jagged_to_padded_dense_reference(t.flatten(1), offsets, n).unflatten(2, t.shape[1:]) for t in (q, k, v)]
    out = HSTUBucket(*padded, lengths, None, None).forward(args, rel_bias, None)
    return dense_to_jagged_reference(out.flatten(2), offsets, q.shape[0]).unflatten(1, v.shape[1:])


ATTENTION_KERNELS = ("native", "cpu")  # recompile.hstu_attention's CPU kernels


def attention_scaling(repeats: int, max_lens: list[int], batch: int) -> None:
    heads, dim = 1, 32
    print(f"HSTU attention alone: {batch} long-tailed sequences, {heads} heads x {dim}, relative position bias; "
          f"jagged vs padded, forward (fwd) and forward + backward (train)")
    print(f"  {'max len':>7s} {'items':>6s} {'padded fwd':>10s} " + " ".join(f"{k + ' fwd':>10s}" for k in ATTENTION_KERNELS)
          + f" {'padded train':>12s} " + " ".join(f"{k + ' train':>12s}" for k in ATTENTION_KERNELS)
          + f" {'native vs padded':>16s} {'padded MB':>10s} {'native MB':>10s}")
    gen = torch.Generator().manual_seed(1)
    for n in max_lens:
        lengths = long_tailed_lengths(batch, n, gen)
        offsets = torch.ops.recompile.complete_cumsum(lengths, "cpu")
        total = int(lengths.sum())
        q, k, v = (torch.randn(total, heads, dim, generator=gen).requires_grad_() for _ in range(3))
        rel = (torch.randn(2 * n - 1, generator=gen) * 0.02).requires_grad_()
        args = HSTUArgs(n, 1.0 / dim**0.5, True, 0)
        runs = {"padded": lambda: padded_hstu(q, k, v, offsets, lengths, n, rel, args)}
        for kernel in ATTENTION_KERNELS:
            runs[kernel] = functools.partial(torch.ops.recompile.hstu_attention, q, k, v, offsets, n, args.alpha, True,
                                             None, 0, rel, None, None, kernel)
        with torch.no_grad():
            want = runs["padded"]()
            for run in list(runs.values())[1:]:
                torch.testing.assert_close(run(), want, rtol=1e-4, atol=1e-5)
            fwd = {name: best_ms(run, repeats) for name, run in runs.items()}
            mem = {name: peak_bytes(runs[name]) for name in ("padded", "native")}
        train = {name: best_ms(lambda: run().sum().backward(), repeats) for name, run in runs.items()}
        print(f"  {n:7d} {total:6d} {fwd['padded']:10.2f} " + " ".join(f"{fwd[k]:10.2f}" for k in ATTENTION_KERNELS)
              + f" {train['padded']:12.2f} " + " ".join(f"{train[k]:12.2f}" for k in ATTENTION_KERNELS)
              + f" {fwd['padded'] / fwd['native']:7.1f}x/{train['padded'] / train['native']:5.1f}x"
              + f" {mem['padded'] / 2**20:10.1f} {mem['native'] / 2**20:10.1f}")


def main_job_step(repeats: int, steps: int = 10) -> None:
    """The main job's HSTU training step (``models.main``: ML-100k, last 100 items, batch 32, dim 64, two
    layers, 256 sampled negatives, Adam) on the same batches: eager, Inductor, and rec_ascend's rewrite
    through Inductor (autotune off: the rewrite itself is timed, not the autotuner's choice)."""
    from . import data as D
    from .sequential import NextItemTask
    from .train import mark_sequence_dynamic, optimizer_step
    from .zoo import sequential_encoder
    from recompile.backend import rec_ascend

    split = D.leave_one_out(D.load_ratings())
    windows = D.training_windows(split.train, 100)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for rows in itertools.islice(D.batches(len(windows), 32, gen), steps):
        inputs, targets = D.next_item_batch(windows, rows, "jagged", 100)
        batches.append((targets, D.sample_negatives(targets.flatten(), 0, split.num_items, 256, gen), *inputs))
    backends = {"eager": None, "inductor": "inductor",
                "rec_ascend": functools.partial(rec_ascend, options={"autotune": False})}
    times = {}
    for name, backend in backends.items():
        torch.manual_seed(0)
        task = NextItemTask(sequential_encoder("hstu", split.num_items, max_len=100), temperature=0.05).train()
        step = task if backend is None else torch.compile(task, backend=backend)
        optimizer = torch.optim.Adam(task.parameters(), lr=3e-3)

        def epoch(step=step, optimizer=optimizer):
            for batch in batches:
                optimizer_step(optimizer, lambda: step(*mark_sequence_dynamic(batch)))

        times[name] = best_ms(epoch, repeats) / len(batches)
    print(f"Main job HSTU training step ({len(batches)} ML-100k batches of 32 histories of up to 100 items), ms: "
          + ", ".join(f"{name} {ms:.1f}" for name, ms in times.items())
          + f"; rec_ascend {times['eager'] / times['rec_ascend']:.2f}x eager, "
          f"{times['inductor'] / times['rec_ascend']:.2f}x inductor")


def padded_attention_kernels(rounds: int, batches=(128, 2048), heads: int = 2, n: int = 12, dim: int = 8) -> None:
    """Section 4: each kernel's forward and backward in us per call, interleaved rounds, best of ``rounds``."""
    print("\npadded_softmax_attention, [B, %d, %d, %d], causal, read rows: us per call (forward / backward)" % (heads, n, dim))
    op, backward = torch.ops.recompile.padded_softmax_attention, torch.ops.recompile.padded_softmax_attention_backward
    for b in batches:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, n, heads * dim).view(b, n, heads, dim).transpose(1, 2) for _ in range(3))
        lengths = torch.randint(1, n + 1, (b,))
        keep = (torch.arange(n) < lengths.view(-1, 1)).view(b, 1, 1, n) & torch.ones(n, n, dtype=torch.bool).tril()
        mask, rows, grad = torch.where(keep, 0.0, -10000.0), lengths - 1, torch.randn(b, heads, n, dim)
        steps = {}
        for impl in ("native", "cpu", "reference"):
            steps[f"{impl} fwd"] = functools.partial(op, q, k, v, mask, dim ** -0.5, impl, rows)
            steps[f"{impl} bwd"] = functools.partial(backward, grad, q, k, v, mask, dim ** -0.5, impl, rows)
        iters = autorange(steps, clock=time.thread_time)
        ms = race_ms(steps, rounds, iters, clock=time.thread_time)
        print(f"B={b}: " + ", ".join(f"{impl} {ms[impl + ' fwd'] * 1e3:.0f} / {ms[impl + ' bwd'] * 1e3:.0f}"
                                     for impl in ("native", "cpu", "reference")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, attention up to 1024 only")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: CPU time per op)")
    parser.add_argument("--main-job", action="store_true", help="also the main job's HSTU training step (ML-100k)")
    parser.add_argument("--padded", action="store_true", help="only the padded softmax attention's kernels")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.padded:
        return padded_attention_kernels(3 if opts.quick else 7)
    track_resident_memory()
    repeats = 2 if opts.quick else 5
    print(f"CPU, {opts.threads} thread(s); times: best process CPU time of {repeats} runs; "
          f"memory: peak resident set above the level before the call")
    layer_benchmark(repeats, batch=64, max_len=256)
    attention_scaling(repeats, [256, 512, 1024] if opts.quick else [256, 512, 1024, 2048, 4096], batch=8)
    if opts.main_job:
        main_job_step(repeats)


if __name__ == "__main__":
    main()
