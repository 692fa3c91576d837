import os
import sys
import tempfile
import types

# No GPU here: Triton kernels run under the interpreter. Must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Autotune decisions start empty unless asked otherwise: a decision an earlier run cached hides what the first
# run does (docs/determinism.md). .ci/run also empties the other caches.
os.environ.setdefault("RECOMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="recompile-tests-"))
# Inductor compiles in this process: `make test` runs one pytest worker per core, so a pool of compile processes
# per worker (and per test that starts a fresh Python) only adds their start (~5 s of CPU each) on busy cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# RecBole (the corpus) imports torch.utils.tensorboard, whose file I/O layer imports all of TensorFlow (~4 s of CPU
# per worker) when it is installed; TensorBoard's own switch gives it its TF-free stub instead. The TensorFlow
# front end's tests run TensorFlow in a subprocess (tests/test_tf.py), which this does not touch.
sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))

import pytest  # noqa: E402
import torch  # noqa: E402

import recompile.passes  # noqa: E402,F401  (registers the passes)
from recompile import runtime  # noqa: E402,F401  (defines torch.ops.recompile.*)


@pytest.fixture
def quick_race(monkeypatch):
    """The autotune race on one or two timing rounds per candidate instead of ``BUDGET_S`` (0.6 s) per graph and
    size bucket, for tests that check numbers and compile counts, not which candidate is fastest: the race still
    runs (regions tuned, Inductor candidates picked and built, every candidate run in the sandbox and checked
    against the graph's output before it can be chosen), on fewer rounds. Use it with
    ``pytestmark = pytest.mark.usefixtures("quick_race")``."""
    from recompile import autotune

    monkeypatch.setattr(autotune, "BUDGET_S", 0.05)
    monkeypatch.setattr(autotune, "MIN_ROUNDS", 1)
    monkeypatch.setattr(autotune, "MAX_ROUNDS", 2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
