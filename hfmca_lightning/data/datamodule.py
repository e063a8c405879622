"""``MultiViewDataModule``: a view spec's training batches and the evaluation loaders (docs/conventions.md §5)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, Dataset

from hfmca_lightning.data.batch_formats import BATCH_FORMATS, DICT_FORMATS, BatchFormat, format_batch
from hfmca_lightning.data.datasets import EvalDataset, SeededRandomSampler
from hfmca_lightning.data.drawers import DrawSetup, TorchvisionDrawer, ViewDrawer, check_drawer
from hfmca_lightning.data.sources import ImageSource, LabelledImages
from hfmca_lightning.data.transforms import eval_transform
from hfmca_lightning.data.view_specs import SimCLRViews, TransformViews, ViewSpec
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least, check_choice
from hfmca_lightning.runtime.workers import cores_per_process, leave_signals_to_the_main_process, track

__all__ = ["BANK", "EVALUATION_LOADERS", "QUERIES", "MultiViewDataModule", "TrainingPosition", "training_position"]

BANK, QUERIES = 0, 1  # the evaluation loaders' indices: the kNN bank (train split) and the queries (test split)
EvaluationLoaders = Literal["bank_and_queries", "queries"]
EVALUATION_LOADERS: tuple[EvaluationLoaders, ...] = get_args(EvaluationLoaders)


@dataclass(frozen=True)
class TrainingPosition:
    """How far training got: ``samples_seen`` training samples (all ranks together) of epoch ``epoch``;
    ``epoch_ended``: that epoch's end hooks ran before it was through (``max_steps`` or ``max_time`` ended it)."""

    epoch: int
    samples_seen: int
    epoch_ended: bool = False


def training_position(trainer: Trainer, batch_size: int) -> TrainingPosition:
    """The position after the last batch the loop finished (the loader runs ahead by its prefetch), where a checkpoint
    written now resumes; a finished epoch is the next one's start, an epoch cut short keeps its position
    (:class:`TrainingPosition`)."""
    epochs: Any = trainer.fit_loop.epoch_progress.current  # _ProcessedTrackers at run time; the stubs: their base
    epoch = max(epochs.started - 1, 0)  # the batches' epoch
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
    if batches >= trainer.num_training_batches:
        return TrainingPosition(epoch + 1, 0)
    return TrainingPosition(epoch, batches * batch_size * trainer.world_size, 0 < epochs.started <= epochs.processed)


def _collate(drawer: ViewDrawer, batch_format: BatchFormat | None, views: ViewSpec, samples: list[Any]) -> Any:
    """The training loader's collate: the drawer's batch in ``batch_format`` (None: as the drawer gives it)."""
    batch = drawer.collate(samples)
    return batch if batch_format is None else format_batch(batch, batch_format, views.single_view, views.global_views)


class MultiViewDataModule(LightningDataModule):
    """Multi-view batches for HFMCA and any other SSL method: ``views`` says what to draw, ``drawer`` where. Views come
    from the sampler's per-sample seeds, whatever the number of workers; :meth:`state_dict` (in every checkpoint)
    records the position, so a resumed run matches an uninterrupted one.

    Args:
        source: where the images come from (``CIFAR``, ``ImageFolderSource``, ``DatasetSource``, ...).
        views: what to draw (:mod:`hfmca_lightning.data.view_specs`; default ``SimCLRViews()``: two SimCLR views), or
            any callable image -> list of views, such as lightly's ``SimCLRTransform``.
        drawer: where to draw them (:mod:`hfmca_lightning.data.drawers`; default ``TorchvisionDrawer()``).
        batch_format: ``stacked`` (this project's modules), ``lightly``, ``solo``, ``dict`` or ``dict_named``
            (stable-pretraining); layouts: :mod:`hfmca_lightning.data.batch_formats`.
        evaluation_loaders: ``bank_and_queries`` (``BANK`` 0 and ``QUERIES`` 1: :meth:`evaluation_loader`) or
            ``queries`` (the test split's alone, for a ``validation_step`` without a loader index; kNN then reads its
            bank from :meth:`evaluation_loader`).
        batch_size: samples (source images) per training batch and process.
        eval_batch_size: images per evaluation batch.
        num_workers: data-loader worker processes, capped to the CPU cores this process may use.
        persistent_workers: keep the workers alive between epochs.
        seed: seeds shuffling and views.

    Raises:
        ConfigurationError: when a batch size, ``num_workers``, ``batch_format`` or ``evaluation_loaders`` is out of
            range, ``views`` or ``drawer`` is a class, not an instance, or the drawer cannot draw the views.

    Example::

        data = MultiViewDataModule(CIFAR("cifar10"), views=SimCLRViews(count=9, crop_strength=0.5))
        views, targets = next(iter(data.train_dataloader()))  # views (64, 9, 3, 32, 32), targets (64,)
    """

    def __init__(
        self,
        source: ImageSource,
        views: ViewSpec | Callable[[Any], Any] | None = None,
        drawer: ViewDrawer | None = None,
        batch_format: BatchFormat = "stacked",
        evaluation_loaders: EvaluationLoaders = "bank_and_queries",
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 4,
        persistent_workers: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_at_least(batch_size, 1, "batch_size")
        check_at_least(eval_batch_size, 1, "eval_batch_size")
        check_at_least(num_workers, 0, "num_workers")
        check_choice(batch_format, BATCH_FORMATS, "batch_format")
        check_choice(evaluation_loaders, EVALUATION_LOADERS, "evaluation_loaders")
        for name, given in (("views", views), ("drawer", drawer)):
            if isinstance(given, type):
                what = given.__name__
                raise ConfigurationError(f"{name} is the class {what}; give an instance: {what}(...)", parameter=name)
        views = SimCLRViews() if views is None else views
        views = views if isinstance(views, ViewSpec) else TransformViews(views)  # a callable image -> views
        if batch_format == "solo" and isinstance(views, SimCLRViews) and views.grids:
            raise ConfigurationError(
                "batch_format solo, (indexes, views, targets), has no place for crop grids: use stacked, lightly or "
                "dict with SimCLRViews(grids=...)",
                parameter="batch_format",
            )
        drawer = drawer if drawer is not None else TorchvisionDrawer()
        check_drawer(views, drawer)
        self.source, self.views, self.batch_format = source, views, batch_format
        self.drawer = drawer.bind(DrawSetup(views, source.image_size, (source.mean, source.std)))  # this module's copy
        self.evaluation_loaders = evaluation_loaders
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_workers, self.persistent_workers, self.seed = num_workers, persistent_workers, seed
        self.eval_transform = eval_transform(source.image_size, source.mean, source.std, resize=source.eval_resize)
        self._train_split: LabelledImages | None = None
        self._evaluation: tuple[LabelledImages, LabelledImages] | None = None
        self._resume_position: TrainingPosition | None = None
        self._capped_workers = False

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def num_views(self) -> int | None:
        """Views per sample (for a user transform: None until :meth:`setup` counts them)."""
        return self.views.num_views

    @property
    def single_view(self) -> bool:
        """Whether training batches hold one image per sample, without a view axis."""
        return self.views.single_view

    @property
    def training_split(self) -> LabelledImages:
        """The source's training split (read by :meth:`setup`, called here if it has not run)."""
        if self._train_split is None:
            self.setup()
        assert self._train_split is not None  # set by setup
        return self._train_split

    @property
    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        """``(train, test)`` labelled splits (kNN bank and queries), or None for a source without labels."""
        if self._train_split is None:
            self.setup()
        return self._evaluation

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self._train_split is None:
            split = self.source.training_split()
            self.views.check_split(split, self.source.image_size, self.seed)
            self._train_split, self._evaluation = split, self.source.evaluation_splits()
            if self._evaluation is None:
                rank_zero_warn(
                    f"{type(self.source).__name__} has no labelled evaluation split: training runs, kNN evaluation "
                    "is skipped (give the source labelled evaluation data to get it).",
                    category=HFMCAWarning,
                )
        self._check_loader_index(stage)
        self.drawer.prepare(self._train_split, self.trainer.strategy.root_device if self.trainer is not None else None)
        processes = self.trainer.world_size if self.trainer is not None else 1
        if len(self._train_split) // processes < self.batch_size:
            shared = f" shared by {processes} processes" if processes > 1 else ""
            raise ConfigurationError(
                f"batch_size={self.batch_size} is larger than the training split ({len(self._train_split)} images"
                f"{shared}): not even one batch per epoch. Lower data.init_args.batch_size",
                parameter="batch_size",
            )

    def _check_loader_index(self, stage: str | None) -> None:
        """Two evaluation loaders pass the step a loader index: a step without one fails here, not after an epoch."""
        trainer = self.trainer
        step = {"fit": "validation_step", "validate": "validation_step", "test": "test_step"}.get(stage or "")
        if trainer is None or step is None or self.evaluation_loaders != "bank_and_queries" or self._evaluation is None:
            return
        module = trainer.lightning_module
        if (stage == "fit" and not trainer.limit_val_batches) or not is_overridden(step, module, LightningModule):
            return
        parameters = inspect.signature(getattr(module, step)).parameters.values()
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in parameters):
            raise ConfigurationError(
                f"{type(module).__name__}.{step} takes no loader index, but the data gives two evaluation loaders "
                "(kNN bank and queries): set data evaluation_loaders: queries",
                parameter="evaluation_loaders",
            )

    def train_dataset(self) -> Dataset:
        """The training loader's dataset: :meth:`~hfmca_lightning.data.drawers.ViewDrawer.dataset`."""
        return self.drawer.dataset(self.training_split)

    def loader(self, dataset: Dataset, batch_size: int | None, workers: int | None = None, **kwargs: Any) -> DataLoader:
        """``DataLoader(dataset, **kwargs)``: this module's workers capped to this process's CPU cores; CUDA: pinned."""
        workers = self.num_workers if workers is None else workers
        processes = max(1, self.trainer.num_devices) if self.trainer is not None else 1  # DDP: they share the cores
        cores = cores_per_process(processes)
        if workers > cores and not self._capped_workers:
            share = f"each of {processes} processes on this machine" if processes > 1 else "this process"
            rank_zero_info(f"num_workers={workers}, but {share} may use {cores} CPU cores: {cores} workers")
            self._capped_workers = True
        workers = min(workers, cores)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=kwargs.pop("persistent_workers", self.persistent_workers) and workers > 0,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=leave_signals_to_the_main_process if workers > 0 else None,
            **kwargs,
        )
        return track(loader)  # hfmca_lightning.runtime.workers: its workers end with the command

    def training_loader(
        self, sampler: SeededRandomSampler, batch_format: BatchFormat | None, persistent_workers: bool | None = None
    ) -> DataLoader:
        """The drawer's batches in ``sampler``'s order and ``batch_format`` (None: as the drawer gives them; a device
        drawer's are what it draws from after the transfer); ``persistent_workers`` overrides the module's."""
        batching = self.drawer.batching(sampler, self.batch_size)
        workers = None if self.drawer.uses_workers else 0  # no worker work: `num_workers` serves evaluation only
        collate = partial(_collate, self.drawer, batch_format, self.views)
        if persistent_workers is not None:
            batching["persistent_workers"] = persistent_workers
        return self.loader(self.train_dataset(), batching.pop("batch_size"), workers, collate_fn=collate, **batching)

    def train_dataloader(self) -> DataLoader:
        """Per-process batches of ``batch_size`` samples in ``batch_format`` (device drawers: after the transfer)."""
        trainer, size = self.trainer, len(self.training_split)
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = SeededRandomSampler(size, self.seed, num_replicas=replicas, rank=rank)
        position, self._resume_position = self._resume_position, None
        if position is not None and position.samples_seen > size:
            raise ConfigurationError(
                f"the checkpoint resumes epoch {position.epoch} after {position.samples_seen} training images, but the "
                f"training split now has {size}: resume with the data the run was trained on, or start a new run"
            )
        if position is not None and position.epoch_ended and trainer is not None and trainer.max_steps == -1:
            # Lightning goes on at the next epoch (under max_steps it finishes this one): set before workers draw keys
            sampler.resume(position.epoch + 1, 0)
            untrained = size - size % (self.batch_size * replicas) - position.samples_seen
            rank_zero_warn(
                f"the checkpoint's epoch {position.epoch} was ended early by max_steps or max_time; Lightning counts "
                f"it finished: training goes on at epoch {position.epoch + 1}, and {untrained} training images of "
                "that epoch are not trained on (resume with max_steps to finish it first; a SIGTERM stop resumes "
                "exactly)",
                category=HFMCAWarning,
            )
        elif position is not None:
            sampler.resume(position.epoch, position.samples_seen)
        if isinstance(trainer, Trainer):  # the epoch its loop runs: the one it sets is ahead after some resumes
            sampler.loop_epoch = lambda: trainer.current_epoch
        return self.training_loader(sampler, None if self.drawer.draws_on_device else self.batch_format)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data, written into every checkpoint by Lightning."""
        return {} if self.trainer is None else {"position": asdict(training_position(self.trainer, self.batch_size))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position of a checkpoint: the next training loader starts there."""
        if "position" in state_dict:
            self._resume_position = TrainingPosition(**state_dict["position"])

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Device drawers: a transferred training batch (images, or indices and seeds) -> views in ``batch_format``,
        then the precision plugin's conversion (float64 under "64-true") that Lightning ran on the uint8/index batch."""
        if not self.drawer.draws_on_device or self.trainer is None or not self.trainer.training:
            return batch
        views = format_batch(self.drawer.draw(batch), self.batch_format, self.single_view, self.views.global_views)
        return self.trainer.precision_plugin.convert_input(views)

    def evaluation_loader(self, split: int, tuples: bool = False, **kwargs: Any) -> DataLoader:
        """Un-augmented ``eval_batch_size`` batches of split ``split`` (``BANK``: train, ``QUERIES``: test):
        ``(image (B, C, H, W), target (B,))``, or ``{"image", "label", "sample_idx"}`` in a dict format unless
        ``tuples`` (``sample_idx``: index in the labelled split); ``kwargs`` (a ``sampler``) go to ``DataLoader``."""
        splits = self.evaluation_splits
        if splits is None:
            raise ValueError(f"{type(self.source).__name__} has no labelled evaluation split")
        dicts = self.batch_format in DICT_FORMATS and not tuples
        dataset = EvalDataset(splits[split], self.eval_transform, as_dict=dicts)
        return self.loader(dataset, self.eval_batch_size, **kwargs)

    def val_dataloader(self) -> list[DataLoader] | DataLoader:
        """``[BANK, QUERIES]`` loaders, ``QUERIES`` alone (``evaluation_loaders="queries"``), ``[]`` without labels."""
        if self.evaluation_splits is None:
            return []
        if self.evaluation_loaders == "queries":
            return self.evaluation_loader(QUERIES)
        return [self.evaluation_loader(BANK), self.evaluation_loader(QUERIES)]

    def test_dataloader(self) -> list[DataLoader] | DataLoader:
        return self.val_dataloader()
