"""Markers and shared fixtures of the test suite.

``make test`` runs every test marked neither ``slow`` nor ``extended`` (the longer runs, which CI adds with ``make
test-extended``); ``make test-fast`` leaves out ``integration`` tests too: every test under ``tests/integration/``
(subprocess runs of ``hfmca``, DDP, notebooks, benchmarks) and the unit tests marked so because they train a model
for several steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_overrides, write_cifar

INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.fixture(autouse=True)
def torch_threads_as_found() -> Iterator[None]:
    """Every test starts with the process's torch thread count: benchmark scripts run in-process set their own, and
    training results (the order of BLAS sums) follow it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def logger_levels_as_found() -> Iterator[None]:
    """Every test starts with the process's logger levels: ``hfmca`` commands run in-process set Lightning's (a
    command that does not train hides its INFO lines), which later tests that read those lines must not inherit."""
    import logging

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    levels = {logger: logger.level for logger in loggers if isinstance(logger, logging.Logger)}
    yield
    for logger, level in levels.items():
        logger.setLevel(level)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def shrunk_demo(tmp_path: Path) -> Callable[..., Path]:
    """``shrunk_demo(**overrides) -> path``: a second ``--config`` that shrinks configs/demo.yaml (or another shipped
    config) to a few seconds: 32 SyntheticShapes images, a tiny model, one epoch, outputs under ``tmp_path``;
    ``overrides`` by dotted key (``"data.init_args.num_workers": 2``)."""
    return lambda **overrides: tiny_overrides(tmp_path, **overrides)


@pytest.fixture
def cifar10_on_disk(tmp_path: Path) -> Path:
    """A CIFAR10 folder in torchvision's layout (``cifar-10-batches-py``, 100 training images) under ``tmp_path /
    "data"``."""
    write_cifar(tmp_path / "data", "cifar10", per_class=2)
    return tmp_path / "data"
