"""recompile: the ``rec_ascend`` torch.compile backend for recommendation models."""
from recompile.backend import rec_ascend, register_name
from recompile.explain import explain
from recompile.frontends.tensorflow import compile_tf
from recompile.options import RecompileOptions
from recompile.pipeline import PASS_ORDER, PassContext, register_pass

register_name()

__all__ = ["PASS_ORDER", "PassContext", "RecompileOptions", "compile_tf", "explain", "rec_ascend", "register_pass"]
