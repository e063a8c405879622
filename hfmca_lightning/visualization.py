"""Figures of the paper's analysis (docs/conventions.md §4), as matplotlib figures a person can read without the code.

Every function returns a ``matplotlib.figure.Figure`` drawn by its own Agg canvas: no display is needed, the
process's matplotlib backend is left as it is (a notebook keeps showing its figures inline) and the figure is not
registered with ``pyplot`` (nothing to close; a notebook shows it where it is displayed). :func:`save_figure` writes
it as PNG (atomically), :func:`write_figure` into an open file. Inputs are plain tensors / arrays.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hfmca_lightning.losses.window_geometry import WindowGeometry
from hfmca_lightning.runtime.files import write_atomically

__all__ = [
    "learning_dynamics_figure",
    "layer_spectra_figure",
    "layer_spectra_panels",
    "heatmap_overlay_figure",
    "basis_functions_figure",
    "external_cost_curves_figure",
    "save_figure",
    "write_figure",
]


def _figure(width: float, height: float) -> Figure:
    """An empty figure of ``width`` x ``height`` inches (constrained layout) with its own Agg canvas."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _array(values: torch.Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def learning_dynamics_figure(
    history: Mapping[str, tuple[Sequence[int], np.ndarray]], title: str = "Eigenvalue learning dynamics"
) -> Figure:
    """One heatmap per cost pair: x = training step, y = eigenvalue rank (1 = largest), colour = sigma_k.

    Args:
        history: ``{pair name: (steps (T,), eigenvalues (T, k))}``.
    """
    names = list(history)
    columns = min(5, max(1, len(names)))
    rows = math.ceil(len(names) / columns)
    figure = _figure(3.4 * columns, 2.9 * rows)
    axes = figure.subplots(rows, columns, squeeze=False)
    image = None
    for ax, name in zip(axes.flat, names):
        recorded_steps, recorded_values = history[name]
        values = _array(recorded_values)
        steps = np.asarray(recorded_steps, dtype=np.float64)
        half = (steps[-1] - steps[0]) / (len(steps) - 1) / 2 if len(steps) > 1 else 0.5  # columns centred on steps
        extent = (steps[0] - half, steps[-1] + half, values.shape[1] + 0.5, 0.5)
        image = ax.imshow(
            values.T,
            aspect="auto",
            origin="upper",
            extent=extent,
            vmin=0,
            vmax=1,
            cmap="viridis",
            interpolation="nearest",
        )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("eigenvalue rank")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    if image is not None:
        figure.colorbar(image, ax=axes, shrink=0.8, label="eigenvalue $\\sigma_k$")
    figure.suptitle(title)
    return figure


def layer_spectra_figure(
    spectra: Mapping[str, torch.Tensor | np.ndarray | Sequence[float]],
    title: str = "Spectrum per layer",
    top_mean: int = 10,
) -> Figure:
    """One column of eigenvalue dots per layer (darker = higher rank), with the mean of the ``top_mean``
    largest eigenvalues as a red dotted line (paper Fig. 4, "Spectrum across layers")."""
    figure = _figure(max(4.0, 0.9 * len(spectra) + 2), 4.2)
    ax = figure.subplots()
    _draw_layer_spectra(ax, spectra, title, top_mean)
    return figure


def layer_spectra_panels(
    panels: Mapping[str, Mapping[str, torch.Tensor | np.ndarray | Sequence[float]]],
    title: str = "",
    top_mean: int = 10,
) -> Figure:
    """:func:`layer_spectra_figure` side by side, one panel per ``{panel title: spectra}`` (the paper's Fig. 4 for
    three scenarios, Fig. 5 for three pairs of them)."""
    width = max(4.0, 0.9 * max((len(spectra) for spectra in panels.values()), default=1) + 2)
    figure = _figure(width * len(panels), 4.2)
    axes = figure.subplots(1, len(panels), squeeze=False, sharey=True)
    for ax, (name, spectra) in zip(axes.flat, panels.items()):
        _draw_layer_spectra(ax, spectra, name, top_mean)
    if title:
        figure.suptitle(title)
    return figure


def _draw_layer_spectra(
    ax: Any, spectra: Mapping[str, torch.Tensor | np.ndarray | Sequence[float]], title: str, top_mean: int
) -> None:
    names = list(spectra)
    colour = colormaps["Blues"]
    means = []
    for column, name in enumerate(names):
        values = np.sort(_array(spectra[name]))[::-1]
        ranks = np.linspace(1.0, 0.25, len(values)) if len(values) > 1 else np.ones(1)
        ax.scatter(np.full(len(values), column), values, c=colour(ranks), s=14, edgecolors="none")
        means.append(values[:top_mean].mean() if len(values) else np.nan)
    ax.plot(range(len(names)), means, "r:", marker="o", markersize=3, label=f"mean of the {top_mean} largest")
    ax.set_xticks(
        range(len(names)), names, rotation=45 if len(names) > 6 else 0, ha="right" if len(names) > 6 else "center"
    )
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("layer pair")
    ax.set_ylabel("eigenvalue $\\sigma_k$ (1 = fully dependent)")
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title, wrap=True)  # a narrow figure (one or two pairs) keeps its whole title
    ax.grid(axis="y", alpha=0.3)


def heatmap_overlay_figure(
    images: torch.Tensor,
    heatmaps: Mapping[str, torch.Tensor],
    title: str = "Global-to-local density-ratio response",
    placements: Mapping[str, WindowGeometry] | None = None,
) -> Figure:
    """Rows: images; columns: the image, then its response at each layer overlaid on it (upsampled).

    Args:
        images: ``(N, 3, H, W)`` in [0, 1]. heatmaps: ``{layer: (N, h, w)}``.
        placements: ``{layer: geometry from the image to that map}`` (:func:`~hfmca_lightning.losses.input_geometry`):
            map position ``j`` is drawn centred on pixel ``j * stride - padding + (kernel - 1) / 2``, one stride wide
            (padding positions fall outside the image and are cut off). Layers without one are stretched over the image.
    """
    names = list(heatmaps)
    count = images.shape[0]
    figure = _figure(1.9 * (len(names) + 1) + 0.8, 1.9 * count)
    axes = figure.subplots(count, len(names) + 1, squeeze=False)
    pictures = images.detach().cpu().float().clamp(0, 1).permute(0, 2, 3, 1).numpy()
    height, width = pictures.shape[1:3]
    mappable = None
    for row in range(count):
        axes[row, 0].imshow(pictures[row])
        axes[row, 0].set_ylabel(f"image {row}", fontsize=8)
        for column, name in enumerate(names, start=1):
            heat = _array(heatmaps[name][row])
            heat = (heat - heat.min()) / (np.ptp(heat) + 1e-12)
            ax = axes[row, column]
            ax.imshow(pictures[row])
            mappable = ax.imshow(
                heat,
                cmap="jet",
                alpha=0.55,
                extent=_extent(heat.shape, (height, width), (placements or {}).get(name)),
                vmin=0,
                vmax=1,
                interpolation="bilinear",
            )
            ax.set_xlim(-0.5, width - 0.5)
            ax.set_ylim(height - 0.5, -0.5)
            if row == 0:
                ax.set_title(name, fontsize=10)
    axes[0, 0].set_title("input", fontsize=10)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if mappable is not None:
        figure.colorbar(mappable, ax=axes, shrink=0.6, label="response (min-max scaled per image)")
    figure.suptitle(title)
    return figure


def _extent(
    map_size: tuple[int, ...], image_size: tuple[int, int], placement: WindowGeometry | None
) -> tuple[float, float, float, float]:
    """imshow extent ``(left, right, bottom, top)`` of an ``(h, w)`` map over an ``(H, W)`` image (pixel ``i`` spans
    ``[i - 1/2, i + 1/2]``): from the map's placement, or stretched over the image without one."""
    (rows, columns), (height, width) = map_size[-2:], image_size
    if placement is None:
        return (-0.5, width - 0.5, height - 0.5, -0.5)
    k, s, p = placement.kernel, placement.stride, placement.padding
    start = -p + (k - 1) / 2 - s / 2  # left edge of position 0
    return (start, start + columns * s, start + rows * s, start)


def basis_functions_figure(
    maps: torch.Tensor, eigenvalues: torch.Tensor, title: str = "Basis functions", columns: int = 8
) -> Figure:
    """Grid of the normalised eigenfunctions ``phi_hat_k`` of one layer over one image, each titled with
    its eigenvalue (paper Fig. "basis functions").

    Args:
        maps: ``(r, H, W)``. eigenvalues: ``(r,)``.
    """
    count = maps.shape[0]
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    figure = _figure(1.5 * columns + 0.8, 1.6 * rows + 0.6)
    axes = figure.subplots(rows, columns, squeeze=False)
    values = _array(maps)
    limit = np.abs(values).max() + 1e-12
    mappable = None
    for index, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if index >= count:
            ax.axis("off")
            continue
        mappable = ax.imshow(values[index], cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_title(f"k={index + 1}  σ={float(eigenvalues[index]):.2f}", fontsize=7)
    if mappable is not None:
        figure.colorbar(mappable, ax=axes, shrink=0.6, label="$\\hat\\phi_k$ value")
    figure.suptitle(title)
    return figure


def external_cost_curves_figure(
    curves: Mapping[str, Mapping[float, Sequence[float]]],
    title: str = "External cost (dependence level) during training",
    smoothing: int = 1,
) -> Figure:
    """The figure beside paper Table 2: one panel per augmentation protocol, one curve of the external cost per
    distortion strength (darker = stronger); lower cost = more dependence between the views and their group.

    Args:
        curves: ``{protocol: {strength: external cost per training step}}``.
        smoothing: moving-average window in steps (1 = raw values).
    """
    names = list(curves)
    figure = _figure(4.2 * len(names), 3.4)
    axes = figure.subplots(1, len(names), squeeze=False)
    for ax, name in zip(axes[0], names):
        strengths = sorted(curves[name])
        colours = colormaps["viridis_r"](np.linspace(0.15, 0.95, max(len(strengths), 2)))
        for colour, strength in zip(colours, strengths):
            values, first_step = _array(curves[name][strength]), 1
            if smoothing > 1 and len(values) >= smoothing:
                values = np.convolve(values, np.ones(smoothing) / smoothing, mode="valid")
                first_step = smoothing  # each mean is drawn at the last step of its window
            ax.plot(np.arange(first_step, first_step + len(values)), values, color=colour, label=f"{strength:g}")
        ax.set_title(f"{name} strength")
        ax.set_xlabel("training step")
        ax.set_ylabel("external cost $r$ (lower = more dependence)")
        ax.grid(alpha=0.3)
        ax.legend(title="strength", fontsize=8, title_fontsize=8)
    figure.suptitle(title)
    return figure


def save_figure(figure: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``figure`` as a PNG (or the format of ``path``'s suffix; parents created; the previous file replaced
    whole or not at all); a figure made with ``pyplot`` is closed there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, lambda handle: write_figure(figure, handle, dpi, path.suffix.lstrip(".") or "png"))


def write_figure(figure: Figure, handle: BinaryIO, dpi: int = 110, format: str = "png") -> None:
    """Write ``figure`` into ``handle`` (a binary file) as a PNG (or ``format``); a figure made with ``pyplot`` is
    closed there."""
    try:
        figure.savefig(handle, format=format, dpi=dpi)
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")  # not imported: the figure cannot be registered there
        if pyplot is not None:
            pyplot.close(figure)
