import os

# No GPU here: Triton kernels run under the interpreter. Must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import recompile  # noqa: E402,F401  (registers passes and ops)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
