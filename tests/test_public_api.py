"""The stable public names of docs/conventions.md §7 exist with the documented signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from hfmca_lightning.analysis import eigenspectrum
from hfmca_lightning.cli import main
from hfmca_lightning.data import MultiViewDataModule
from hfmca_lightning.losses import HFMCACost, hfmca_cost


def test_spec_signatures():
    cost = inspect.signature(hfmca_cost)
    assert cost.parameters["reg"].kind is inspect.Parameter.KEYWORD_ONLY and cost.parameters["reg"].default == 0.1
    assert cost.parameters["sync_dist"].default is False
    module = inspect.signature(HFMCACost)
    assert [module.parameters[name].default for name in ("reg", "beta", "sync_dist")] == [0.1, 0.0, False]
    spectrum = inspect.signature(eigenspectrum)
    assert (
        spectrum.parameters["reg"].kind is inspect.Parameter.KEYWORD_ONLY and spectrum.parameters["reg"].default == 0.1
    )
    assert "source" in inspect.signature(MultiViewDataModule).parameters


def test_console_script_points_at_cli_main():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["hfmca"] == "hfmca_lightning.cli:main"


def test_help_mentions_the_analysis_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "hfmca analyze --help" in out and "fit" in out
