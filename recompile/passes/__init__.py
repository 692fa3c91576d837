"""The rec passes, one module each; importing a module registers its pass (see ``PASS_ORDER``)."""
from recompile.passes import (  # noqa: F401
    dropout, dynamic_embedding, embedding, interaction, jagged, normalize, sampled_softmax,
)
