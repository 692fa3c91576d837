"""recompile: the ``rec_ascend`` torch.compile backend for recommendation models.

The public names load on first use, so ``import recompile`` (and ``import recompile.distributed``) imports
neither Inductor, nor the passes, nor the TensorFlow importer.
"""
import importlib
import importlib.metadata
import os
import sys
import types

# The runtime (the custom ops and their kernels) is the design card's top-level folder runtime/ and installs as
# recompile.runtime (setup.py package_dir), as models/ installs as recompile.models. Run from a checkout (its root on
# sys.path, or a git worktree beside an editable install of another), the names resolve to the checkout's own
# folders: the checkout root joins this package's path.
_CHECKOUT_PACKAGES = ("runtime", "models")
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "runtime")) and os.path.isfile(
        os.path.join(_CHECKOUT, "runtime", "__init__.py")):
    __path__.append(_CHECKOUT)

# Public name -> the module that defines it.
_EXPORTS = {
    "PASS_ORDER": "recompile.pipeline",
    "PassContext": "recompile.pipeline",
    "RecompileOptions": "recompile.options",
    "compile_tf": "recompile.frontends.tensorflow",
    "explain": "recompile.explain",
    "export": "recompile.export",
    "package": "recompile.export",
    "quantize": "recompile.quantize",
    "rec_ascend": "recompile.backend",
    "register_pass": "recompile.pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name, or a submodule (``recompile.frontends.tensorflow`` after ``import recompile``)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # a submodule, of this folder or of the checkout's runtime/ and models/ (not its hkv/, tests/, setup.py)
    if name in _CHECKOUT_PACKAGES or any(os.path.exists(os.path.join(__path__[0], name + e)) for e in ("", ".py")):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing submodule recompile.explain must not hide the function recompile.explain.
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def _lazy_backend(gm, example_inputs, **kwargs):
    from recompile.backend import rec_ascend

    return rec_ascend(gm, example_inputs, **kwargs)


def _register_backend_name() -> None:
    """``backend="rec_ascend"``: an installed package registers the name by its entry point; a source checkout on
    ``sys.path`` registers it here, without importing the backend until a model compiles, but with the backend's
    tracing settings (its ``backend_ctx_ctor``, and the property through which Dynamo reads it: installed now,
    before any ``torch.compile`` reads it)."""
    if any(ep.name == "rec_ascend" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")):
        return
    import torch._dynamo

    from recompile.tracing import TracingCalls, forward_backend_context

    if "rec_ascend" not in torch._dynamo.list_backends(exclude_tags=()):
        _lazy_backend.backend_ctx_ctor = TracingCalls
        forward_backend_context()
        torch._dynamo.register_backend(_lazy_backend, "rec_ascend")


_register_backend_name()
