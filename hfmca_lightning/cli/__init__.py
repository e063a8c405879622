"""The ``hfmca`` command: ``fit`` / ``validate`` / ``test`` (LightningCLI), ``analyze`` / ``compare``, ``linear`` /
``knn``, ``export`` and ``dashboard``; :func:`main` is the console script (:mod:`hfmca_lightning.cli.console`).

This module imports nothing heavy: the console script installs its Ctrl-C handling before torch and Lightning load,
so a Ctrl-C during start-up also ends with one line and exit status 130."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["main"]


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C while the command imports what it needs: the line, then the process ends at once. Nothing is written
    yet, and an exception raised into an import can be swallowed by code it interrupts (a finaliser), leaving a
    half-imported module that fails later with a traceback (matplotlib's, seen)."""
    print("hfmca: interrupted.", file=sys.stderr, flush=True)
    os._exit(130)


def main(args: list[str] | None = None) -> None:
    """Run the ``hfmca`` command (``args``: its arguments; default the command line)."""
    if args is None:  # the console script: until the command runs, Ctrl-C ends it at once
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    from hfmca_lightning.cli.console import main as run

    run(args)
