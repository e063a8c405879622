"""``MultiViewDataModule``: L-view (or same-class) training batches plus kNN evaluation loaders (docs/conventions.md
§5)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from hfmca_lightning.data.batch_formats import BATCH_FORMATS, BatchFormat, ViewBatch, format_batch
from hfmca_lightning.data.datasets import EvalDataset, SeededRandomSampler
from hfmca_lightning.data.sources import UNLABELLED, ImageSource, LabelledImages
from hfmca_lightning.data.transforms import ViewAugmentation, eval_transform, finetune_transform
from hfmca_lightning.data.views import TorchvisionViews, ViewPipeline, ViewSetup
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning
from hfmca_lightning.runtime.seeding import step_seed
from hfmca_lightning.runtime.workers import leave_signals_to_the_main_process, track

__all__ = ["BANK", "QUERIES", "MultiViewDataModule", "TrainingPosition", "training_position"]

# Evaluation loaders, by their index in ``val_dataloader()`` / ``test_dataloader()``: the kNN bank (the train
# split without augmentation) and the queries (the test split).
BANK, QUERIES = 0, 1


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform says, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cores_per_process(processes: int) -> int:
    """This process's share of the cores when ``processes`` processes of one machine train together: its affinity
    divided among them where it spans the whole machine (processes started by Lightning's launcher inherit it),
    as it is where each process was bound to its own cores (SLURM's ``--cpus-per-task``)."""
    cores = available_cores()
    if processes > 1 and cores >= (os.cpu_count() or cores):
        cores //= processes
    return max(1, cores)


class _TrainingBatches:
    """The training loader's collate function: the pipeline's batch, laid out in ``batch_format`` (None: as the
    pipeline gives it: the :class:`ViewBatch` of worker pipelines, or what device pipelines draw from after the
    transfer)."""

    def __init__(self, views: ViewPipeline, batch_format: BatchFormat | None, mode: str) -> None:
        self.views, self.batch_format, self.single = views, batch_format, mode == "single"

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.views.collate(samples)
        if self.batch_format is None:
            return batch
        return format_batch(batch, self.batch_format, self.single)


@dataclass(frozen=True)
class TrainingPosition:
    """How far training got: ``samples_seen`` training samples (all ranks together) of epoch ``epoch``."""

    epoch: int
    samples_seen: int


def training_position(trainer: Trainer, batch_size: int) -> TrainingPosition:
    """The data position after the last finished training batch (what a checkpoint written now resumes at).

    Read from Lightning's loop progress, which counts the batches the loop consumed (the loader itself runs
    ahead by its prefetched batches). A finished epoch is the start of the next one.
    """
    loop = trainer.fit_loop
    epoch = max(loop.epoch_progress.current.started - 1, 0)  # the epoch the batch counter belongs to
    batches = loop.epoch_loop.batch_progress.current.processed
    if batches >= trainer.num_training_batches:
        return TrainingPosition(epoch + 1, 0)
    return TrainingPosition(epoch, batches * batch_size * trainer.world_size)


class MultiViewDataModule(LightningDataModule):
    """Multi-view batches for HFMCA and any other SSL method.

    * ``train_dataloader``: ``mode='views'``: ``L`` views of each image, drawn by the ``views`` pipeline (module
      :mod:`hfmca_lightning.data.views`: torchvision in CPU workers, batched in CPU workers or on the device, the
      training set kept on the device, multi-crop, or any transform such as lightly's); ``mode='same_class'``: ``L``
      different images of the same class (each through the same view transform; set the strengths to 0 for plain
      images); ``mode='single'`` (``num_views: 1``): one augmented image per sample, e.g. for internal costs alone.
      Laid out as ``batch_format`` says (:mod:`hfmca_lightning.data.batch_formats`): ``stacked``
      ``(views (B, L, C, H, W), targets)`` (this project's modules), ``lightly``
      ``([view_0 (B, C, H, W), ...], targets, names)`` or ``solo`` ``(indexes, [view_0, ...], targets)``.
    * ``val_dataloader``: loaders ``BANK`` (0) and ``QUERIES`` (1) of ``(image (B, C, H, W), target)``
      without augmentation: the train split (kNN bank) and the test split (kNN queries), in every batch format.
    * ``test_dataloader``: the same pair (kNN needs the bank to classify queries).

    Augmentation is drawn per sample from a seed given by the sampler, so runs do not depend on the
    number of workers and resume exactly.

    Resume: :meth:`state_dict` (saved by Lightning in every checkpoint) records how far training got in
    the data (epoch, samples seen by all ranks together); a run resumed from that checkpoint starts its
    first epoch at the next unseen sample, with the same order and augmentation seeds as an uninterrupted
    run, for any ``num_workers``, with persistent workers or not, on any number of devices, on every pipeline.

    Args:
        source: where the images come from (``CIFAR``, ``ImageFolderSource``, ``SyntheticShapes``).
        mode: ``views``, ``same_class`` or ``single``.
        num_views: L, members per group (for multi-crop: all crops).
        batch_size: groups (source images) per training batch.
        eval_batch_size: images per evaluation batch.
        num_workers: DataLoader worker processes; more than the CPU cores this process may use are capped to them
            (with a line saying so).
        persistent_workers: keep the workers alive between epochs (with ``num_workers > 0``).
        seed: seeds shuffling and augmentation.
        crop_strength: Table 2 crop knob in [0, 1]; null = SimCLR CIFAR default.
        color_strength: Table 2 colour-jitter knob in [0, 1]; null = SimCLR CIFAR default.
        gray_strength: Table 2 greyscale knob in [0, 1]; null = SimCLR CIFAR default.
        horizontal_flip: random horizontal flips in the views.
        color_jitter: ``[brightness, contrast, saturation, hue]``, replacing the jitter of ``color_strength``.
        blur: probability of a Gaussian blur; a list gives one per view kind, cycled over the ``L`` views (BYOL:
            ``blur: [1.0, 0.1]``).
        solarize: probability of a solarisation, as ``blur`` (BYOL: ``solarize: [0.0, 0.2]``).
        views: the view pipeline (default :class:`~hfmca_lightning.data.views.TorchvisionViews`); each says in
            one line what it cannot serve.
        batch_format: ``stacked``, ``lightly`` or ``solo``.

    Raises:
        ConfigurationError: when a setting is out of range (mode, counts, strengths, batch format) or the view
            pipeline cannot serve the settings.

    Example::

        data = MultiViewDataModule(SyntheticShapes(), num_views=4, batch_size=32, num_workers=0)
        views, targets = next(iter(data.train_dataloader()))  # views (32, 4, 3, 32, 32), targets (32,)
    """

    def __init__(
        self,
        source: ImageSource,
        mode: Literal["views", "same_class", "single"] = "views",
        num_views: int = 9,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 4,
        persistent_workers: bool = True,
        seed: int = 0,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        horizontal_flip: bool = True,
        color_jitter: list[float] | None = None,
        blur: float | list[float] = 0.0,
        solarize: float | list[float] = 0.0,
        views: ViewPipeline | None = None,
        batch_format: BatchFormat = "stacked",
    ) -> None:
        super().__init__()
        if mode not in ("views", "same_class", "single"):
            raise ConfigurationError(f"mode must be 'views', 'same_class' or 'single'; got {mode!r}", parameter="mode")
        if mode == "single" and num_views != 1:
            raise ConfigurationError(
                f"mode 'single' yields one image per sample; set num_views: 1 (got {num_views})", parameter="num_views"
            )
        for name, value, least in (
            ("num_views", num_views, 1),
            ("batch_size", batch_size, 1),
            ("eval_batch_size", eval_batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < least:
                raise ConfigurationError(f"{name} must be >= {least}; got {value}", parameter=name)
        if batch_format not in BATCH_FORMATS:
            raise ConfigurationError(
                f"batch_format must be one of {', '.join(BATCH_FORMATS)}; got {batch_format!r}",
                parameter="batch_format",
            )
        self.source = source
        self.mode = mode
        self.num_views = num_views
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.batch_format: BatchFormat = batch_format
        spec = ViewAugmentation.from_strengths(
            source.image_size,
            crop_strength,
            color_strength,
            gray_strength,
            horizontal_flip,
            color_jitter,
            blur,
            solarize,
        )
        self.augmentation = spec
        given = {
            "crop_strength": crop_strength is not None,
            "color_strength": color_strength is not None,
            "gray_strength": gray_strength is not None,
            "color_jitter": color_jitter is not None,
            "horizontal_flip": not horizontal_flip,
            "blur": bool(blur),
            "solarize": bool(solarize),
        }
        given_settings = tuple(name for name, is_given in given.items() if is_given)
        self.views: ViewPipeline = views if views is not None else TorchvisionViews()
        self.views.bind(ViewSetup(spec, source.mean, source.std, num_views, mode, given_settings))
        self.eval_transform = eval_transform(source.image_size, source.mean, source.std, resize=source.eval_resize)
        self._train_split: LabelledImages | None = None
        self._evaluation: tuple[LabelledImages, LabelledImages] | None = None
        self._resume_position: TrainingPosition | None = None
        self._checked_views = False
        self._capped_workers = False

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self._train_split is None:
            self._train_split = self.source.training_split()
            self._evaluation = self.source.evaluation_splits()
            if self._evaluation is None:
                rank_zero_warn(
                    f"{type(self.source).__name__} has no labelled evaluation split: training runs, kNN evaluation "
                    "is skipped (give the source labelled evaluation data to get it).",
                    category=HFMCAWarning,
                )
            if self.mode == "same_class" and UNLABELLED in set(self._train_split.targets):
                raise ConfigurationError(
                    "mode 'same_class' groups images by class, but the training images have no labels", parameter="mode"
                )
        # errors (device memory for ResidentViews) before training starts
        self.views.prepare(self._train_split, self.trainer.strategy.root_device if self.trainer is not None else None)
        processes = self.trainer.world_size if self.trainer is not None else 1
        if len(self._train_split) // processes < self.batch_size:
            shared = f" shared by {processes} processes" if processes > 1 else ""
            raise ConfigurationError(
                f"batch_size={self.batch_size} is larger than the training split ({len(self._train_split)} images"
                f"{shared}): not even one batch per epoch. Lower data.init_args.batch_size",
                parameter="batch_size",
            )
        if not self._checked_views:
            self._check_view_count()
            self._checked_views = True

    def _check_view_count(self) -> None:
        """A pipeline whose number of views is only known from its output (a user transform): count them on the
        first sample, before training."""
        assert self._train_split is not None
        count = self.views.counted_views(self._train_split, self.seed)
        if count is not None and count != self.num_views:
            raise ConfigurationError(
                f"{type(self.views).__name__} makes {count} views per image; set data num_views: {count} (got "
                f"{self.num_views})",
                parameter="num_views",
            )

    def train_dataset(self) -> torch.utils.data.Dataset:
        """The dataset the training loader's workers read: the pipeline's per-sample work.

        Returns:
            A dataset of ``(index, seed)`` keys.
        """
        self.setup()
        assert self._train_split is not None
        return self.views.dataset(self._train_split)

    def _loader(
        self, dataset: torch.utils.data.Dataset, batch_size: int | None, workers: int | None = None, **kwargs: object
    ) -> DataLoader:
        workers = self.num_workers if workers is None else workers
        # The processes of one machine (DDP: one per device) share its cores.
        processes = max(1, self.trainer.num_devices) if self.trainer is not None else 1
        cores = cores_per_process(processes)
        if workers > cores:
            if not self._capped_workers:
                share = f"each of {processes} processes on this machine" if processes > 1 else "this process"
                rank_zero_info(f"num_workers={workers}, but {share} may use {cores} CPU cores: {cores} workers")
                self._capped_workers = True
            workers = cores
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=self.persistent_workers and workers > 0,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=leave_signals_to_the_main_process if workers > 0 else None,
            **kwargs,
        )
        return track(loader)  # hfmca_lightning.runtime.workers: its workers end with the command

    def train_dataloader(self) -> DataLoader:
        """The training loader: per-process batches of ``batch_size`` groups; under DDP the global batch is
        ``world_size * batch_size``.

        Returns:
            A loader whose batches are in ``batch_format`` for worker pipelines; device pipelines yield what they
            draw from, turned into views after the transfer (:meth:`on_after_batch_transfer`).
        """
        dataset = self.train_dataset()
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = SeededRandomSampler(len(dataset), self.seed, num_replicas=replicas, rank=rank)
        if self._resume_position is not None:
            sampler.resume(self._resume_position.epoch, self._resume_position.samples_seen)
            self._resume_position = None
        return self._training_loader(dataset, sampler, None if self.views.draws_on_device else self.batch_format)

    def _training_loader(
        self, dataset: torch.utils.data.Dataset, sampler: SeededRandomSampler, batch_format: BatchFormat | None
    ) -> DataLoader:
        """The pipeline's batches of ``dataset`` in ``sampler``'s order, laid out in ``batch_format`` (None: as the
        pipeline gives them)."""
        batching = self.views.batching(sampler, self.batch_size)
        workers = None if self.views.uses_workers else 0  # no worker work: `num_workers` serves evaluation only
        collate = _TrainingBatches(self.views, batch_format, self.mode)
        return self._loader(dataset, batching.pop("batch_size"), workers, collate_fn=collate, **batching)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data, written into every checkpoint by Lightning."""
        trainer = self.trainer
        if trainer is None:
            return {}
        return {"position": asdict(training_position(trainer, self.batch_size))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position of a checkpoint: the next training loader starts there."""
        if "position" in state_dict:
            self._resume_position = TrainingPosition(**state_dict["position"])

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Device pipelines: a transferred training batch (images, or the training set's indices and seeds) ->
        its views, on the device, in ``batch_format``."""
        trainer = self.trainer
        if not self.views.draws_on_device or trainer is None or not trainer.training:
            return batch
        # Lightning counts the batch after this hook: the index is the previous batch's, one per batch.
        seed = step_seed(self.seed, trainer.fit_loop.total_batch_idx, trainer.global_rank, stream=1)
        views = format_batch(self.views.draw(batch, seed), self.batch_format, self.mode == "single")
        # Lightning converts a batch for the trainer's precision (float64 under "64-true") before this hook, when it
        # held only uint8 images or indices: the views drawn here get the same conversion.
        return trainer.precision_plugin.convert_input(views)

    def view_batches(self, device: torch.device, limit: int | None = None) -> Iterator[ViewBatch]:
        """Training batches drawn by the configured pipeline whatever it is (analysis of a trained model:
        ``hfmca analyze``). The loader's workers are shut down when the iteration ends or is abandoned.

        Args:
            device: where the batches go (device pipelines draw their views there).
            limit: the most batches to give; None: one epoch.

        Yields:
            :class:`~hfmca_lightning.data.batch_formats.ViewBatch` on ``device``.
        """
        dataset = self.train_dataset()
        loader = self._training_loader(dataset, SeededRandomSampler(len(dataset), self.seed), None)
        iterator = iter(loader)
        try:
            for number, batch in enumerate(iterator):
                if limit is not None and number >= limit:
                    break
                batch = move_data_to_device(batch, device)
                if self.views.draws_on_device:
                    batch = self.views.draw(batch, step_seed(self.seed, number, 0, stream=1))
                yield batch
        finally:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def val_dataloader(self) -> list[DataLoader]:
        """The evaluation loaders: the source's labelled evaluation splits (usually the train and the test split).

        Returns:
            ``[BANK, QUERIES]`` loaders of un-augmented ``(image (B, C, H, W), target (B,))``; an empty list when the
            source has no labels.
        """
        self.setup()
        if self._evaluation is None:
            return []
        bank, queries = self._evaluation
        loaders = {
            BANK: self._loader(EvalDataset(bank, self.eval_transform), self.eval_batch_size),
            QUERIES: self._loader(EvalDataset(queries, self.eval_transform), self.eval_batch_size),
        }
        return [loaders[index] for index in sorted(loaders)]

    def labelled_splits(self) -> tuple[LabelledImages, LabelledImages]:
        """The labelled splits of the evaluation protocols.

        Returns:
            ``(train, test)``: the kNN bank and queries, the linear classifier's training and test data.

        Raises:
            ConfigurationError: when the source has no labelled evaluation splits.
        """
        self.setup()
        if self._evaluation is None:
            raise ConfigurationError(
                f"{type(self.source).__name__} has no labelled evaluation splits; kNN and linear evaluation need them"
            )
        return self._evaluation

    def finetune_dataloader(self, indices: Sequence[int] | None = None, seed: int = 0) -> DataLoader:
        """Batches for supervised fine-tuning from the labelled training split.

        Args:
            indices: the samples of the split to use (label fractions); None: all of them.
            seed: seeds the shuffling.

        Returns:
            A loader of shuffled, augmented ``(image (B, C, H, W), target (B,))`` batches of ``batch_size`` images.

        Raises:
            ConfigurationError: when the source has no labelled evaluation splits.
        """
        train, _ = self.labelled_splits()
        dataset = EvalDataset(train, finetune_transform(self.source.image_size, self.source.mean, self.source.std))
        subset = dataset if indices is None else torch.utils.data.Subset(dataset, list(indices))
        return self._loader(
            subset,
            self.batch_size,
            shuffle=True,
            drop_last=len(subset) > self.batch_size,
            generator=torch.Generator().manual_seed(seed),
        )

    def _figure_split(self) -> LabelledImages:
        """The split figures and their statistics draw from: the test split, or the training split of a source without
        labels."""
        self.setup()
        return self._evaluation[QUERIES] if self._evaluation is not None else self._train_split

    def evaluation_images(
        self, count: int, target: int | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation queries (training images for sources without labels) without augmentation, for figures.

        Args:
            count: the most images to give.
            target: only images of this class (the appendix's figures show samples of one class); None: any.
            start: the index of the split to start at.

        Returns:
            ``(images (N, C, H, W), targets (N,))``, ``N <= count``.

        Raises:
            ConfigurationError: when the split has no such image from ``start`` on.
        """
        split = self._figure_split()
        dataset = EvalDataset(split, self.eval_transform)
        indices = [index for index in range(start, len(split)) if target is None or split.targets[index] == target][
            :count
        ]
        if not indices:
            which = f" of class {target}" if target is not None else ""
            raise ConfigurationError(
                f"the evaluation split has no images{which} from index {start} on ({len(split)} images)"
            )
        items = [dataset[index] for index in indices]
        return torch.stack([image for image, _ in items]), torch.tensor([target for _, target in items])

    def evaluation_batches(self, count: int) -> Iterator[torch.Tensor]:
        """The first images of the split :meth:`evaluation_images` draws from, without augmentation, a batch at a time
        (never all in memory at once).

        Args:
            count: the most images to give.

        Yields:
            ``(B, C, H, W)`` batches of at most ``eval_batch_size`` images.
        """
        dataset = EvalDataset(self._figure_split(), self.eval_transform)
        for start in range(0, min(count, len(dataset)), self.eval_batch_size):
            stop = min(start + self.eval_batch_size, count, len(dataset))
            yield torch.stack([dataset[index][0] for index in range(start, stop)])

    def denormalise(self, images: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation of the network inputs.

        Args:
            images: ``(N, 3, H, W)`` normalised images.

        Returns:
            ``(N, 3, H, W)`` pixel values in [0, 1].
        """
        mean = torch.tensor(self.source.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.source.std, device=images.device).view(1, -1, 1, 1)
        return (images * std + mean).clamp(0, 1)

    def test_dataloader(self) -> list[DataLoader]:
        return self.val_dataloader()
