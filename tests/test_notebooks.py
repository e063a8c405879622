"""Every notebook runs top to bottom (each trains its own checkpoint in seconds on the embedded data)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path, monkeypatch):
    monkeypatch.setenv("HFMCA_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    images = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]
    assert images, "each notebook shows at least one figure"
    assert any(tmp_path.glob("**/last.ckpt")), "the notebook trains its own checkpoint"


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_spectrum_analysis.ipynb", "03_density_ratio_heatmaps.ipynb"]
