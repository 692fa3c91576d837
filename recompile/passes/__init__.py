"""The rec passes, one module each; importing a module registers its pass (see ``PASS_ORDER``)."""
from recompile.passes import dropout, dynamic_embedding, embedding, interaction, jagged, normalize  # noqa: F401
