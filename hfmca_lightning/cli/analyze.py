"""``hfmca analyze`` and ``hfmca compare``: the paper's analysis figures from checkpoints (docs/conventions.md §4).

    hfmca analyze --ckpt_path runs/demo/checkpoints/last.ckpt --out analysis/demo
    hfmca compare --ckpt_a runs/spectrum_supervised/checkpoints/last.ckpt \\
                  --ckpt_b runs/spectrum_selfsupervised/checkpoints/last.ckpt --out analysis/sup_vs_ss

The model and data are rebuilt from the config that ``hfmca fit`` stores in every checkpoint (or from
``--config`` for checkpoints written elsewhere). Outputs: PNG figures, JSON numbers and an ``index.html``
that shows them all.
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from hfmca_lightning.analysis.density_ratio import basis_function_maps, telescoping_response
from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.cli.runs import backbone_of, load_run
from hfmca_lightning.data.datamodule import QUERIES, MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics
from hfmca_lightning.methods.hfmca import HFMCAModule
from hfmca_lightning.methods.inspection import (
    collect_statistics,
    default_figure_layers,
    heatmap_placements,
    layer_pairs,
    residual_blocks,
    spectra,
)
from hfmca_lightning.methods.internal_costs import InternalCosts
from hfmca_lightning.visualization import (
    basis_functions_figure,
    heatmap_overlay_figure,
    layer_spectra_figure,
    save_figure,
)

__all__ = ["load_run", "analysis_module", "analyze", "compare", "run_analysis_command"]


def _training_batches(datamodule: MultiViewDataModule, count: int) -> Iterator[Tensor]:
    for index, (batch, _) in enumerate(datamodule.train_dataloader()):
        if index >= count:
            return
        yield batch


def _write_index(out: Path, title: str, figures: list[tuple[str, str]], table: dict[str, list[float]]) -> Path:
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{values[0]:.3f}</td>"
        f"<td>{sum(values[:10]) / max(1, len(values[:10])):.3f}</td>"
        f"<td>{sum(v > 0.5 for v in values)}</td><td>{len(values)}</td></tr>"
        for name, values in table.items()
    )
    body = "".join(
        f"<figure><img src='{html.escape(file)}'><figcaption>{html.escape(caption)}</figcaption></figure>"
        for file, caption in figures
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1400px} img{max-width:100%;border:1px solid #ddd}"
        "table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}"
        "figure{margin:2em 0}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table><tr><th>pair</th><th>top eigenvalue</th><th>mean of top 10</th>"
        f"<th>eigenvalues &gt; 0.5</th><th>eigenvalues</th></tr>{rows}</table>{body}</body></html>"
    )
    path = out / "index.html"
    path.write_text(page)
    return path


def analysis_module(module: LightningModule, internal_layers: list[str] | None = None) -> HFMCAModule:
    """The HFMCA view of any trained module: an :class:`HFMCAModule` itself, or (for the baselines, or when
    ``internal_layers`` names backbone modules) a wrapper of its backbone with float64 internal costs on
    ``internal_layers`` (default: every residual block), so that any model's layer spectra, heatmaps and
    basis functions come from the same maths (the paper's spectra across supervision types)."""
    if isinstance(module, HFMCAModule) and internal_layers is None:
        return module
    backbone = backbone_of(module)
    layers = internal_layers or residual_blocks(backbone)
    if not layers:
        raise ConfigurationError(
            f"{type(backbone).__name__} has no residual blocks to analyse; name its blocks with --internal_layers "
            "(module names of the backbone, e.g. net.layer1.0)"
        )
    return HFMCAModule(backbone, internal_costs=InternalCosts(layers, precision="float64")).eval()


def analyze(
    ckpt_path: str | Path,
    out: str | Path,
    config_path: str | Path | None = None,
    num_batches: int = 4,
    num_images: int = 8,
    layers: list[str] | None = None,
    internal_layers: list[str] | None = None,
    image_class: int | None = None,
    first_image: int = 0,
) -> Path:
    """Spectra (PNG + JSON) over ``num_batches`` training batches, density-ratio heatmaps and basis functions
    of ``num_images`` test images at ``layers`` (default: the three lowest internal layers), ``index.html``.

    Any checkpoint of the package: baselines (and HFMCA runs given ``internal_layers``) are analysed through
    :func:`analysis_module`."""
    run_module, datamodule = load_run(ckpt_path, config_path)
    module = analysis_module(run_module, internal_layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    statistics = collect_statistics(module, _training_batches(datamodule, num_batches))
    eigenvalues = {name: values.tolist() for name, values in spectra(module, statistics).items()}
    (out / "spectra.json").write_text(json.dumps(eigenvalues, indent=1))
    save_figure(
        layer_spectra_figure(eigenvalues, title=f"Spectrum per layer pair ({Path(ckpt_path).name})"),
        out / "spectra.png",
    )
    figures = [
        ("spectra.png", "Eigenvalues of every cost pair; red: mean of the 10 largest (spectra.json has the numbers).")
    ]
    if module.internal_costs is not None:
        images, _ = datamodule.evaluation_images(num_images, target=image_class, start=first_image)
        pairs = {pair.name: pair for pair in layer_pairs(module, images, statistics)}
        heatmaps = telescoping_response(list(pairs.values()))
        chosen = layers or default_figure_layers(list(heatmaps))
        unknown = set(chosen) - set(heatmaps)
        if unknown:
            raise ConfigurationError(f"--layers {sorted(unknown)} are not internal cost layers {list(heatmaps)}")
        overlay = heatmap_overlay_figure(
            datamodule.denormalise(images),
            {name: heatmaps[name] for name in chosen},
            placements=heatmap_placements(module),
        )
        save_figure(overlay, out / "density_ratio.png")
        figures.append(
            ("density_ratio.png", f"Global-to-local density-ratio response (Alg. 5) at {', '.join(chosen)}.")
        )
        for name in chosen:
            maps, values = (
                basis_function_maps(pairs[name].decomposition, pairs[name].low_map[0]),
                pairs[name].decomposition.eigenvalues,
            )
            file = f"basis_{name.replace('/', '_')}.png"
            save_figure(
                basis_functions_figure(maps, values, title=f"Basis functions of layer {name}, test image 0"), out / file
            )
            figures.append((file, f"Normalised eigenfunctions (Alg. 4) of layer {name} over test image 0."))
    return _write_index(out, f"HFMCA analysis of {ckpt_path}", figures, eigenvalues)


def _positions(feature_map: Tensor) -> Tensor:
    """``(N, C, H, W)`` maps or ``(N, D)`` features -> one row per position ``(N * H * W, C)``."""
    if feature_map.dim() == 2:
        return feature_map
    return feature_map.permute(0, 2, 3, 1).reshape(-1, feature_map.shape[1])


@torch.no_grad()
def _module_outputs(module: LightningModule, images: Tensor, names: list[str]) -> dict[str, Tensor]:
    """Output of every named backbone module on ``images`` (eval mode), plus the features as ``backbone``."""
    backbone = backbone_of(module)
    outputs: dict[str, Tensor] = {}
    handles = [
        backbone.get_submodule(name).register_forward_hook(
            lambda _m, _a, output, name=name: outputs.__setitem__(name, output.detach())
        )
        for name in names
    ]
    try:
        outputs["backbone"] = module(images).detach()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def comparable_layers(module: LightningModule) -> list[str]:
    """Backbone module names compared by default: the internal-cost layers of an HFMCA run, else its residual blocks."""
    if isinstance(module, HFMCAModule) and module.internal_costs is not None:
        return module.internal_costs.layers
    return residual_blocks(backbone_of(module))


def compare(
    ckpt_a: str | Path,
    ckpt_b: str | Path,
    out: str | Path,
    num_batches: int = 4,
    reg: float = 1e-3,
    layers: list[str] | None = None,
) -> Path:
    """Eigenvalues between the normalised features of two models at each common backbone layer (by module
    name) and at their outputs (``backbone``), on the same images (the test split of model A's data): values
    near 1 = parallel eigenfunctions, near 0 = orthogonal. Any two checkpoints of the package (HFMCA vs
    SimCLR, supervised vs self-supervised, ...)."""
    model_a, data_a = load_run(ckpt_a)
    model_b, _ = load_run(ckpt_b)
    names_b = set(dict(backbone_of(model_b).named_modules()))
    if layers is None:
        layers = [name for name in comparable_layers(model_a) if name in names_b]
    missing = [name for name in layers if name not in names_b or name not in dict(backbone_of(model_a).named_modules())]
    if missing:
        raise ConfigurationError(f"--layers {missing} are not modules of both backbones")
    statistics: dict[str, CorrelationStatistics] = {}
    loaders = data_a.val_dataloader()
    if not loaders:
        raise ConfigurationError("model A's data has no labelled evaluation split to compare on")
    for index, (images, _) in enumerate(loaders[QUERIES]):
        if index >= num_batches:
            break
        outputs_a, outputs_b = _module_outputs(model_a, images, layers), _module_outputs(model_b, images, layers)
        for name in [*layers, "backbone"]:
            if outputs_a[name].shape[2:] != outputs_b[name].shape[2:]:
                continue
            pair = group_statistics(_positions(outputs_a[name]).double()[:, None], _positions(outputs_b[name]).double())
            statistics[name] = statistics[name] + pair if name in statistics else pair
    if not statistics:
        raise ConfigurationError("the two models have no layer in common (same backbone module names and map sizes)")
    eigenvalues = {name: decompose(stats, reg=reg).eigenvalues.tolist() for name, stats in statistics.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cross_spectra.json").write_text(json.dumps(eigenvalues, indent=1))
    title = f"Spectrum across models: {_run_label(ckpt_a, model_a)} vs {_run_label(ckpt_b, model_b)}"
    save_figure(layer_spectra_figure(eigenvalues, title=title), out / "cross_spectra.png")
    caption = (
        "Eigenvalues between the normalised features of the two models at each layer (1: same subspace, 0: orthogonal)."
    )
    return _write_index(out, title, [("cross_spectra.png", caption)], eigenvalues)


def _run_label(ckpt_path: str | Path, module: LightningModule) -> str:
    return f"{Path(ckpt_path).parent.parent.name} ({type(module).__name__})"


def run_analysis_command(argv: list[str]) -> None:
    """Parse and run ``analyze ...`` or ``compare ...``."""
    parser = argparse.ArgumentParser(prog="hfmca", description="Analysis of trained HFMCA checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("analyze", help="spectra, density-ratio heatmaps and basis functions of one checkpoint")
    one.add_argument("--ckpt_path", required=True)
    one.add_argument("--out", required=True, help="output folder (index.html, PNG, JSON)")
    one.add_argument("--config", default=None, help="the run's YAML, for checkpoints not written by `hfmca fit`")
    one.add_argument("--num_batches", type=int, default=4, help="training batches for the statistics")
    one.add_argument("--num_images", type=int, default=8, help="test images for heatmaps")
    one.add_argument("--layers", nargs="*", default=None, help="internal layers to draw (log names such as L2 L4 L6)")
    one.add_argument("--image_class", type=int, default=None, help="draw only test images of this class")
    one.add_argument("--first_image", type=int, default=0, help="index of the first test image considered")
    one.add_argument(
        "--internal_layers",
        nargs="*",
        default=None,
        help="backbone modules to analyse (e.g. net.layer1.0); default: an HFMCA run's internal-cost layers, "
        "a baseline's residual blocks",
    )
    two = commands.add_parser("compare", help="cross-model eigenvalues per layer of two checkpoints")
    two.add_argument("--ckpt_a", required=True)
    two.add_argument("--ckpt_b", required=True)
    two.add_argument("--out", required=True)
    two.add_argument("--num_batches", type=int, default=4, help="test batches of model A's data")
    two.add_argument(
        "--layers",
        nargs="*",
        default=None,
        help="backbone module names (default: A's internal-cost layers or residual blocks)",
    )
    args = parser.parse_args(argv)
    if args.command == "analyze":
        index = analyze(
            args.ckpt_path,
            args.out,
            args.config,
            args.num_batches,
            args.num_images,
            args.layers,
            args.internal_layers,
            args.image_class,
            args.first_image,
        )
    else:
        index = compare(args.ckpt_a, args.ckpt_b, args.out, args.num_batches, layers=args.layers)
    print(f"wrote {index}")
