"""``hfmca analyze`` and ``hfmca compare``: the paper's analysis figures from checkpoints (docs/conventions.md §4).

    hfmca analyze --ckpt_path runs/demo/checkpoints/last.ckpt --out analysis/demo
    hfmca compare --ckpt_a runs/spectrum_supervised/checkpoints/last.ckpt \\
                  --ckpt_b runs/spectrum_selfsupervised/checkpoints/last.ckpt --out analysis/sup_vs_ss

The model and data are rebuilt from the config that ``hfmca fit`` stores in every checkpoint (or from
``--config`` for checkpoints written elsewhere). Outputs: PNG figures, JSON numbers (``analyze``: the spectra and the
label-free health of the backbone, docs/conventions.md §9) and an ``index.html`` that shows them all. A non-empty
``--out`` is refused unless ``--overwrite`` is given; every file is written in full beside its target before any is
renamed into place, ``index.html`` last, so a failure mid-way (a full disk) leaves the previous report as it was.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from hfmca_lightning.analysis.density_ratio import telescoping_response
from hfmca_lightning.analysis.health import HealthStatistics
from hfmca_lightning.analysis.spectral import decompose
from hfmca_lightning.analysis.spectrum_window import GROUPS_PER_FEATURE, groups_needed
from hfmca_lightning.callbacks.eigenspectrum import HOOKED_REG
from hfmca_lightning.cli import options
from hfmca_lightning.cli.paths import OVERWRITE_HELP, check_out, read_config_file
from hfmca_lightning.cli.runs import backbone_of, load_run
from hfmca_lightning.cli.verbosity import progress, stage, warn
from hfmca_lightning.data.datamodule import QUERIES, MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation.batch_norm import BatchNormReference, batch_norm_age, recorded_batch_norm
from hfmca_lightning.evaluation_data import denormalise, figure_images, view_batches
from hfmca_lightning.losses.hfmca_cost import HFMCACost
from hfmca_lightning.losses.statistics import CorrelationStatistics, group_statistics
from hfmca_lightning.methods.hfmca import HFMCAModule
from hfmca_lightning.methods.inspection import (
    BatchNormStatistics,
    analysis_layers,
    analysis_mode,
    collect_for_analysis,
    default_figure_layers,
    heatmap_placements,
    layer_pairs,
    nontrivial_basis_maps,
    paper_order,
)
from hfmca_lightning.methods.internal_costs import InternalCosts, internal_cost_name, log_names
from hfmca_lightning.models.heads import GridExternalHead
from hfmca_lightning.runtime.checkpoint_io import check_checkpoint_path
from hfmca_lightning.runtime.files import StagedFiles
from hfmca_lightning.visualization import (
    basis_functions_figure,
    heatmap_overlay_figure,
    layer_spectra_figure,
    write_figure,
)

__all__ = ["load_run", "analysis_module", "analyze", "compare", "run_analysis_command"]


YOUNG_BATCH_NORM = 100  # batches: below this, running statistics still carry their start (0.9^100 < 1e-4 at momentum
# 0.1) and lag the weights of a fast-moving start of training (21 steps into a spectrum run: an L4 top-10 mean of
# 0.175 with them against 0.673 in training)
BatchNormChoice = Literal["auto", "running", "batch"]
HEALTH_SAMPLES_PER_DIM = 2  # samples per embedding dimension the health metrics wait for, as HealthMetrics' default
# (docs/conventions.md §9): an estimate from N samples shows a rank of at most N


def choose_batch_norm(modules: list[LightningModule], choice: BatchNormChoice) -> tuple[BatchNormStatistics, str]:
    """Which BatchNorm statistics analysis uses, and a warning when ``auto`` picked the batches' own: the running
    statistics of a module that has tracked fewer than :data:`YOUNG_BATCH_NORM` batches describe the weights of
    earlier steps, not these, and spectra computed with them can be far from the training-time ones."""
    if choice not in ("auto", "running", "batch"):
        raise ConfigurationError(f"--batch_norm must be auto, running or batch; got {choice!r}")
    if choice != "auto":
        return choice, ""
    ages = [age for age in (batch_norm_age(module) for module in modules) if age is not None]
    if not ages or min(ages) >= YOUNG_BATCH_NORM:
        return "running", ""
    return "batch", (
        f"BatchNorm running statistics have seen only {min(ages)} batches: using each batch's own statistics, as "
        "training does (--batch_norm running to use the running ones)"
    )


def _batch_norm_for(modules: list[LightningModule], choice: BatchNormChoice) -> tuple[BatchNormStatistics, list[str]]:
    """:func:`choose_batch_norm`, its warning printed, and the report's notes on it."""
    norm, warning = choose_batch_norm(modules, choice)
    if warning:
        warn(warning)
    note = (
        "BatchNorm: running statistics (eval mode)."
        if norm == "running"
        else "BatchNorm: each batch's own statistics, as in training (running statistics untouched)."
    )
    return norm, [note, *([warning] if warning else [])]


def _enough_batches(
    batches: Iterator[Any],
    collect: Any,
    num_batches: int | None,
    groups_per_feature: int,
    description: str,
    also_enough: Callable[[], bool] = lambda: True,
) -> dict[str, CorrelationStatistics]:
    """Statistics summed over ``batches``: ``num_batches`` of them, or (``None``) until every pair holds
    ``groups_per_feature`` groups per feature (as the training-time spectra; fewer show dependence that is not there)
    and ``also_enough()`` says so, or the batches run out; the stage shown as ``description``. Empty where ``collect``
    gave no pair (``compare`` of layers that do not match); an error where there was no batch at all."""
    statistics: dict[str, CorrelationStatistics] = {}
    drawn = 0
    batches = progress(batches, description, total=num_batches)
    try:
        for index, batch in enumerate(batches):
            if num_batches is not None and index >= num_batches:
                break
            drawn += 1
            for name, stats in collect(batch).items():
                statistics[name] = statistics[name] + stats if name in statistics else stats
            if (
                num_batches is None
                and all(
                    float(stats.group_count) >= groups_needed(stats, groups_per_feature)
                    for stats in statistics.values()
                )
                and also_enough()
            ):
                break
    finally:
        close = getattr(batches, "close", None)
        if close is not None:  # a generator: its loader's workers are shut down now, not at exit
            close()
    if not drawn:
        raise ConfigurationError("no batches to analyse: the data split is empty")
    return statistics


def spectrum_summary(
    statistics: dict[str, CorrelationStatistics], regs: dict[str, float], groups_per_feature: int
) -> dict[str, dict]:
    """Per pair (paper order): its ``groups``, the ``groups_needed`` for ``groups_per_feature`` per feature, its
    ``reg``, the constant function's eigenvalue (``trivial``, the largest) and the other ``eigenvalues``, largest
    first."""
    summary = {}
    for name in paper_order(statistics):
        stats = statistics[name]
        values = decompose(stats, reg=regs[name]).eigenvalues.tolist()
        summary[name] = {
            "groups": int(float(stats.group_count)),
            "groups_needed": groups_needed(stats, groups_per_feature),
            "reg": regs[name],
            "trivial": values[0],
            "eigenvalues": values[1:],
        }
    return summary


def short_window_notes(summary: dict[str, dict]) -> list[str]:
    """A note per pair whose spectrum comes from fewer groups than it needs (the data ran out, or ``--num_batches``):
    its eigenvalues overstate the dependence (docs/conventions.md §4)."""
    return [
        f"{name}: {pair['groups']:,} groups, fewer than the {pair['groups_needed']:,} its spectrum needs; its "
        "eigenvalues overstate the dependence (more data or a larger split gives more groups)."
        for name, pair in summary.items()
        if pair["groups"] < pair["groups_needed"]
    ]


class HealthSums:
    """The label-free health of a module's backbone over analysed batches: :class:`HealthStatistics` of each batch's
    ``(B, L, D)`` backbone features (each sample's ``L`` views together; one view for single images), summed."""

    def __init__(self) -> None:
        self.sums: HealthStatistics | None = None

    def add(self, features: Tensor, batch: Tensor | list[Tensor]) -> None:
        """Add the backbone ``features (B * L, D)`` of ``batch`` (:attr:`Collected.features`), until the sums hold
        :data:`HEALTH_SAMPLES_PER_DIM` samples per dimension (the training-time metrics' count, so that the values
        compare: docs/conventions.md §9)."""
        if self.enough():
            return
        samples = (batch[0] if isinstance(batch, (list, tuple)) else batch).shape[0]
        added = HealthStatistics.of(features.reshape(samples, -1, features.shape[-1]))
        self.sums = added if self.sums is None else self.sums.merge(added)

    def enough(self) -> bool:
        """Whether the sums hold :data:`HEALTH_SAMPLES_PER_DIM` samples per dimension."""
        return self.sums is not None and float(self.sums.samples) >= HEALTH_SAMPLES_PER_DIM * self.dimension

    @property
    def dimension(self) -> int:
        assert self.sums is not None
        return self.sums.first_sum.shape[0]

    def summary(self) -> dict[str, Any]:
        """``rankme``, ``effective_rank``, ``alpha_req``, ``lidar`` (``None`` with one view per sample), and the
        ``samples``, ``views`` and ``dimension`` they come from."""
        assert self.sums is not None
        metrics = self.sums.metrics()
        return {
            "rankme": metrics["rankme"],
            "effective_rank": metrics["effective_rank"],
            "alpha_req": metrics["alpha_req"],
            "lidar": metrics.get("lidar"),
            "samples": int(float(self.sums.samples)),
            "views": self.sums.views,
            "dimension": self.dimension,
        }


def health_notes(health: dict[str, Any]) -> list[str]:
    """What the report says of its health numbers: where they come from, and when they are bounded by too few
    samples."""
    notes = [
        f"Label-free health of the backbone features (docs/conventions.md §9): {health['samples']} training samples "
        f"of {health['views']} view(s), {health['dimension']} dimensions."
    ]
    if health["samples"] < HEALTH_SAMPLES_PER_DIM * health["dimension"]:
        notes.append(
            f"Health from {health['samples']} samples, fewer than {HEALTH_SAMPLES_PER_DIM} per dimension: no rank "
            f"above {health['samples']} can show (leave --num_batches out to draw enough)."
        )
    if health["lidar"] is None:
        notes.append("No LiDAR: it needs two or more views per sample.")
    return notes


# After loading, the page records how many of its figures a browser could decode (data-figures-loaded on <body>):
# a headless browser's DOM dump then tells whether every figure loads.
FIGURES_LOADED_SCRIPT = (
    "<script>window.addEventListener('load',()=>{document.body.dataset.figuresLoaded="
    "[...document.images].filter(i=>i.complete&&i.naturalWidth>0).length;});</script>"
)


def _save_figure(files: StagedFiles, figure: Any, path: Path) -> None:
    files.write(path, lambda handle: write_figure(figure, handle))


def _health_table(health: dict[str, Any] | None) -> str:
    if health is None:
        return ""
    cells = "".join(
        f"<td>{'&mdash;' if health[key] is None else f'{health[key]:.3f}'}</td>"
        for key in ("rankme", "effective_rank", "alpha_req", "lidar")
    )
    return (
        "<h2>Label-free health of the backbone</h2><table><tr><th>RankMe</th><th>effective rank</th>"
        "<th>alpha-ReQ</th><th>LiDAR</th><th>samples</th><th>views</th><th>dimension</th></tr>"
        f"<tr>{cells}<td>{health['samples']}</td><td>{health['views']}</td><td>{health['dimension']}</td></tr></table>"
    )


def _write_index(
    files: StagedFiles,
    out: Path,
    title: str,
    notes: list[str],
    figures: list[tuple[str, str]],
    summary: dict,
    health: dict[str, Any] | None = None,
) -> Path:
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{pair['groups']}</td><td>{pair['trivial']:.3f}</td>"
        f"<td>{(pair['eigenvalues'] or [float('nan')])[0]:.3f}</td>"
        f"<td>{sum(pair['eigenvalues'][:10]) / max(1, len(pair['eigenvalues'][:10])):.3f}</td>"
        f"<td>{sum(v < 0.1 for v in pair['eigenvalues'])}</td><td>{sum(v > 0.5 for v in pair['eigenvalues'])}</td>"
        f"<td>{len(pair['eigenvalues'])}</td></tr>"
        for name, pair in summary.items()
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
        f"<h1>{html.escape(title)}</h1>{''.join(f'<p>{html.escape(note)}</p>' for note in notes)}"
        "<table><tr><th>pair</th><th>groups</th><th>trivial (constant function)</th><th>top eigenvalue</th>"
        "<th>mean of top 10</th><th>&lt; 0.1</th><th>&gt; 0.5</th><th>eigenvalues</th></tr>"
        f"{rows}</table>{_health_table(health)}{body}{FIGURES_LOADED_SCRIPT}</body></html>"
    )
    path = out / "index.html"
    files.write_text(path, page)
    return path


def analysis_module(module: LightningModule, internal_layers: list[str] | None = None) -> HFMCAModule:
    """The HFMCA view of any trained module with float64 internal statistics on the backbone: an
    :class:`HFMCAModule` with internal costs as it is; else (an HFMCA-SS(*) run, a baseline, or ``internal_layers``
    given) a module on the same backbone (and, for an HFMCA run, the same projector, head and external cost) with
    internal pairs on ``internal_layers`` (default :func:`~hfmca_lightning.methods.inspection.analysis_layers`: the
    backbone's named stages or its residual blocks), so that any model's layer spectra, heatmaps and basis functions
    come from the same maths (the paper's spectra across supervision types)."""
    if isinstance(module, HFMCAModule) and module.internal_costs is not None and internal_layers is None:
        return module
    backbone = backbone_of(module)
    layers = internal_layers or analysis_layers(backbone)
    if not layers:
        raise ConfigurationError(
            f"{type(backbone).__name__} names no stages (internal_layers) and has no residual blocks to analyse; name "
            "its blocks with --internal_layers (module names of the backbone, e.g. net.layer1.0)"
        )
    projector: nn.Module | None = None
    external_head: GridExternalHead | None = None
    external_cost: HFMCACost | None = None
    if isinstance(module, HFMCAModule) and module.external_head is not None:
        projector, external_head, external_cost = module.projector, module.external_head, module.external_cost
    if internal_layers:  # the pairs in forward order (named_modules' order), as the costs and heatmaps take them
        order = {name: position for position, (name, _) in enumerate(backbone.named_modules())}
        layers = sorted(layers, key=lambda name: order.get(name, len(order)))
    costs = InternalCosts(layers, reg=HOOKED_REG, precision="float64")  # as the training-time spectra of these pairs
    return HFMCAModule(
        backbone,
        projector=projector,
        external_head=external_head,
        external_cost=external_cost,
        internal_costs=costs,
    ).eval()


def analyze(
    ckpt_path: str | Path,
    out: str | Path,
    config_path: str | Path | None = None,
    num_batches: int | None = None,
    num_images: int = 8,
    layers: list[str] | None = None,
    internal_layers: list[str] | None = None,
    image_class: int | None = None,
    first_image: int = 0,
    batch_norm: BatchNormChoice = "auto",
    groups_per_feature: int = GROUPS_PER_FEATURE,
) -> Path:
    """Spectra (PNG + JSON) from training batches (``num_batches``, or as many as give every pair
    ``groups_per_feature`` groups per feature and the health metrics :data:`HEALTH_SAMPLES_PER_DIM` samples per
    dimension), the label-free health of the backbone on the same batches (RankMe, effective rank, alpha-ReQ, LiDAR:
    ``health`` in spectra.json, :class:`HealthSums`), density-ratio heatmaps and basis functions of ``num_images``
    test images at ``layers`` (default: the three lowest internal layers), ``index.html``. BatchNorm: ``batch_norm``
    (:func:`choose_batch_norm`; the choice is printed on the page); with each batch's own, the figures' test images
    are normalised with the statistics of the first training batch (:func:`recorded_batch_norm`), so that an
    image's maps do not depend on the others drawn.

    Any checkpoint of the package: baselines, HFMCA runs without internal costs (and any run given
    ``internal_layers``) are analysed through :func:`analysis_module`."""
    run_module, datamodule = load_run(ckpt_path, config_path)
    module = analysis_module(run_module, internal_layers)
    norm, notes = _batch_norm_for([module], batch_norm)
    if norm == "batch":
        notes[0] += (
            " The figures' test images are normalised with the statistics of the first training batch, so that an "
            "image's maps do not depend on which others are drawn."
        )
    out = Path(out)
    health_sums = HealthSums()
    if module.internal_costs is not None:  # the figures' layers and images, refused before the statistics pass
        names = [pair.log_name for pair in module.internal_costs.pairs]
        unknown = sorted(set(layers or []) - set(names))
        if unknown:
            raise ConfigurationError(
                f"--layers: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not among this model's "
                f"internal cost layers; choose from {' '.join(names)}"
            )
        images, _ = figure_images(datamodule, num_images, target=image_class, start=first_image)

    # With each batch's own BatchNorm statistics, the figures' few test images are normalised with those of the first
    # training batch, recorded as it passes: by a training-sized batch, the same whichever images are drawn with them.
    reference: BatchNormReference = {}

    def collect(batch: Tensor | list[Tensor]) -> dict[str, CorrelationStatistics]:
        if norm == "batch" and not reference:
            with recorded_batch_norm(module) as recorded:
                collected = collect_for_analysis(module, batch, batch_norm=norm)
            reference.update(recorded)
        else:
            collected = collect_for_analysis(module, batch, batch_norm=norm)
        health_sums.add(collected.features, batch)
        return collected.statistics

    with StagedFiles() as files:  # renamed into place together at the end, index.html last
        statistics = _enough_batches(
            _training_batches(datamodule, module.device),
            collect,
            num_batches,
            groups_per_feature,
            "statistics of the training groups",
            also_enough=health_sums.enough,
        )
        regs = {name: cost.reg for name, cost in module.cost_modules().items()}
        summary = spectrum_summary(statistics, regs, groups_per_feature)
        health = health_sums.summary()
        notes += short_window_notes(summary) + health_notes(health)
        files.write_text(
            out / "spectra.json", json.dumps({"batch_norm": norm, "pairs": summary, "health": health}, indent=1)
        )
        _save_figure(
            files,
            layer_spectra_figure(
                {name: pair["eigenvalues"] for name, pair in summary.items()},
                title=f"Spectrum per layer pair ({Path(ckpt_path).name})",
            ),
            out / "spectra.png",
        )
        figures = [
            (
                "spectra.png",
                "Eigenvalues of every pair after the constant function's; red: mean of the 10 largest "
                "(spectra.json has the numbers).",
            )
        ]
        basis_files: set[str] = set()
        if module.internal_costs is not None:
            stage(f"density-ratio heatmaps and basis functions of {len(images)} test images")
            figure_pairs = layer_pairs(module, images, statistics, batch_norm=norm, reference=reference or None)
            pairs = {pair.name: pair for pair in figure_pairs}
            heatmaps = telescoping_response(list(pairs.values()))
            chosen = layers or default_figure_layers(list(heatmaps))
            overlay = heatmap_overlay_figure(
                denormalise(datamodule, images),
                {name: heatmaps[name] for name in chosen},
                placements=heatmap_placements(module),
            )
            _save_figure(files, overlay, out / "density_ratio.png")
            figures.append(
                ("density_ratio.png", f"Global-to-local density-ratio response (Alg. 5) at {', '.join(chosen)}.")
            )
            for name in chosen:
                maps, values = nontrivial_basis_maps(pairs[name])
                if not len(values):  # a one-feature pair: nothing beside the constant function
                    continue
                file = f"basis_{name.replace('/', '_')}.png"
                _save_figure(
                    files,
                    basis_functions_figure(maps, values, title=f"Basis functions of layer {name}, test image 0"),
                    out / file,
                )
                basis_files.add(file)
                figures.append(
                    (
                        file,
                        f"Eigenfunctions (Alg. 4, normalised) of layer {name} on test image 0, after the constant one.",
                    )
                )
        index = _write_index(files, out, f"HFMCA analysis of {ckpt_path}", notes, figures, summary, health)
    for stale in out.glob("basis_*.png"):  # an earlier report's layers (--overwrite): gone once these are in place
        if stale.name not in basis_files:
            stale.unlink(missing_ok=True)
    return index


def _training_batches(datamodule: MultiViewDataModule, device: torch.device) -> Iterator[Tensor | list[Tensor]]:
    """The run's training groups, drawn by its own view spec and drawer (whatever they are), on ``device``:
    ``(B, L, C, H, W)`` or, for views of several sizes, a list of such groups."""
    with closing(view_batches(datamodule, device)) as batches:
        for batch in batches:
            yield batch.groups[0] if len(batch.groups) == 1 else batch.groups


def _positions(feature_map: Tensor) -> Tensor:
    """``(N, C, H, W)`` maps or ``(N, D)`` features -> one row per position ``(N * H * W, C)``."""
    if feature_map.dim() == 2:
        return feature_map
    return feature_map.permute(0, 2, 3, 1).reshape(-1, feature_map.shape[1])


@torch.no_grad()
def _module_outputs(
    module: LightningModule, images: Tensor | list[Tensor], layers: dict[str, str], norm: BatchNormStatistics
) -> dict[str, Tensor]:
    """Output of every backbone module in ``layers`` (``{module name: pair name}``) on ``images``, keyed by pair name,
    plus the features as ``backbone``; or, for ``(B, L, C, H, W)`` groups (a list of them for views of several
    sizes), the external head's output as ``external``."""
    backbone = backbone_of(module)
    outputs: dict[str, Tensor] = {}
    with analysis_mode(module, norm):
        if isinstance(images, list) or images.dim() == 5:
            assert isinstance(module, HFMCAModule)
            return {"external": module.encode_views(images)[1].detach()}
        handles = [
            backbone.get_submodule(name).register_forward_hook(
                lambda _m, _a, output, pair=pair: outputs.__setitem__(pair, output.detach())
            )
            for name, pair in layers.items()
        ]
        try:
            outputs["backbone"] = module(images).detach()
        finally:
            for handle in handles:
                handle.remove()
    return outputs


def comparable_layers(module: LightningModule) -> list[str]:
    """Backbone module names compared by default: the internal-cost layers of an HFMCA run, else
    :func:`~hfmca_lightning.methods.inspection.analysis_layers`."""
    if isinstance(module, HFMCAModule) and module.internal_costs is not None:
        return module.internal_costs.layers
    return analysis_layers(backbone_of(module))


def _has_head(module: LightningModule) -> bool:
    return isinstance(module, HFMCAModule) and module.external_head is not None


def compare(
    ckpt_a: str | Path,
    ckpt_b: str | Path,
    out: str | Path,
    num_batches: int | None = None,
    reg: float = HOOKED_REG,
    layers: list[str] | None = None,
    batch_norm: BatchNormChoice = "auto",
    groups_per_feature: int = GROUPS_PER_FEATURE,
) -> Path:
    """Eigenvalues between the features of two models at each common backbone layer (by module name; pairs named as
    in training, ``internal/<layer>``), at their outputs (``backbone``, left out where it is the last layer's output)
    and, for two HFMCA runs with heads, between their heads' outputs (``external``, the paper's LF) on the same groups:
    values near 1 = parallel eigenfunctions, near 0 = orthogonal (paper Fig. 5). Layers see the test split of model
    A's data, heads its training groups; ``num_batches`` of each, or as many as give every pair
    ``groups_per_feature`` groups per feature. Any two checkpoints of the package. The two models' features at a
    layer may differ in number (channels): the statistics pair each position's ``K1`` and ``K2`` features; a layer
    whose maps differ in spatial size (no common positions) is left out with a note, and an error says so when no
    pair is left."""
    model_a, data_a = load_run(ckpt_a)
    model_b, _ = load_run(ckpt_b)
    names_b = set(dict(backbone_of(model_b).named_modules()))
    if layers is None:
        layers = [name for name in comparable_layers(model_a) if name in names_b]
    missing = [name for name in layers if name not in names_b or name not in dict(backbone_of(model_a).named_modules())]
    if missing:
        raise ConfigurationError(f"--layers {missing} are not modules of both backbones")
    pair_names = dict(zip(layers, (internal_cost_name(log) for log in log_names(layers))))
    norm, notes = _batch_norm_for([model_a, model_b], batch_norm)
    if data_a.evaluation_splits is None:
        raise ConfigurationError("model A's data has no labelled evaluation split to compare on")
    unmatched: dict[str, str] = {}  # pair name -> why it has no statistics: A's and B's shapes

    def cross(images: Tensor | list[Tensor]) -> dict[str, CorrelationStatistics]:
        outputs_a = _module_outputs(model_a, images, pair_names, norm)
        outputs_b = _module_outputs(model_b, images, pair_names, norm)
        last = pair_names[layers[-1]] if layers else None
        if (
            "backbone" in outputs_a
            and last in outputs_a
            and torch.equal(outputs_a[last].flatten(1), outputs_a["backbone"])
        ):
            del outputs_a["backbone"]  # the backbone's output is its last compared layer's
        statistics = {}
        for name, value in outputs_a.items():
            other = outputs_b[name]
            if value.dim() == other.dim() and value.shape[2:] == other.shape[2:]:  # the same positions: any K1, K2
                statistics[name] = group_statistics(_positions(value).double()[:, None], _positions(other).double())
            else:
                unmatched[name] = f"A {_shape_text(value)}, B {_shape_text(other)}"
        return statistics

    statistics = _enough_batches(
        (images for images, _ in data_a.evaluation_loader(QUERIES, tuples=True)),
        cross,
        num_batches,
        groups_per_feature,
        "statistics of both models' layers on test batches",
    )
    if _has_head(model_a) and _has_head(model_b):
        groups = (
            batch for batch in _training_batches(data_a, model_a.device) if isinstance(batch, list) or batch.dim() == 5
        )
        if model_a.external_head.num_views == model_b.external_head.num_views:  # type: ignore[union-attr]  # _has_head
            statistics.update(
                _enough_batches(groups, cross, num_batches, groups_per_feature, "statistics of both heads on groups")
            )
    skipped = [f"{name} ({shapes})" for name, shapes in unmatched.items()]
    if not statistics:
        raise ConfigurationError(
            f"no layer of the two models can be compared: {'; '.join(skipped) or 'no common layer'}. The "
            "cross-spectrum pairs the features at the same positions, so the maps must have the same spatial size "
            "(channels may differ); choose such layers with --layers"
        )
    skip_notes = [
        "Left out, maps of different spatial sizes (the cross-spectrum needs the same positions): "
        f"{'; '.join(skipped)}."
    ]
    summary = spectrum_summary(statistics, dict.fromkeys(statistics, reg), groups_per_feature)
    notes = notes + (skip_notes if skipped else []) + short_window_notes(summary)
    if skipped:
        warn(skip_notes[0])
    out = Path(out)
    title = f"Spectrum across models: {_run_label(ckpt_a, model_a)} vs {_run_label(ckpt_b, model_b)}"
    caption = (
        "Eigenvalues between the features of the two models at each layer after the constant function's "
        "(1: same subspace, 0: orthogonal)."
    )
    checkpoints = {"a": str(ckpt_a), "b": str(ckpt_b)}
    notes = [f"A: {checkpoints['a']}", f"B: {checkpoints['b']}", *notes]
    report = {"checkpoints": checkpoints, "batch_norm": norm, "pairs": summary}
    with StagedFiles() as files:  # renamed into place together at the end, index.html last
        files.write_text(out / "cross_spectra.json", json.dumps(report, indent=1))
        _save_figure(
            files,
            layer_spectra_figure({name: pair["eigenvalues"] for name, pair in summary.items()}, title=title),
            out / "cross_spectra.png",
        )
        return _write_index(files, out, title, notes, [("cross_spectra.png", caption)], summary)


def _shape_text(output: Tensor) -> str:
    """``K x H x W`` of a ``(N, K, H, W)`` map, ``K features`` of ``(N, K)`` outputs."""
    return " x ".join(map(str, output.shape[1:])) if output.dim() > 2 else f"{output.shape[1]} features"


def _run_label(ckpt_path: str | Path, module: LightningModule) -> str:
    return f"{Path(ckpt_path).parent.parent.name} ({type(module).__name__})"


def run_analysis_command(argv: list[str]) -> None:
    """Parse and run ``analyze ...`` or ``compare ...``."""
    parser = options.OneLineParser(prog="hfmca", description="Analysis of trained HFMCA checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("analyze", help="spectra, density-ratio heatmaps and basis functions of one checkpoint")
    one.add_argument("--ckpt_path", required=True)
    one.add_argument(
        "--out", required=True, help="output folder (index.html, PNG, JSON); must be empty unless --overwrite"
    )
    one.add_argument("--config", default=None, help="the run's YAML, for checkpoints not written by `hfmca fit`")
    one.add_argument(
        "--num_batches",
        type=options.positive_int,
        default=None,
        help="training batches for the statistics (default: enough for --groups_per_feature groups per feature)",
    )
    one.add_argument("--num_images", type=options.positive_int, default=8, help="test images for heatmaps")
    one.add_argument("--layers", nargs="*", default=None, help="internal layers to draw (log names such as L2 L4 L6)")
    one.add_argument(
        "--image_class", type=options.non_negative_int, default=None, help="draw only test images of this class"
    )
    one.add_argument(
        "--first_image", type=options.non_negative_int, default=0, help="index of the first test image considered"
    )
    one.add_argument(
        "--internal_layers",
        nargs="*",
        default=None,
        help="backbone modules to analyse (e.g. net.layer1.0); default: an HFMCA run's internal-cost layers, "
        "else the backbone's named stages or residual blocks",
    )
    two = commands.add_parser("compare", help="cross-model eigenvalues per layer of two checkpoints")
    two.add_argument("--ckpt_a", required=True)
    two.add_argument("--ckpt_b", required=True)
    two.add_argument(
        "--out", required=True, help="output folder (index.html, PNG, JSON); must be empty unless --overwrite"
    )
    two.add_argument(
        "--num_batches",
        type=options.positive_int,
        default=None,
        help="test batches of model A's data (default: enough for --groups_per_feature groups per feature)",
    )
    two.add_argument(
        "--layers",
        nargs="*",
        default=None,
        help="backbone module names (default: A's internal-cost layers or residual blocks)",
    )
    for command in (one, two):
        command.add_argument(
            "--batch_norm",
            choices=("auto", "running", "batch"),
            default="auto",
            help="BatchNorm statistics: running (eval mode), batch (each batch's own, as in training); auto: batch "
            f"while the running ones have seen fewer than {YOUNG_BATCH_NORM} batches, with a warning",
        )
        command.add_argument(
            "--groups_per_feature",
            type=options.positive_int,
            default=None,
            help=(
                f"groups per feature the statistics need at least, without --num_batches (default {GROUPS_PER_FEATURE})"
            ),
        )
        command.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = parser.parse_args(argv)
    if args.num_batches is not None and args.groups_per_feature is not None:
        raise ConfigurationError(
            "--num_batches and --groups_per_feature both say how many batches the statistics take: give one"
        )
    args.groups_per_feature = GROUPS_PER_FEATURE if args.groups_per_feature is None else args.groups_per_feature
    if args.command == "analyze":
        if args.config is not None:
            read_config_file(args.config)  # a file that is no YAML mapping: one line, before any work
        check_checkpoint_path(args.ckpt_path)  # before the output folder is made
    else:
        check_checkpoint_path(args.ckpt_a, "--ckpt_a")
        check_checkpoint_path(args.ckpt_b, "--ckpt_b")
    check_out(args.out, args.overwrite)
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
            args.batch_norm,
            args.groups_per_feature,
        )
    else:
        index = compare(
            args.ckpt_a,
            args.ckpt_b,
            args.out,
            args.num_batches,
            layers=args.layers,
            batch_norm=args.batch_norm,
            groups_per_feature=args.groups_per_feature,
        )
    print(f"wrote {index}")
