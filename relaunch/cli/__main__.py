"""`python -m relaunch.cli`: what the `relaunch` command runs."""

from . import entry

entry()
