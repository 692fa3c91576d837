"""The wheel a user builds works on its own: ``pip wheel --no-build-isolation --no-deps .`` carries the native
sources and the built operator libraries; installed into a fresh directory (``pip install --target``, the
project's torch reused through the interpreter) and run from outside the checkout, ``import hkv`` and
``import recompile.distributed`` need no compiler, and the zoo's DLRM compiles with rec_ascend, every pass on, its
native kernels chosen and no fallback, with eager's numbers."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

CHILD = r"""
import os, sys
target = sys.argv[1]
import hkv, recompile.distributed, runtime.native
for module in (hkv, recompile.distributed, runtime):
    assert module.__file__.startswith(target), module.__file__
assert hkv.cpu.available() and runtime.native.isa() in ("generic", "avx2", "avx512")
if sys.argv[2] == "imports":
    sys.exit(0)
import torch, recompile
from models.zoo import MODELS
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
    assert result.returncode == 0, f"{cmd[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _checkout(dest) -> str:
    """The working tree's files (tracked and new, not ignored) in ``dest``: a build that no earlier build's
    leftovers (build/, in-place libraries) can reach."""
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for name in filter(None, files.split("\0")):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(dest, name)) or dest, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    return str(dest)


@pytest.mark.timeout(900)  # a cold C++ build and Inductor compile: about 2 minutes on 2 idle cores
def test_wheel_installs_and_compiles_a_zoo_model(tmp_path):
    dist, target = tmp_path / "dist", tmp_path / "site"
    source = _checkout(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(dist), source],
         cwd=tmp_path, env={**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)})
    [wheel] = dist.glob("recompile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("runtime/csrc/ops.cpp", "runtime/csrc/embedding.h", "hkv/csrc/probe.h"):
        assert needed in names
    assert any(n.startswith("runtime/_C") and n.endswith(".so") for n in names)
    assert any(n.startswith("hkv/_C") and n.endswith(".so") for n in names)
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC", "CXX")}
    env["PYTHONPATH"] = str(target)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # No compiler on PATH: importing the packages builds nothing.
    _run([sys.executable, str(script), str(target), "imports"], cwd=tmp_path, env={**env, "PATH": str(tmp_path)})
    out = _run([sys.executable, str(script), str(target), "compile"], cwd=tmp_path, env=env)
    assert "compiled" in out.stdout


def test_install_without_a_compiler_stops_with_a_clear_error(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++")}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "build_ext"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs a C++ compiler" in result.stderr and "no-such-c++" in result.stderr
