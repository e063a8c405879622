"""The stable-pretraining-style module of ``examples/stable_pretraining_convention.py`` under class paths a run's
config can name (``tests.helpers.stable_pretraining.<Class>``): its SimCLR and its DINO. The example is imported as
the module ``stable_pretraining_convention``, so its functions pickle (spawned DDP processes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "examples" / "stable_pretraining_convention.py"
NAME = "stable_pretraining_convention"
if NAME not in sys.modules:
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    assert spec is not None and spec.loader is not None
    sys.modules[NAME] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[NAME])
example = sys.modules[NAME]


class SPTSimCLR(example.SPTModule):  # type: ignore[misc, name-defined]
    """The example's module with stable-pretraining's ``simclr`` forward function."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(example.simclr, lr)


class SPTDINO(example.SPTModule):  # type: ignore[misc, name-defined]
    """The example's module with stable-pretraining's ``dino`` forward function."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(example.dino, lr)
