"""How much the ``hfmca`` command says: Lightning's lines for ``fit`` (the command that trains), never its
advertisements, and progress for long stages (``-q``: warnings, errors and results only; ``-v``: Lightning's lines
in every command)."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

__all__ = ["DEFAULT", "QUIET", "VERBOSE", "configure", "draws_bars", "progress", "quiet", "stage", "warn"]

QUIET, DEFAULT, VERBOSE = "quiet", "default", "verbose"
# lightly's benchmarking module (the online linear probe) imports the standalone packages too, whose import sets
# their loggers to INFO and points Lightning's rank-zero messages at theirs: their rank_zero loggers get the level.
_LIGHTNING = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
_ADVERTISEMENTS = ("litlogger", "LitLogger", "litmodels")
_level = DEFAULT

T = TypeVar("T")


class _NoSignalEcho(logging.Filter):
    """Lightning's ``[rank: 0] Received SIGTERM: 15``: the command says it in its own line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Received SIGTERM" not in record.getMessage()


_NO_SIGNAL_ECHO = _NoSignalEcho()


class _NoAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(word in message for word in _ADVERTISEMENTS)


def configure(level: str = DEFAULT, trains: bool = True) -> None:
    """Lightning's INFO lines (trainer banners such as ``GPU available``) shown for the commands that train (``trains``)
    or with ``VERBOSE``, hidden otherwise; its advertisements never. ``QUIET`` silences W&B's lines too
    (``WANDB_SILENT``, unless set)."""
    global _level
    _level = level
    if level == QUIET:
        os.environ.setdefault("WANDB_SILENT", "true")
    show = level == VERBOSE or (level == DEFAULT and trains)
    for name in _LIGHTNING:
        for logger in (logging.getLogger(f"{name}.utilities.rank_zero"), logging.getLogger(name)):
            logger.setLevel(logging.INFO if show else logging.WARNING)
            if not any(isinstance(existing, _NoAdvertisements) for existing in logger.filters):
                logger.addFilter(_NoAdvertisements())
    signals = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # its SLURM lines stay
    (signals.removeFilter if level == VERBOSE else signals.addFilter)(_NO_SIGNAL_ECHO)  # added once at most
    # newer torch deprecates the LeafSpec that Lightning's batch flattening makes (a warning per process)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def quiet() -> bool:
    return _level == QUIET


def draws_bars(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that can draw a bar: one of some width (tqdm draws nothing on a terminal of
    zero columns, as a pseudo-terminal that was never sized reports; in a file or a pipe its redraws pile up)."""
    if "ipykernel" in sys.modules:  # a notebook: tqdm draws its widget
        return True
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        return False


def _interactive() -> bool:
    """Whether this command's own progress (on standard error) is drawn as bars."""
    return not quiet() and draws_bars(sys.stderr)


def warn(message: str) -> None:
    """``hfmca: warning: <message>`` on stderr, at every verbosity (``-q`` keeps warnings)."""
    print(f"hfmca: warning: {message}", file=sys.stderr)


def stage(description: str) -> None:
    """One line on standard error saying what the command does now (nothing with ``-q``)."""
    if not quiet():
        print(f"hfmca: {description}", file=sys.stderr, flush=True)


def progress(items: Iterable[T], description: str, total: int | None = None, unit: str = "batch") -> Iterator[T]:
    """``items``, with a progress bar on a terminal (tqdm, as Lightning's), else one line when the stage starts and
    one when it ends (with its duration); nothing with ``-q``. Closes ``items`` (a generator: its loader's workers
    stop) when the iteration ends or is abandoned."""
    start = time.perf_counter()
    bar = None
    if _interactive():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"hfmca: {description}", unit=unit, leave=False, file=sys.stderr)
    else:
        stage(f"{description} ...")
    count = 0
    try:
        for item in items:
            yield item
            count += 1
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        close = getattr(items, "close", None)
        if close is not None:
            close()
    if bar is None:
        stage(
            f"{description}: {count} {unit}{'es' if unit.endswith('h') and count != 1 else ''} in "
            f"{time.perf_counter() - start:.1f} s"
        )
