"""recompile: the ``rec_ascend`` torch.compile backend for recommendation models."""
from recompile.backend import rec_ascend, register_name
from recompile.explain import explain
from recompile.export import export, package  # recompile.export: the function (its module's
# other names: from recompile.export import load)
from recompile.frontends.tensorflow import compile_tf
from recompile.options import RecompileOptions
from recompile.pipeline import PASS_ORDER, PassContext, register_pass

register_name()

__all__ = ["PASS_ORDER", "PassContext", "RecompileOptions", "compile_tf", "explain", "export", "package", "rec_ascend",
           "register_pass"]
