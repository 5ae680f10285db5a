"""The command line: parse, call one library function, print. Errors become exit codes here.

Progress goes to stderr; results for scripts (`--json`) to stdout. A bug shows one line and
leaves the full trace in the debug log.
"""

from . import recipes, rehearsal, running, sandbox  # noqa: F401  (each registers its commands on `cli`)
from .common import cli
from .main import entry, main

__all__ = ["cli", "entry", "main"]
