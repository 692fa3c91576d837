"""Installing from source without a C++ compiler stops with advice, not a traceback. (The wheel itself is built,
installed into a fresh venv and run by ``make wheel-check``, which CI runs after the tests: .ci/wheel_check.py.)"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_install_without_a_compiler_stops_with_a_clear_error(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++")}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "build_ext"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs a C++ compiler" in result.stderr and "no-such-c++" in result.stderr
