#!/usr/bin/env python3
"""CI's wheel check: the wheel a user builds works in a fresh virtual environment.

``pip wheel --no-build-isolation --no-deps`` on the working tree, every file it packs checked against the tree's
(tracked and new, not ignored: no earlier build's leftovers), then a new venv gets ``torch==2.13.0`` and
``pip install <wheel>`` with its declared dependencies, as a user's would. The wheel's build reuses the object files
of the checkout's last native build (build/native, setup.py: ninja compiles what changed since; after ``make venv``,
nothing) and packs the freshly linked libraries from a new build folder. Run
from outside the checkout with no C++ compiler on PATH, ``import hkv`` and ``import recompile.distributed`` build
nothing, and the zoo's DLRM compiles with rec_ascend, every pass on, its native kernels chosen, no fallback, with
eager's numbers. ``make wheel-check`` runs it; ``.ci/run`` calls that after the tests.
"""
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:  # recompile.runtime is runtime/, as setup.py installs it
    FOLDERS = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

CHILD = r"""
import os, sys
target = sys.argv[1]
import hkv, recompile.distributed, recompile.runtime.native
for module in (hkv, recompile.distributed, recompile.runtime):
    assert module.__file__.startswith(target), module.__file__
import importlib.util
for name in ("models", "runtime"):
    assert importlib.util.find_spec(name) is None, f"the wheel installs a top-level {name!r} package"
assert hkv.cpu.available() and recompile.runtime.native.isa() in ("generic", "avx2", "avx512")
if sys.argv[2] == "imports":
    sys.exit(0)
import torch, recompile
from recompile.models.zoo import MODELS
torch.manual_seed(0)
work = MODELS["dlrm"]("small")
report = recompile.explain(work.model, *work.inputs).to_dict()
assert not report["fallbacks"], report["fallbacks"]
kernels = {r["op"]: (r["kernel_kind"], r["kernel"]) for r in report["regions"]}
native = {op for op, (kind, _) in kernels.items() if kind == "cpu_kernel"}
want = {"recompile::grouped_embedding_bag", "recompile::dot_interaction"}
assert want <= native, kernels
model = work.model.eval()  # no dropout: rec_ascend's counter-based masks are not eager's draws
compiled = torch.compile(model, backend="rec_ascend")
with torch.no_grad():
    torch.manual_seed(1)
    want = model(*work.inputs)
    torch.manual_seed(1)
    got = compiled(*work.inputs)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("compiled", sorted(native))
"""


def _run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        sys.exit(f"wheel check: {cmd[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _tree() -> set:
    """The working tree's files (tracked and new, not ignored)."""
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    return {name for name in files.split("\0") if name and os.path.isfile(os.path.join(ROOT, name))}


def _source(name: str) -> str:
    """The checkout path of the wheel's file ``name`` (``FOLDERS``: recompile/runtime/x is runtime/x)."""
    for package, folder in FOLDERS.items():
        prefix = package.replace(".", "/") + "/"
        if name.startswith(prefix):
            return f"{folder}/{name[len(prefix):]}"
    return name


def main(work: str) -> None:
    start = time.monotonic()
    dist, venv = os.path.join(work, "dist"), os.path.join(work, "venv")
    # A new build folder (build_lib, bdist_dir) through distutils' extra config file; the objects stay in build/native.
    config = os.path.join(work, "build.cfg")
    with open(config, "w") as f:
        f.write(f"[build]\nbuild_base = {os.path.join(work, 'build')}\n")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist, ROOT],
         cwd=work, env={**os.environ, "MAX_JOBS": str(os.cpu_count() or 1), "DIST_EXTRA_CONFIG": config})
    [wheel] = [os.path.join(dist, n) for n in os.listdir(dist) if n.startswith("recompile-") and n.endswith(".whl")]
    names = zipfile.ZipFile(wheel).namelist()
    tree, libraries = _tree(), ("recompile/runtime/_C", "hkv/_C")
    stray = [n for n in names if ".dist-info/" not in n and _source(n) not in tree
             and not (n.startswith(libraries) and n.endswith(".so"))]
    assert not stray, f"the wheel packs files that are not the tree's: {stray[:10]}"
    for needed in ("recompile/runtime/csrc/ops.cpp", "recompile/runtime/csrc/embedding.h", "hkv/csrc/probe.h"):
        assert needed in names, f"the wheel lacks {needed}"
    assert not any(n.startswith(("runtime/", "models/")) for n in names), "the wheel installs a top-level package"
    for lib in libraries:
        assert any(n.startswith(lib) and n.endswith(".so") for n in names), f"the wheel lacks {lib}*.so"
    _run([sys.executable, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    # torch first and pinned: the wheel's dependencies then resolve against it (no other torch is pulled).
    _run([python, "-m", "pip", "install", "-q", TORCH])
    _run([python, "-m", "pip", "install", "-q", wheel])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC", "CXX", "VIRTUAL_ENV")}
    script = os.path.join(work, "child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    # No compiler on PATH: importing the packages builds nothing.
    _run([python, script, site, "imports"], cwd=work, env={**env, "PATH": os.path.join(venv, "bin")})
    out = _run([python, script, site, "compile"], cwd=work, env=env)
    print(f"wheel check: {os.path.basename(wheel)} installed in a fresh venv, {out.stdout.strip()} "
          f"({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="recompile-wheel-") as work:
        main(work)
