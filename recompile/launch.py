"""``python -m recompile.launch [torchrun options] script.py | -m module [args]``: torch's own launcher.

This is ``torch.distributed.run`` (torchrun) with one default added: without rendezvous options, a
single-node job uses ``--standalone`` (a local rendezvous on a free port). Every worker then calls
``recompile.distributed.init_distributed()``, which reads the environment torchrun sets.

``relaunch(nproc, module, args)`` is how a script's ``--nproc N`` option starts itself on N processes.
"""
from __future__ import annotations

import sys
from typing import Sequence

RENDEZVOUS_OPTIONS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
                      "--nnodes")


def torchrun_args(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if not any(a.split("=")[0] in RENDEZVOUS_OPTIONS for a in argv):
        argv.insert(0, "--standalone")
    return argv


def relaunch(nproc: int, module: str, args: Sequence[str]) -> None:
    """Run ``python -m module *args`` on ``nproc`` local processes under torchrun; returns when all have exited
    and raises ``ChildFailedError`` (naming the failed rank and its error) if any failed."""
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args([f"--nproc-per-node={nproc}", "-m", module, *args]))


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
