"""The figures are drawn by their own Agg canvas: importing the package leaves the process's matplotlib backend as it
is (a notebook keeps showing figures inline), and no figure is left registered with ``pyplot``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from hfmca_lightning.visualization import (
    basis_functions_figure,
    external_cost_curves_figure,
    heatmap_overlay_figure,
    layer_spectra_figure,
    layer_spectra_panels,
    learning_dynamics_figure,
    save_figure,
)
from tests.helpers import REPO

IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
import matplotlib
if sys.argv[1] == "use":
    matplotlib.use("svg")
before = [matplotlib.get_backend(), matplotlib.rcParams["backend"]]
import hfmca_lightning
modules = [module.name for module in pkgutil.walk_packages(hfmca_lightning.__path__, "hfmca_lightning.")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": [matplotlib.get_backend(), matplotlib.rcParams["backend"]],
                  "modules": modules}))
"""


@pytest.mark.integration  # a subprocess
@pytest.mark.parametrize("how", ["use", "MPLBACKEND"])
def test_importing_the_package_and_every_module_leaves_the_backend_alone(how):
    environment = {name: value for name, value in os.environ.items() if name != "MPLBACKEND"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if how == "MPLBACKEND":
        environment["MPLBACKEND"] = "svg"
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING, how],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["before"] == ["svg", "svg"]
    assert report["after"] == report["before"]
    assert {"hfmca_lightning.visualization", "hfmca_lightning.callbacks.figures", "hfmca_lightning.cli.analyze"} <= set(
        report["modules"]
    )


def figures() -> dict[str, Figure]:
    generator = torch.Generator().manual_seed(0)
    return {
        "learning_dynamics": learning_dynamics_figure({"external": ([0, 1, 2], np.linspace(0, 1, 12).reshape(3, 4))}),
        "layer_spectra": layer_spectra_figure({"L1": [0.9, 0.5], "L2": [0.8, 0.1]}),
        "layer_spectra_panels": layer_spectra_panels({"a": {"L1": [0.9]}, "b": {"L1": [0.5]}}, title="panels"),
        "heatmap_overlay": heatmap_overlay_figure(
            torch.rand(2, 3, 8, 8, generator=generator), {"L1": torch.rand(2, 4, 4, generator=generator)}
        ),
        "basis_functions": basis_functions_figure(
            torch.randn(3, 5, 5, generator=generator), torch.tensor([0.9, 0.5, 0.1])
        ),
        "external_cost_curves": external_cost_curves_figure({"crop": {0.5: [-1.0, -2.0, -3.0]}}),
    }


def test_every_figure_is_drawn_on_its_own_agg_canvas_and_saved_as_png(tmp_path):
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    drawn = figures()
    assert plt.get_fignums() == open_before  # none registered with pyplot: a notebook shows only what it displays
    for name, figure in drawn.items():
        assert isinstance(figure, Figure) and isinstance(figure.canvas, FigureCanvasAgg), name
        assert figure.axes, name
        path = save_figure(figure, tmp_path / "figures" / f"{name}.png", dpi=50)
        width, height = figure.get_size_inches()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (round(width * 50), round(height * 50)), name
            assert np.asarray(image.convert("L")).std() > 0, f"{name}: a blank image"


def test_save_figure_closes_a_figure_made_with_pyplot(tmp_path):
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert figure.number in plt.get_fignums()
    save_figure(figure, tmp_path / "pyplot.png")
    assert (tmp_path / "pyplot.png").is_file() and figure.number not in plt.get_fignums()


def test_a_long_title_of_a_narrow_spectrum_figure_stays_inside_it():
    """One pair (the demo's callback figure, 4 inches wide) with the callback's title: wrapped, not cut off."""
    figure = layer_spectra_figure(
        {"external": [0.9, 0.5]}, title="Spectrum per layer pair, step 372 (windows of >= 6400 groups)"
    )
    figure.canvas.draw()
    title = figure.axes[0].title.get_window_extent(figure.canvas.get_renderer())
    assert 0 <= title.x0 and title.x1 <= figure.bbox.x1 and title.y1 <= figure.bbox.y1


def test_learning_dynamics_columns_are_centred_on_their_steps():
    """Each spectrum's column spans half an interval either side of its step (the first and last ones were drawn
    from their step's edge)."""
    figure = learning_dynamics_figure({"external": ([100, 110, 120], np.linspace(0, 1, 12).reshape(3, 4))})
    (image,) = figure.axes[0].get_images()
    assert tuple(image.get_extent()) == (95.0, 125.0, 4.5, 0.5)
    (single,) = learning_dynamics_figure({"external": ([7], np.ones((1, 2)))}).axes[0].get_images()
    assert tuple(single.get_extent())[:2] == (6.5, 7.5)
