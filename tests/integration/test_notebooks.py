"""Every notebook runs top to bottom (each trains its own checkpoint in seconds on the embedded data)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize(
    "path",
    # the quickstart in make test, the analysis notebooks (40 s on a 2-core CPU) in make test-slow
    [pytest.param(p, marks=[] if p.name.startswith("01_") else [pytest.mark.slow]) for p in NOTEBOOKS],
    ids=[p.name for p in NOTEBOOKS],
)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path, monkeypatch):
    monkeypatch.setenv("HFMCA_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    assert figures(notebook), "each notebook shows at least one figure"
    assert any(tmp_path.glob("**/last.ckpt")), "the notebook trains its own checkpoint"


def figures(notebook) -> list:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if {"image/png", "image/jpeg"} & set(output.get("data", {}))
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_are_committed_with_their_figures_and_stay_small(path: Path):
    """Readers on GitHub see the figures without running anything (`make notebooks` refreshes them)."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("outputs") or not cell.source.strip() for cell in code[1:]), "a cell without its output"
    assert figures(notebook)
    assert path.stat().st_size < 300 * 1024


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_spectrum_analysis.ipynb",
        "03_density_ratio_heatmaps.ipynb",
    ]
