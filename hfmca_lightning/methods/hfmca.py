"""HFMCA-SS(*): self-supervised training with the external cost (paper §3, Alg. 1; docs/conventions.md §2)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation.batch_norm import frozen_batch_norm_statistics
from hfmca_lightning.losses.cost_checks import CostChecks, CostFactorisationError, merge_checks
from hfmca_lightning.losses.distributed import all_reduce_max, all_reduce_statistics_together
from hfmca_lightning.losses.hfmca_cost import FilterUpdate, HFMCACost, apply_filter_updates, cost_values
from hfmca_lightning.losses.statistics import CorrelationStatistics, StatisticsPrecision, group_statistics
from hfmca_lightning.methods.compatibility import (
    check_batch_format,
    check_batch_norm_batch_size,
    check_crop_grids,
    check_feature_sizes,
    check_image_size,
    check_strategy,
    load_checked_state_dict,
)
from hfmca_lightning.methods.deferred_checks import (
    DeferredChecks,
    NonFiniteStepError,
    SkipUpdateIfFailed,
    nonfinite_gradients,
    training_stopped_at,
)
from hfmca_lightning.methods.evaluation_steps import KNNFeatureSteps
from hfmca_lightning.methods.internal_costs import InternalCosts
from hfmca_lightning.methods.optim import LRSchedulerCallable, OptimizerCallable, configure_optimizers
from hfmca_lightning.models.heads import GridExternalHead

# compile_costs: compiled (CUDA graphs) on CUDA devices, eager on any other.
CUDA_ONLY = "cuda"

__all__ = [
    "CUDA_ONLY",
    "Collected",
    "HFMCAModule",
    "Objective",
    "ObjectiveValues",
    "objective_values",
]


@dataclass
class Collected:
    """The result of :meth:`HFMCAModule.collect`, by cost name (``external``, ``internal/L3``).

    ``statistics``: each pair's statistics of this process's batch. ``maps``: internal pairs' detached
    ``(input map (N, C, H, W), output map (N, C', H', W'))`` when asked. ``features``: the backbone output
    ``(N, D)`` of every image the backbone saw (``B * L`` views for groups: each image's views together, those of
    the first group first).
    """

    statistics: dict[str, CorrelationStatistics]
    maps: dict[str, tuple[Tensor, Tensor]]
    features: Tensor


@dataclass
class Objective:
    """The result of :meth:`HFMCAModule.objective`: the ``total`` to minimise (0-dim float64), each cost by
    name, the global-batch statistics they were taken from, and the checks of their factorisations and of the
    total's finiteness (read, or still on the device: see :meth:`HFMCAModule.objective`)."""

    total: Tensor
    costs: dict[str, Tensor]
    statistics: dict[str, CorrelationStatistics]
    checks: CostChecks


class ObjectiveValues(NamedTuple):
    """The result of :func:`objective_values`: each cost's value, the ``total``, the ``(N, 7)`` checks ``state`` of
    :class:`CostChecks`, ``total_failed`` (``()`` int64, 1 if the total is not finite) and the adaptive filters'
    updates (:class:`~hfmca_lightning.losses.hfmca_cost.FilterUpdate`, None for unfiltered costs)."""

    values: list[Tensor]
    total: Tensor
    state: Tensor
    total_failed: Tensor
    filters: list[FilterUpdate | None]


def objective_values(
    statistics: list[CorrelationStatistics], costs: list[HFMCACost], has_external: bool, internal_weight: float
) -> ObjectiveValues:
    """The cost path of a training step, statistics -> costs -> total (paper §4: ``external + lambda * sum
    internal``). ``costs[0]`` is the external cost when ``has_external``. Static shapes, no host reads and no writes
    to buffers: what ``HFMCAModule(compile_costs=True)`` compiles (``torch.compile(fullgraph=True)``; CUDA graphs on
    GPUs)."""
    values, state, filters = cost_values(statistics, costs)
    total = torch.zeros((), dtype=torch.float64, device=values[0].device)
    if has_external:
        total = total + values[0]
    internal = values[1:] if has_external else values
    if internal:
        total = total + internal_weight * torch.stack(internal).sum()
    return ObjectiveValues(values, total, state, (~torch.isfinite(total)).to(torch.int64), filters)


class _HookGuardedCompile:
    """``torch.compile(module)`` whose guards include the module's hooks. TorchDynamo by default does not guard on
    module hooks: a graph compiled for one backbone without hooks is reused for another instance of the same class
    that has the internal costs' hooks, which then never run. The setting is TorchDynamo's
    ``skip_nnmodule_hook_guards``, applied around this module's calls only (compilation happens inside them), so no
    other compile in the process is affected; guarding on hooks costs a few checks per call."""

    def __init__(self, module: nn.Module) -> None:
        self.compiled = torch.compile(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return self.compiled(*args, **kwargs)


def _recompute_without_bn_updates(module: nn.Module) -> tuple[Any, Any]:
    """Contexts of ``torch.utils.checkpoint``: the first forward as usual; the recomputation in the backward
    pass with BatchNorm momentum 0, so running statistics are updated once per step, not twice."""
    return nullcontext(), frozen_batch_norm_statistics(module)


class HFMCAModule(KNNFeatureSteps, LightningModule):
    """HFMCA: backbone (+ internal costs) -> per-view projector -> external head LF (+ external cost).

    The three scenarios of paper §5 are configurations of this one module:

    * self-supervised, HFMCA-SS(*): ``external_head`` only; batches of L views per image;
    * HFMCA-SS / supervised: ``external_head`` and ``internal_costs``; L views or L same-class images;
    * unsupervised: ``internal_costs`` only, no head; batches of single images ``(B, C, H, W)`` work.

    A batch ``(views (B, L, C, H, W), target)`` is encoded as one ``(B*L, C, H, W)`` batch; the ``L``
    view features ``(B, L, K)`` are the low level and the head output ``(B, K)`` the high level of the
    external cost. The objective is ``external + internal_costs.weight * sum(internal)``, logged as
    ``cost/total`` with each part under ``cost/external`` and ``cost/internal/<layer>``. kNN evaluation
    uses the backbone output (``validation_step`` returns it).

    A training step reads no device value on the host: the checks of every factorisation and of the total's
    finiteness stay on the device (max-reduced over processes under DDP), where a failure makes the optimizer skip
    the step's update; they reach the host by an asynchronous copy and are read once the next step is queued, or
    before a checkpoint is written, so a failed step still ends the run with one line (every process at the same
    step) and no checkpoint holds it (:mod:`~hfmca_lightning.methods.deferred_checks`). The costs go to the
    logger every ``log_every_n_steps`` and to the progress bar asynchronously
    (:class:`~hfmca_lightning.callbacks.CostProgressBar`).

    Args:
        backbone: images ``(N, 3, H, W)`` -> ``(N, D)``.
        projector: ``(N, D)`` -> ``(N, K)`` view features; ``None`` feeds the backbone output to the head.
        external_head: ``(B, L, K)`` -> ``(B, K)``; its ``num_views`` must equal the data's. ``None``: no
            external cost (unsupervised scenario).
        external_cost: default ``HFMCACost(reg=0.1, beta=0)``.
        internal_costs: hooks on backbone blocks, see :class:`InternalCosts`.
        optimizer: builds the optimiser from the module's parameter groups (the CLI's ``class_path`` /
            ``init_args``, e.g. ``torch.optim.AdamW`` or ``lightly.utils.lars.LARS``, without the parameters);
            ``None``: SGD lr 0.06, momentum 0.9, weight decay 5e-4 (paper Table 1;
            :func:`~hfmca_lightning.methods.optim.configure_optimizers`).
        lr_scheduler: builds the learning-rate schedule from that optimiser (the CLI's ``class_path`` /
            ``init_args`` without the optimiser); ``None``: cosine annealing to 0 over the run, after
            ``warmup_epochs`` of warm-up (:func:`~hfmca_lightning.methods.optim.cosine_schedule`). Not with
            ``warmup_epochs`` > 0; ``ReduceLROnPlateau`` is refused (there is no monitored metric).
        views_through_backbone: ``concat`` (default; one ``(B*L, ...)`` batch: fastest, BN statistics over
            all views) or ``per_view`` (L backbone calls of ``B`` images: BN statistics per view).
        channels_last: run the backbone in channels-last memory format (faster convolutions on GPUs).
        compile_backbone: wrap the backbone's forward in ``torch.compile`` (weights and checkpoints are
            unchanged). With internal costs the backbone graph breaks at each hooked block, whose statistics
            run eagerly; its compiled graphs guard on module hooks (other compiles in the process are unaffected).
        checkpoint_backbone: activation checkpointing of the backbone in training: its activations are
            recomputed in the backward pass instead of kept (about a third more compute, a fraction of
            the memory). BatchNorm running statistics are updated once, as without it. Not with internal
            costs (their statistics come from the activations).
        backbone_chunk_size: pass the ``B * L`` views through the backbone in chunks of this many images.
            With ``checkpoint_backbone``, peak memory is then that of one chunk. Each chunk is a separate
            BatchNorm batch (like ``per_view``).
        warmup_epochs: epochs (fractions allowed) of linear learning-rate warm-up before the default cosine
            schedule, both per optimiser step (lightly's ``CosineWarmupScheduler``); 0: no warm-up (the paper's
            per-epoch cosine when the run is whole epochs). Not with an ``lr_scheduler``.
        weight_decay_on_bias_and_norm: ``false`` exempts biases and normalisation parameters from weight
            decay (and from LARS's layer-wise scaling), as large-batch SSL recipes do.
        compile_costs: compile the cost path (:func:`objective_values`: every pair's factorisations, the costs
            and the total) with ``torch.compile(fullgraph=True)``, on CUDA with ``mode="reduce-overhead"`` (one
            CUDA graph instead of a few hundred small launches per step). The statistics stay eager. ``true``:
            torch's default backend (inductor); a string names another ``torch.compile`` backend (``aot_eager``
            checks that the path compiles as one graph without inductor's C++ compilation, as the tests do);
            ``"cuda"``: as ``true`` on CUDA devices and eager elsewhere (one config for GPUs and CPUs).

    Raises:
        ConfigurationError: when ``views_through_backbone`` is neither ``concat`` nor ``per_view``; there is
            neither an ``external_head`` nor ``internal_costs``, or only internal costs of weight 0; a
            ``projector`` or ``external_cost`` is given without an ``external_head``; ``checkpoint_backbone`` is
            combined with ``internal_costs``; ``backbone_chunk_size`` < 1; ``warmup_epochs`` is negative or not
            finite; the backbone's, projector's and head's feature sizes disagree; ``compile_costs`` names no
            ``torch.compile`` backend; or an internal cost layer is not a usable module of the backbone.
        RuntimeError: when ``internal_costs`` is already attached to a backbone (each module needs its own).
    """

    _backbone_forward: Callable[[Tensor], Tensor]  # the backbone or its compiled forward, set in __init__

    def __init__(
        self,
        backbone: nn.Module,
        projector: nn.Module | None = None,
        external_head: GridExternalHead | None = None,
        external_cost: HFMCACost | None = None,
        internal_costs: InternalCosts | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        views_through_backbone: Literal["concat", "per_view"] = "concat",
        channels_last: bool = False,
        compile_backbone: bool = False,
        checkpoint_backbone: bool = False,
        backbone_chunk_size: int | None = None,
        warmup_epochs: float = 0.0,
        weight_decay_on_bias_and_norm: bool = True,
        compile_costs: bool | str = False,
    ) -> None:
        super().__init__()
        if views_through_backbone not in ("concat", "per_view"):
            raise ConfigurationError(
                f"views_through_backbone must be 'concat' or 'per_view'; got {views_through_backbone!r}"
            )
        if external_head is None and internal_costs is None:
            raise ConfigurationError(
                "HFMCAModule needs an external_head, internal_costs, or both: there is no cost to train"
            )
        if external_head is None and internal_costs is not None and internal_costs.weight == 0:
            raise ConfigurationError(
                "internal_costs.weight is 0 and there is no external_head: no cost would train the model; give the "
                "internal costs a weight > 0",
                parameter="weight",
            )
        if external_head is None and (projector is not None or external_cost is not None):
            raise ConfigurationError("projector / external_cost are given but there is no external_head to use them")
        if checkpoint_backbone and internal_costs is not None:
            raise ConfigurationError(
                "checkpoint_backbone recomputes the backbone's activations in the backward pass, but internal costs "
                "take "
                "their statistics from those activations: use one or the other",
                parameter="checkpoint_backbone",
            )
        if backbone_chunk_size is not None and backbone_chunk_size < 1:
            raise ConfigurationError(
                f"backbone_chunk_size must be >= 1 or null; got {backbone_chunk_size}", parameter="backbone_chunk_size"
            )
        if not 0 <= warmup_epochs < math.inf:  # NaN too
            raise ConfigurationError(
                f"warmup_epochs must be finite and >= 0; got {warmup_epochs}", parameter="warmup_epochs"
            )
        check_feature_sizes(backbone, projector, external_head)
        if isinstance(compile_costs, str) and compile_costs != CUDA_ONLY:
            backends = torch._dynamo.list_backends(exclude_tags=())
            if compile_costs not in backends:
                raise ConfigurationError(
                    f"compile_costs: {compile_costs!r} is not a torch.compile backend; use true (the default "
                    f"backend), {CUDA_ONLY!r} (CUDA graphs on GPUs, eager elsewhere) or one of {', '.join(backends)}",
                    parameter="compile_costs",
                )
        # Modules and optimiser callables are not hyper-parameters (and would make checkpoints unloadable
        # with weights_only=True); the hfmca CLI stores the whole config in every checkpoint instead.
        self.save_hyperparameters(
            ignore=[
                "backbone",
                "projector",
                "external_head",
                "external_cost",
                "internal_costs",
                "optimizer",
                "lr_scheduler",
            ]
        )
        self.backbone = backbone
        self.projector = projector if projector is not None else nn.Identity()
        self.external_head = external_head
        self.external_cost = None
        if external_head is not None:
            self.external_cost = (
                external_cost if external_cost is not None else HFMCACost(reg=0.1, beta=0.0, name="external")
            )
        self.internal_costs = internal_costs
        if internal_costs is not None:
            try:
                internal_costs.attach(self.backbone)
            except ConfigurationError as error:  # named where the config gives the layers
                raise ConfigurationError(str(error), parameter=f"internal_costs.init_args.{error.parameter}") from None
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.views_through_backbone = views_through_backbone
        self.checkpoint_backbone = checkpoint_backbone
        self.backbone_chunk_size = backbone_chunk_size
        self.warmup_epochs = warmup_epochs
        self.weight_decay_on_bias_and_norm = weight_decay_on_bias_and_norm
        self.channels_last = channels_last
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        # Not registered as a submodule, so state_dict keys stay those of the plain backbone.
        object.__setattr__(
            self, "_backbone_forward", _HookGuardedCompile(self.backbone) if compile_backbone else self.backbone
        )
        self.compile_costs = compile_costs
        self._cost_path: Any = None  # objective_values, compiled on first use with compile_costs
        self._pending_checks: list[CostChecks] = []  # the checks of the micro-batches of the step being taken
        self._deferred_checks = DeferredChecks()  # the checks of steps taken, on their way to the host
        self._skip_failed_update = SkipUpdateIfFailed()

    def embed(self, images: Tensor) -> Tensor:
        """Backbone features ``(N, D)`` of ``(N, C, H, W)`` images (through the compiled forward if enabled). Images of
        another floating dtype than the weights (bfloat16 views drawn on the device) are cast to the weights' dtype
        where no autocast does it (evaluation, a ``32-true`` run)."""
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        weights = next(self.backbone.parameters(), None)
        if (
            weights is not None
            and images.is_floating_point()
            and images.dtype != weights.dtype
            and not torch.is_autocast_enabled(images.device.type)
        ):
            images = images.to(weights.dtype)
        return self._backbone_forward(images)

    def _embed_for_training(self, images: Tensor) -> Tensor:
        """:meth:`embed`, in chunks of ``backbone_chunk_size`` and with activation checkpointing if configured."""
        chunks = images.split(self.backbone_chunk_size) if self.backbone_chunk_size else (images,)
        if self.checkpoint_backbone and torch.is_grad_enabled():
            features = [
                checkpoint(
                    self.embed,
                    chunk,
                    use_reentrant=False,
                    context_fn=partial(_recompute_without_bn_updates, self.backbone),
                )
                for chunk in chunks
            ]
        else:
            features = [self.embed(chunk) for chunk in chunks]
        return features[0] if len(features) == 1 else torch.cat(features)

    def setup(self, stage: str) -> None:
        check_strategy(self, self.trainer.strategy)
        datamodule = getattr(self.trainer, "datamodule", None)
        check_image_size(self.backbone, datamodule)
        check_batch_format(self, datamodule)
        num_views = getattr(datamodule, "num_views", None)
        if self.external_head is not None and num_views is not None and num_views != self.external_head.num_views:
            grid, wanted = self.external_head.grid, self.external_head.num_views
            raise ConfigurationError(
                f"data.init_args.views gives {num_views} views per image, but the external head's "
                f"{grid[0]}x{grid[1]} grid takes {wanted}: make them {wanted} "
                "(SimCLRViews' count; MultiCrop's global_crops + local_crops) or change the head's grid_height / "
                "grid_width to match"
            )
        if self.external_head is not None and getattr(datamodule, "single_view", False):
            raise ConfigurationError(
                "SingleView gives one image per sample, but the external head needs groups of views"
            )
        if stage == "fit":
            self._check_training_batches(datamodule)

    def _check_training_batches(self, datamodule: Any) -> None:
        """Training batches this module cannot take, refused before the first step: batches with crop grids
        (``(views, targets, grids)``, VICRegL's), and one sample per process where a BatchNorm layer normalises over
        the samples alone and needs two: the external head's (its last maps are 1x1, one per image), and a backbone's
        ``BatchNorm1d`` when the views go through it one at a time (``per_view``; ``concat`` gives it ``B * L`` rows,
        as the projector has); a ``BatchNorm2d`` also normalises over the map's positions."""
        check_crop_grids(self, datamodule)
        modules = list(self.named_modules())
        # the external head's last first (on its 1x1 maps), then a backbone's BatchNorm1d seeing one view at a time
        head = [name for name, child in modules if name.startswith("external_head.") and isinstance(child, _BatchNorm)]
        layers = head[::-1]
        if self.views_through_backbone == "per_view":
            layers += [
                name for name, child in modules if name.startswith("backbone.") and type(child) is nn.BatchNorm1d
            ]
        check_batch_norm_batch_size(self, datamodule, layers)

    def forward(self, images: Tensor) -> Tensor:
        """Backbone features ``(N, D)`` of un-augmented images (what kNN evaluates)."""
        return self.embed(images)

    def encode_views(self, views: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``(B, L, C, H, W)`` views (or groups of them of different sizes) -> view features ``(B, L, K)`` and group
        features ``(B, K)``."""
        _, view_features, group_features = self._encode_groups(views)
        return view_features, group_features

    def _encode_groups(self, views: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(B, L, C, H, W)`` views, or a list of groups ``(B, n_g, C, H_g, W_g)`` of different sizes (multi-crop:
        each group through the backbone on its own, the features of all ``L`` views together) -> backbone features
        ``(B * L, D)`` (view-major within each image), view features ``(B, L, K)``, group features ``(B, K)``."""
        groups = [views] if isinstance(views, Tensor) else list(views)
        if self.external_head is None or any(group.dim() != 5 for group in groups):
            shapes = [tuple(group.shape) for group in groups]
            raise ValueError(
                f"encode_views needs an external head and views of shape (B, L, C, H, W) (or a list of such groups); "
                f"got {shapes}"
            )
        batch = groups[0].shape[0]
        per_group = [self._embed_group(group).view(batch, group.shape[1], -1) for group in groups]
        features = torch.cat(per_group, dim=1) if len(per_group) > 1 else per_group[0]
        num_views = features.shape[1]
        view_features = self.projector(features.flatten(0, 1)).reshape(batch, num_views, -1)
        return features.flatten(0, 1), view_features, self.external_head(view_features)

    def _embed_group(self, views: Tensor) -> Tensor:
        """``(B, n, C, H, W)`` -> backbone features ``(B * n, D)``, as ``views_through_backbone`` says."""
        if self.views_through_backbone == "concat":
            return self._embed_for_training(views.flatten(0, 1))
        return torch.stack([self._embed_for_training(views[:, view]) for view in range(views.shape[1])], dim=1).flatten(
            0, 1
        )

    def collect(
        self, batch: Tensor | Sequence[Tensor], keep_maps: bool = False, precision: StatisticsPrecision | None = None
    ) -> Collected:
        """The one forward pass of the module: the statistics of every cost pair of ``batch``.

        ``batch`` is ``(B, L, C, H, W)`` groups (the external pair needs them; the backbone sees ``B * L``
        images), a list of such groups of different view sizes (multi-crop: the external cost groups all of an
        image's views, and each hooked block's statistics add up over the groups' passes) or ``(B, C, H, W)``
        images (internal pairs only). Statistics are this process's, not yet
        synchronised across ranks, keyed by cost name (``external``, ``internal/L3``); with ``keep_maps`` the
        internal pairs' detached ``(input map, output map)`` come too. ``precision`` overrides the internal
        costs' statistics precision (analysis uses ``float64``). Training, the callbacks, inspection and
        ``hfmca analyze`` all go through here.
        """
        with (
            self.internal_costs.record(keep_maps, precision)
            if self.internal_costs is not None
            else nullcontext() as recording
        ):
            groups = [batch] if isinstance(batch, Tensor) else list(batch)
            grouped = self.external_head is not None and groups[0].dim() == 5
            if grouped:
                features, view_features, group_features = self._encode_groups(groups)
            else:  # each image's views together, the first group's first (as _encode_groups orders them)
                batch_size = groups[0].shape[0]
                features = torch.cat(
                    [
                        (self._embed_group(group) if group.dim() == 5 else self._embed_for_training(group)).unflatten(
                            0, (batch_size, -1)
                        )
                        for group in groups
                    ],
                    dim=1,
                ).flatten(0, 1)
        statistics: dict[str, CorrelationStatistics] = {}
        if grouped:
            statistics["external"] = group_statistics(view_features, group_features)
        maps: dict[str, tuple[Tensor, Tensor]] = {}
        if self.internal_costs is not None:
            assert recording is not None  # the internal costs recorded this pass
            names = [pair.cost_name for pair in self.internal_costs.pairs]  # configured order
            missing = [name for name in names if name not in recording.statistics]
            if missing:
                raise RuntimeError(f"internal cost layers {missing} did not run in the backbone's forward pass")
            statistics.update({name: recording.statistics[name] for name in names})
            maps = {name: recording.maps[name] for name in names if name in recording.maps}
        return Collected(statistics, maps, features)

    def objective(self, collected: Collected, *, check: bool = True) -> Objective:
        """The paper's objective ``external + weight * sum(internal)`` from a batch's local statistics.

        Statistics are synchronised across ranks first (every pair of costs with ``sync_dist`` in one collective),
        so the value and gradients are those of the global batch. With ``check``, a failed factorisation or a
        non-finite total raises :class:`CostFactorisationError` naming the step (one host read); without it the
        checks are left on the device in ``Objective.checks`` (what a training step does).
        """
        cost_modules = self.cost_modules()
        names = list(collected.statistics)
        costs = [cost_modules[name] for name in names]
        statistics = list(collected.statistics.values())
        synced = [position for position, cost in enumerate(costs) if cost.sync_dist]
        for position, stats in zip(
            synced, all_reduce_statistics_together([statistics[position] for position in synced])
        ):
            statistics[position] = stats
        for stats, cost in zip(statistics, costs):
            if cost.filtering():
                cost.prepare_filter(stats)
        weight = self.internal_costs.weight if self.internal_costs is not None else 0.0
        device = statistics[0].low_outer_sum.device
        values, total, state, total_failed, filters = self._cost_path_function(device)(
            statistics, costs, names[0] == "external", weight
        )
        if self._cuda_graphs(device):
            # Outputs of the CUDA graph, which its next replay (the next micro-batch) overwrites: the checks wait for
            # the optimizer step, so they are copied out (the filters' candidates are copied just below).
            state, total_failed = state.clone(), total_failed.clone()
        apply_filter_updates(costs, filters)
        checks = CostChecks(
            state,
            tuple(names),
            tuple((stats.low_dim, stats.high_dim) for stats in statistics),
            tuple(cost.reg for cost in costs),
            total_failed,
        )
        objective = Objective(total, dict(zip(names, values)), dict(zip(names, statistics)), checks)
        if check:
            self._raise_if_failed(checks)
        return objective

    def _compiled(self, device: torch.device) -> bool | str:
        """``compile_costs`` as it applies on ``device`` (``"cuda"``: true on CUDA devices, false elsewhere)."""
        if self.compile_costs == CUDA_ONLY:
            return device.type == "cuda"
        return self.compile_costs

    def _cuda_graphs(self, device: torch.device) -> bool:
        """Whether the cost path runs as CUDA graphs on ``device``."""
        return self._compiled(device) is True and device.type == "cuda"

    def _cost_path_function(self, device: torch.device) -> Any:
        """:func:`objective_values`, compiled on the first call with ``compile_costs`` (CUDA graphs on CUDA)."""
        compiled = self._compiled(device)
        if not compiled:
            return objective_values
        if self._cost_path is None:
            options: dict[str, Any] = {"fullgraph": True, "dynamic": False}
            if isinstance(compiled, str):
                options["backend"] = compiled
            else:
                options["mode"] = "reduce-overhead" if device.type == "cuda" else None
            self._cost_path = torch.compile(objective_values, **options)
        if self._cuda_graphs(device):
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the previous step's graph outputs are done with
        return self._cost_path

    def _raise_if_failed(self, checks: CostChecks) -> None:
        try:
            checks.raise_if_failed()
        except CostFactorisationError as error:
            raise self._stopped(self.global_step, self.current_epoch, error) from None

    @staticmethod
    def _stopped(
        step: int, epoch: int, error: CostFactorisationError | NonFiniteStepError
    ) -> CostFactorisationError | NonFiniteStepError:
        return type(error)(
            f"{training_stopped_at(step, epoch)}: {error}. "
            "Checkpoints written before this step are intact: resume from one with a lower learning rate "
            "or a larger `reg`."
        )

    def raise_if_a_step_failed(self) -> None:
        """Read the checks of the optimizer steps taken since the last read (waiting for their asynchronous copies,
        not for the device's queue) and raise the :class:`CostFactorisationError` (or, for finite costs with
        non-finite gradients, the :class:`NonFiniteStepError`) of the first that failed. Called
        once the next step is queued, and before a checkpoint is written, validation starts, training ends or a
        callback decomposes features (EigenspectrumCallback, HealthMetrics)."""
        failure = self._deferred_checks.first_failure()
        if failure is not None:
            raise self._stopped(failure.step, failure.epoch, failure.error) from None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Any]:
        """Logs ``cost/total`` and each ``cost/<name>``; returns ``{"loss", "statistics", "features", "progress_bar"}``:
        the global-batch statistics of every pair and this process's backbone features (detached) go on to
        ``on_train_batch_end`` hooks, where :class:`~hfmca_lightning.callbacks.EigenspectrumCallback` turns them into
        spectra and RankMe, and the costs shown by
        :class:`~hfmca_lightning.callbacks.CostProgressBar`. No device value is read here: the step's checks guard
        its update in :meth:`on_before_optimizer_step`."""
        images, _ = batch
        collected = self.collect(images)
        objective = self.objective(collected, check=False)
        self._pending_checks.append(objective.checks)
        for name, cost in objective.costs.items():
            self.log(f"cost/{name}", cost)
        self.log("cost/total", objective.total)
        self.log("train/loss", objective.total)
        shown = "cost/external" if "external" in objective.costs else "cost/total"
        return {
            "loss": objective.total,
            "statistics": {name: stats.detach() for name, stats in objective.statistics.items()},
            "features": collected.features.detach(),
            "progress_bar": {
                shown: (objective.costs["external"] if "external" in objective.costs else objective.total).detach()
            },
        }

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Read the previous step's checks (this step's work is queued by now), then guard this step's update: its
        checks and the finiteness of its gradients (:func:`nonfinite_gradients`; without a gradient scaler, which
        skips such steps itself), merged over micro-batches and max-reduced over processes on the device, make the
        optimizer leave the weights as they are if anything failed on any process (:class:`SkipUpdateIfFailed`), and
        travel to the host for the next read (:meth:`raise_if_a_step_failed`). No device value is read on the host."""
        self.raise_if_a_step_failed()
        if not self._pending_checks:
            return
        checks, self._pending_checks = merge_checks(self._pending_checks), []
        scaler = getattr(getattr(self._trainer, "precision_plugin", None), "scaler", None)
        gradients = None if scaler is not None else nonfinite_gradients(optimizer)
        packed = checks.packed() if gradients is None else torch.cat([checks.packed(), gradients.to(torch.int64)])
        packed = all_reduce_max(packed)
        self._deferred_checks.push(
            checks, packed, self.global_step, self.current_epoch, gradient_flag=gradients is not None
        )
        self._skip_failed_update.arm(optimizer, packed.any(), in_kernel=scaler is None)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().optimizer_step(*args, **kwargs)
        finally:
            self._skip_failed_update.finish()

    def on_validation_start(self) -> None:
        self.raise_if_a_step_failed()

    def on_train_end(self) -> None:
        self.raise_if_a_step_failed()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.raise_if_a_step_failed()  # never a checkpoint of a failed step

    def cost_modules(self) -> dict[str, HFMCACost]:
        """Every cost of the model by cost name: ``external`` and ``internal/<layer>``."""
        modules: dict[str, HFMCACost] = {}
        if self.external_cost is not None:
            modules["external"] = self.external_cost
        if self.internal_costs is not None:
            modules.update(self.internal_costs.cost_modules())
        return modules

    def configure_optimizers(self) -> Any:
        return configure_optimizers(
            self, self.optimizer_factory, self.scheduler_factory, self.warmup_epochs, self.weight_decay_on_bias_and_norm
        )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; the state of another architecture is one clear error when ``strict``
        (:func:`~hfmca_lightning.methods.compatibility.load_checked_state_dict`)."""
        return load_checked_state_dict(self, state_dict, strict, assign)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._deferred_checks = DeferredChecks()  # the state of a good step: a failure of this object's is gone
