"""``python -m recompile.launch [torchrun options] script.py | -m module [args]``: torch's own launcher.

This is ``torch.distributed.run`` (torchrun) with one default added: without rendezvous options, a
single-node job uses ``--standalone`` (a local rendezvous on a free port). Every worker then calls
``recompile.distributed.init_distributed()``, which reads the environment torchrun sets.

``relaunch(nproc, module, args)`` is how a script's ``--nproc N`` option starts itself on N processes;
``spawn(fn, nproc, *args)`` runs a function on N local processes (gloo on 127.0.0.1) and returns what each
rank returned or raised, with a time limit: what tests and benchmarks use.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

RENDEZVOUS_OPTIONS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
                      "--nnodes")


def torchrun_args(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if not any(a.split("=")[0] in RENDEZVOUS_OPTIONS for a in argv):
        argv.insert(0, "--standalone")
    return argv


def relaunch(nproc: int, module: str, args: Sequence[str], nproc_option: str = "--nproc") -> None:
    """Run ``python -m module *args`` on ``nproc`` local processes under torchrun; returns when all have exited
    and raises ``ChildFailedError`` (naming the failed rank and its error) if any failed. The script's own
    ``nproc_option`` is left out of ``args``: the workers know their world from torchrun's environment (and
    torchrun's parser would take ``--nproc`` for an abbreviation of its ``--nproc-per-node``)."""
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args([f"--nproc-per-node={nproc}", "-m", module, *without_option(args, nproc_option)]))


def without_option(args: Sequence[str], option: str) -> list[str]:
    """``args`` less ``option VALUE`` and ``option=VALUE``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


@dataclass
class RankOutcome:
    value: Any = None
    error: str | None = None  # "ExceptionType: message" when the rank raised
    trace: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, out_dir, collective_timeout_s):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        outcome = RankOutcome(value=fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the caller, which decides what it means
        outcome = RankOutcome(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn(fn: Callable, nproc: int, *args, timeout_s: float = 300.0, collective_timeout_s: float = 60.0,
          preload: Sequence[str] = ()) -> tuple[list[RankOutcome | None], list[int]]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local processes with a gloo group on 127.0.0.1.

    Returns each rank's outcome (None for a rank that exited without one) and the ranks still running
    after ``timeout_s``, which are killed. A fork server that has imported ``preload`` (and recompile)
    once forks the ranks, so they do not pay for the imports again.
    """
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["recompile.distributed", *preload])
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, fn, args, out_dir, collective_timeout_s))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(nproc)]
        return [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths], hung


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
