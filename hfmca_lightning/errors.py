"""Errors that mean "your configuration or data is wrong", raised before training starts.

The ``hfmca`` command prints them as one line (``hfmca: error: ...``, exit status 2) instead of a traceback.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection

__all__ = ["ConfigurationError", "DataNotFoundError", "HFMCAWarning", "check_at_least", "check_choice"]


class ConfigurationError(ValueError):
    """The configuration, the data or a checkpoint does not fit the experiment; the message says how to fix it.

    Args:
        message: what is wrong and how to fix it.
        parameter: the constructor argument at fault, if one is; the ``hfmca`` command prefixes the message
            with its full config key (``model.init_args.external_cost.init_args.reg``).
    """

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class DataNotFoundError(ConfigurationError, FileNotFoundError):
    """A data set is not where the configuration says it is."""


class HFMCAWarning(UserWarning):
    """Something a run should know but that does not stop it (an image skipped, an evaluation split missing); every
    warning the package gives has this category (the test suite turns it into an error wherever it is not
    expected)."""


def check_at_least(value: int, least: int, name: str, owner: str | None = None) -> None:
    """One line naming ``name`` (of ``owner``, where given) when ``value`` is not a whole number ``>= least`` (a
    count: ``2.5``, ``"4"`` or ``True`` are refused, numpy integers taken)."""
    where = f"{owner}: " if owner else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationError(f"{where}{name} must be a whole number >= {least}; got {value!r}", parameter=name)
    if value < least:
        raise ConfigurationError(f"{where}{name} must be >= {least}; got {value}", parameter=name)


def check_choice(value: object, choices: Collection[object], name: str, owner: str | None = None) -> None:
    """One line naming ``name`` (of ``owner``, where given) and its choices when ``value`` is none of them."""
    if value not in choices:
        where = f"{owner}: " if owner else ""
        listed = ", ".join(str(choice) for choice in choices)
        raise ConfigurationError(f"{where}{name} must be one of {listed}; got {value!r}", parameter=name)
