"""Errors that mean "your configuration or data is wrong", raised before training starts.

The ``hfmca`` command prints them as one line (``hfmca: error: ...``, exit status 2) instead of a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "DataNotFoundError", "HFMCAWarning"]


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
