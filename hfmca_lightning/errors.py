"""Errors that mean "your configuration or data is wrong", raised before training starts.

The ``hfmca`` command prints them as one line (``hfmca: error: ...``) instead of a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "DataNotFoundError"]


class ConfigurationError(ValueError):
    """The configuration, the data or a checkpoint does not fit the experiment; the message says how to fix it."""


class DataNotFoundError(ConfigurationError, FileNotFoundError):
    """A data set is not where the configuration says it is."""
