"""``python -m thunder_tp.generate``: the generation CLI."""

import sys

from thunder_tp.generate import cli

sys.exit(cli())
