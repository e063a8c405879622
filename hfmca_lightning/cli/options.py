"""Value types of the commands' options (argparse ``type=``): a value out of its range is the command's one-line usage
error before any work, not an error from inside torch or Lightning after it."""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "SEED_RANGE",
    "OneLineParser",
    "device_name",
    "finite_positive_float",
    "non_negative_int",
    "positive_int",
    "seed",
]

SEED_RANGE = (0, 2**32 - 1)  # numpy's, which Lightning's seed_everything enforces


class OneLineParser(argparse.ArgumentParser):
    """The commands' parser (and their sub-commands'): a mistake on the command line is one line, ``hfmca: error:
    <command>: <problem> (see hfmca <command> --help)``, exit status 2, as ``hfmca fit``'s are, not the usage text."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("hfmca").strip()
        raise ConfigurationError(f"{command + ': ' if command else ''}{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but an option the chosen sub-command does not take is that sub-command's error, with the
        closest option it takes (argparse reports it from the top parser, with no hint)."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser: argparse.ArgumentParser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None):
                    parser = action.choices[getattr(parsed, action.dest)]
            options = [option for action in parser._actions for option in action.option_strings]
            taken = [option[2:] for option in options if option.startswith("--")]
            given = unknown[0].split("=")[0]
            close = difflib.get_close_matches(given.lstrip("-"), taken, n=1) if given.startswith("--") else []
            hint = f"; did you mean --{close[0]}?" if close else ""
            parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None


def positive_int(value: str) -> int:
    """An integer >= 1."""
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {number}")
    return number


def non_negative_int(value: str) -> int:
    """An integer >= 0 (an index or a class)."""
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {number}")
    return number


def seed(value: str) -> int:
    """A random seed in ``[0, 2**32 - 1]``."""
    number = _integer(value)
    if not SEED_RANGE[0] <= number <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1]; got {number}")
    return number


def finite_positive_float(value: str) -> float:
    """A finite number > 0 (a learning rate, a temperature)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {value}")
    return number


def device_name(value: str) -> str:
    """A device this machine has: ``cpu``, ``cuda`` or ``cuda:<index>`` with a CUDA GPU, ``mps`` on Apple GPUs."""
    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; give cpu, cuda, cuda:<index> or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value}: this machine has no CUDA GPU that torch can use; give cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{value}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{value}: this machine has no Apple GPU that torch can use; give cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{value}: the commands run on cpu, cuda or mps")
    return value
