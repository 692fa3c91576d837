import os
import tempfile

# No GPU here: Triton kernels run under the interpreter. Must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Autotune decisions start empty unless asked otherwise: a decision an earlier run cached hides what the first
# run does (docs/determinism.md). .ci/run also empties the other caches.
os.environ.setdefault("RECOMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="recompile-tests-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import recompile.passes  # noqa: E402,F401  (registers the passes)
from recompile import runtime  # noqa: E402,F401  (defines torch.ops.recompile.*)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
