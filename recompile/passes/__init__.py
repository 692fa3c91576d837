"""The rec passes, one module each. A module declares its pass with ``recompile.pipeline.register_pass``
(name, order, region kinds and their colours; its docstring is the doc); importing it here registers it."""
from recompile.passes import (  # noqa: F401
    dropout, dynamic_embedding, embedding, interaction, jagged, layout, normalize, recurrent, sampled_softmax,
)
