"""Installing from source without a C++ compiler stops with advice, not a traceback. (The wheel itself is built,
installed into a fresh venv and run by ``make wheel-check``, which CI runs after the tests: .ci/wheel_check.py.)"""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_install_without_a_compiler_stops_with_a_clear_error(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++")}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "build_ext"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs a C++ compiler" in result.stderr and "no-such-c++" in result.stderr


def test_the_runtime_is_recompile_runtime_and_a_checkout_imports_its_own(tmp_path):
    """No top-level ``runtime`` (a name that shadows a user's package): the checkout's runtime/ is
    ``recompile.runtime``, as in the wheel, and models/ ``recompile.models``; run from this checkout (here from
    another directory), both are this checkout's folders whatever editable install the environment holds."""
    code = textwrap.dedent(
        """
        import pkgutil, sys
        import hkv, recompile, recompile.backend, recompile.cli, recompile.distributed, recompile.explain
        import recompile.export, recompile.frontends.tensorflow, recompile.passes, recompile.runtime
        import models.zoo, recompile.models.zoo
        for info in pkgutil.walk_packages(recompile.runtime.__path__, "recompile.runtime."):
            if not info.name.endswith("._C"):  # the operator library: torch.ops.load_library loads it
                __import__(info.name)
        assert not [m for m in sys.modules if m.split(".")[0] == "runtime"], "a top-level runtime was imported"
        assert recompile.runtime.__file__ == sys.argv[1] + "/runtime/__init__.py", recompile.runtime.__file__
        assert recompile.models.__file__ == sys.argv[1] + "/models/__init__.py", recompile.models.__file__
        assert not hasattr(recompile, "hkv") and not hasattr(recompile, "tests")  # the checkout's other folders
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code, ROOT], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
