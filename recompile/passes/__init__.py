"""The rec passes, one module each; importing a module registers its pass (see ``PASS_ORDER``)."""
from recompile.passes import jagged, normalize  # noqa: F401
from recompile.passes import embedding  # noqa: F401
