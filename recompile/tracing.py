"""The Dynamo settings rec_ascend traces under, held by its ``backend_ctx_ctor`` (``TracingConfig``).

Dynamo enters a backend's context around every call of a compiled model, not only while it traces, so the
context is on the hot path of every call: ``TracingConfig`` sets the settings' context variables and resets them
with their tokens (about 1 us a call), where ``torch._dynamo.config.patch`` (a class built and six attributes set
per call) cost 15-30 us, a tenth of a small model's call. This module is light (no Inductor, no pass): the
backend's name registers it from a source checkout (``recompile/__init__.py``) without loading the backend.
"""
from __future__ import annotations

import functools
from typing import Any

import torch._dynamo

# The settings, and why (``recompile.report.BREAK_REMEDIES`` names them to users whose graph breaks anyway).
TRACING_CONFIG = {
    # offsets -> (row, position): repeat_interleave, nonzero, masked_select, boolean-mask indexing
    "capture_dynamic_output_shape_ops": True,
    # a max length or a total read with .item() / int(tensor)
    "capture_scalar_outputs": True,
    # TorchRec's modules are traced, not skipped, so that their lookups reach the embedding pass
    "skip_torchrec": False,
}


@functools.cache
def _variables() -> tuple:
    """The context variables of ``torch._dynamo.config``: each setting's (what ``config.<name> = value`` sets)
    with its value, the flag that marks the config's hash stale, and the names its cached copy must re-read."""
    config = torch._dynamo.config
    overrides = tuple((config._config[name].user_override, value) for name, value in TRACING_CONFIG.items())
    return overrides, config._hash_dirty_var, config._get_dict_dirty_keys_var


def _changed() -> None:
    """What ``torch._dynamo.config.__setattr__`` does after a set: its hash and its cached copy are stale."""
    _, hash_dirty, dict_dirty = _variables()
    hash_dirty.set(True)
    dirty = dict_dirty.get()
    if dirty is not None:
        dirty.update(TRACING_CONFIG)


class TracingConfig:
    """Dynamo's config with ``TRACING_CONFIG`` while entered (rec_ascend's ``backend_ctx_ctor``); nests."""

    __slots__ = ("_tokens",)

    def __enter__(self) -> None:
        self._tokens = [var.set(value) for var, value in _variables()[0]]
        _changed()

    def __exit__(self, *exc: Any) -> None:
        for (var, _), token in zip(_variables()[0], self._tokens):
            var.reset(token)
        _changed()


def _backend_ctx_ctor(self):
    """The ``backend_ctx_ctor`` of the backend a ``WrapBackendDebug`` wraps, looking through the wrapper
    ``torch.compile`` puts around a backend given by name or with options (which drops the attribute)."""
    backend = self._torchdynamo_orig_backend
    if isinstance(backend, torch._TorchCompileWrapper):
        backend = backend.compiler_fn
    ctor = getattr(backend, "backend_ctx_ctor", None)
    if ctor is None:
        raise AttributeError("backend_ctx_ctor")
    return ctor


def forward_backend_context() -> None:
    """Make ``torch.compile(model, backend=...)`` honour the backend's ``backend_ctx_ctor``, as
    ``torch._dynamo.optimize(backend)`` does: Dynamo reads the attribute on the debug wrapper of
    ``torch.compile``'s own wrapper, where it is absent. Backends without the attribute are unaffected. Installed
    when the name is registered (before Dynamo reads it), whichever way it is."""
    from torch._dynamo.repro.after_dynamo import WrapBackendDebug

    if not hasattr(WrapBackendDebug, "backend_ctx_ctor"):
        WrapBackendDebug.backend_ctx_ctor = property(_backend_ctx_ctor)
