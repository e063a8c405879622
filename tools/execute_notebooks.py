"""Run every notebook top to bottom and save it with its outputs (figures included), for `make notebooks`.

Each notebook trains its own small checkpoint under a temporary folder, so nothing but the notebooks changes.
Execution metadata (timestamps) and stderr (library log lines) are dropped to keep diffs to what the
notebooks show.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path, out: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    os.environ["HFMCA_NOTEBOOK_OUT"] = str(out)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        # Library log lines (device banners, warnings) vary by machine; the saved notebook keeps what it shows.
        cell["outputs"] = [
            o for o in cell.get("outputs", []) if not (o.get("output_type") == "stream" and o.get("name") == "stderr")
        ]
    nbformat.write(notebook, path)
    return path.stat().st_size


def main(names: list[str]) -> None:
    paths = [NOTEBOOKS / name for name in names] if names else sorted(NOTEBOOKS.glob("*.ipynb"))
    with tempfile.TemporaryDirectory() as folder:
        for path in paths:
            size = execute(path, Path(folder) / path.stem)
            print(f"{path.relative_to(NOTEBOOKS.parent)}: {size / 1024:.0f} KiB with outputs")


if __name__ == "__main__":
    main(sys.argv[1:])
