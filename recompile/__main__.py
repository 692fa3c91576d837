"""``python -m recompile``: the recompile command line."""
import sys

from recompile.cli import main

sys.exit(main())
