"""recompile: the ``rec_ascend`` torch.compile backend for recommendation models."""
from recompile.backend import rec_ascend
from recompile.explain import explain
from recompile.options import RecompileOptions
from recompile.pipeline import PASS_ORDER, PassContext, register_pass

__all__ = ["PASS_ORDER", "PassContext", "RecompileOptions", "explain", "rec_ascend", "register_pass"]
