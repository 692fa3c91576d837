"""The rec passes, one module each; importing a module registers its pass (see ``PASS_ORDER``)."""
from recompile.passes import dynamic_embedding, jagged, normalize  # noqa: F401
