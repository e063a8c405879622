"""The ``hfmca`` command: ``fit`` / ``validate`` / ``test`` (LightningCLI), ``analyze`` / ``compare``, ``linear`` /
``knn``, ``export`` and ``dashboard``; :func:`main` is the console script."""

from hfmca_lightning.cli.console import main

__all__ = ["main"]
