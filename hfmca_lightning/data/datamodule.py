"""``MultiViewDataModule``: L-view (or same-class) training batches plus kNN evaluation loaders (docs/conventions.md
§5)."""

from __future__ import annotations

import atexit
import multiprocessing
import signal
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from hfmca_lightning.data.batched_augment import BatchedViewAugmentation, BatchViews
from hfmca_lightning.data.datasets import (
    EvalDataset,
    MultiViewDataset,
    SameClassDataset,
    SeededImageDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.device_augment import DeviceViewAugmentation, SampleViews
from hfmca_lightning.data.sources import UNLABELLED, ImageSource, LabelledImages
from hfmca_lightning.data.stored_images import SeededIndices, StoredImages
from hfmca_lightning.data.transforms import (
    ViewAugmentation,
    eval_transform,
    finetune_transform,
    resize_transform,
    view_transforms,
)
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.runtime.seeding import step_seed

__all__ = ["BANK", "QUERIES", "MultiViewDataModule", "TrainingPosition", "training_position"]

# Evaluation loaders, by their index in ``val_dataloader()`` / ``test_dataloader()``: the kNN bank (the train
# split without augmentation) and the queries (the test split).
BANK, QUERIES = 0, 1


def _leave_sigterm_to_the_main_process(worker_id: int) -> None:
    """Data-loader workers ignore SIGTERM: SLURM signals every process of a job, and a worker that died of it
    would crash the main process (PyTorch raises from its SIGCHLD handler, anywhere in a step) before it
    could write its preemption checkpoint. The main process stops its workers itself: through the loader's
    shutdown, or :func:`_stop_workers_at_exit`."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_workers_at_exit() -> None:
    """Kill the data-loader workers still alive when the main process exits (after an error, persistent
    workers are never shut down). ``multiprocessing`` would SIGTERM and then wait for them, forever, as
    they ignore SIGTERM; this runs before that (``atexit`` is last in, first out)."""
    for child in multiprocessing.active_children():
        if child.daemon:  # DataLoader workers are daemonic
            child.kill()
            child.join(timeout=5)


atexit.register(_stop_workers_at_exit)


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

    * ``train_dataloader``: ``(views (B, L, C, H, W), target)``. ``mode='views'``: L SimCLR views of each
      image; ``mode='same_class'``: L different images of the same class (each through the same view
      transform; set the strengths to 0 for plain images). ``mode='single'`` (``num_views: 1``): batches of
      single augmented images ``(image (B, C, H, W), target)``, e.g. for internal costs alone.
    * ``val_dataloader``: loaders ``BANK`` (0) and ``QUERIES`` (1) of ``(image (B, C, H, W), target)``
      without augmentation: the train split (kNN bank) and the test split (kNN queries).
    * ``test_dataloader``: the same pair (kNN needs the bank to classify queries).

    Augmentation is drawn per sample from a seed given by the sampler, so runs do not depend on the
    number of workers and resume exactly.

    Args:
        source: where the images come from (``CIFAR``, ``ImageFolderSource``, ``SyntheticShapes``).
        mode: ``views``, ``same_class`` or ``single``.
        num_views: L, members per group.
        batch_size: groups (source images) per training batch.
        eval_batch_size: images per evaluation batch.
        num_workers: DataLoader worker processes.
        persistent_workers: keep the workers alive between epochs (with ``num_workers > 0``).
        seed: seeds shuffling and augmentation.
        crop_strength / color_strength / gray_strength: Table 2 knobs in [0, 1]; null = SimCLR CIFAR default.
        horizontal_flip: random horizontal flips in the views.
        color_jitter: ``[brightness, contrast, saturation, hue]`` instead of the jitter of ``color_strength``.
        blur / solarize: probability of a Gaussian blur / a solarisation; a list gives one per view kind,
            cycled over the ``L`` views (BYOL: ``blur: [1.0, 0.1]``, ``solarize: [0.0, 0.2]``).
        augment_on_device: ``mode: views`` only. The loader yields resized uint8 images and the views
            are drawn on the accelerator after the batch is transferred (``device_pipeline``, same
            distributions, per-view parameters); frees the CPU workers. Its random numbers
            are seeded from ``(seed, batch index, rank)``, so runs and resumes are reproducible.
        worker_augmentation: how CPU workers draw the views of mode ``views``: ``torchvision`` (one pipeline
            call per view), ``kornia`` (all ``L`` views of an image in one call of :class:`DeviceViewAugmentation`)
            or ``batched`` (each image's parameters from its seed, then the pixels of the whole batch at once
            by :class:`BatchedViewAugmentation`, in the worker's collate function; like ``augment_on_device``,
            from the image resized and centre-cropped to ``image_size``, which changes nothing for CIFAR).
            Same distributions and per-sample seeds in all three. On CIFAR-sized images ``batched`` draws several
            times the views per CPU core of the others; ImageNet-sized views with blur are faster with
            ``torchvision`` (PIL's blur).
        device_pipeline: what draws the views with ``augment_on_device``: ``batched``
            (:class:`BatchedViewAugmentation`, the default: a fixed number of whole-batch operations, no
            host-device waits) or ``kornia``.
        images_on_device: mode ``views`` only. The training split is kept on the accelerator as one uint8 tensor
            (for data sets that fit: a clear error if it would take more than half of the free device memory);
            a training batch is then its samples' indices and seeds, and the views are drawn on the device by
            :class:`BatchedViewAugmentation` from each sample's seed, with the same views as ``worker_augmentation:
            batched`` gives, without data-loader workers (``num_workers`` then serves the evaluation loaders).
            Order, seeds, exact resume and DDP sharding are those of the other paths.
        view_grids: ``g > 0`` (mode ``views``, CPU ``torchvision`` augmentation): training batches become
            ``(views, target, grids (B, L, g, g, 2))``, the source-image positions of a ``g x g`` grid over each
            view (:class:`ViewWithGrid`) — what VICRegL matches local features by. 0: plain ``(views, target)``.

    Resume: :meth:`state_dict` (saved by Lightning in every checkpoint) records how far training got in
    the data (epoch, samples seen by all ranks together); a run resumed from that checkpoint starts its
    first epoch at the next unseen sample, with the same order and augmentation seeds as an uninterrupted
    run, for any ``num_workers``, with persistent workers or not, on any number of devices.
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
        augment_on_device: bool = False,
        worker_augmentation: Literal["torchvision", "kornia", "batched"] = "torchvision",
        device_pipeline: Literal["batched", "kornia"] = "batched",
        view_grids: int = 0,
        images_on_device: bool = False,
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
        self.source = source
        self.mode = mode
        self.num_views = num_views
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.persistent_workers = persistent_workers
        self.seed = seed
        if augment_on_device and mode != "views":
            raise ConfigurationError(
                f"augment_on_device supports mode 'views' only; got mode {mode!r}", parameter="augment_on_device"
            )
        self.augment_on_device = augment_on_device
        if worker_augmentation not in ("torchvision", "kornia", "batched"):
            raise ConfigurationError(
                f"worker_augmentation must be 'torchvision', 'batched' or 'kornia'; got {worker_augmentation!r}",
                parameter="worker_augmentation",
            )
        if worker_augmentation != "torchvision" and (mode != "views" or augment_on_device):
            raise ConfigurationError(
                f"worker_augmentation {worker_augmentation!r} draws the views of mode 'views' in the CPU workers; it "
                "does not apply with "
                f"mode {mode!r} or augment_on_device: true",
                parameter="worker_augmentation",
            )
        if device_pipeline not in ("batched", "kornia"):
            raise ConfigurationError(
                f"device_pipeline must be 'batched' or 'kornia'; got {device_pipeline!r}", parameter="device_pipeline"
            )
        self.worker_augmentation = worker_augmentation
        if images_on_device and (mode != "views" or augment_on_device or worker_augmentation == "kornia"):
            raise ConfigurationError(
                "images_on_device draws the views of mode 'views' on the device with the batched pipeline; it does "
                "not apply with "
                f"mode {mode!r}, augment_on_device: {augment_on_device} or worker_augmentation: "
                f"{worker_augmentation!r}",
                parameter="images_on_device",
            )
        self.images_on_device = images_on_device
        if view_grids < 0 or (
            view_grids > 0
            and (mode != "views" or augment_on_device or images_on_device or worker_augmentation != "torchvision")
        ):
            raise ConfigurationError(
                "view_grids (the side of the grid of crop positions VICRegL matches local features with) must be >= "
                "0 and "
                f"needs mode 'views' with the CPU torchvision augmentation; got view_grids={view_grids}, "
                f"mode={mode!r}, "
                f"augment_on_device={augment_on_device}, worker_augmentation={worker_augmentation!r}",
                parameter="view_grids",
            )
        self.view_grids = view_grids
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
        self.train_transforms = view_transforms(spec, source.mean, source.std, grid_size=view_grids)
        pipelines = {"batched": BatchedViewAugmentation, "kornia": DeviceViewAugmentation}
        self.device_augmentation = (
            pipelines[device_pipeline](spec, source.mean, source.std) if augment_on_device else None
        )
        self.sample_views = (
            SampleViews(DeviceViewAugmentation(spec, source.mean, source.std))
            if worker_augmentation == "kornia"
            else None
        )
        self.batch_views = (
            BatchViews(BatchedViewAugmentation(spec, source.mean, source.std), num_views)
            if worker_augmentation == "batched" and not images_on_device
            else None
        )
        self.view_augmentation = BatchedViewAugmentation(spec, source.mean, source.std) if images_on_device else None
        self._stored: StoredImages | None = None
        self.eval_transform = eval_transform(source.image_size, source.mean, source.std, resize=source.eval_resize)
        self._train_split: LabelledImages | None = None
        self._evaluation: tuple[LabelledImages, LabelledImages] | None = None
        self._resume_position: TrainingPosition | None = None

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
                    "is skipped (give the source labelled evaluation data to get it)."
                )
            if self.mode == "same_class" and UNLABELLED in set(self._train_split.targets):
                raise ConfigurationError(
                    "mode 'same_class' groups images by class, but the training images have no labels", parameter="mode"
                )
        if self.images_on_device and self._stored is None:
            self._stored = StoredImages.from_split(self._train_split, self.source.image_size)
        if self._stored is not None and self.trainer is not None:  # errors (device memory) before training starts
            self._stored = self._stored.to(self.trainer.strategy.root_device)
        processes = self.trainer.world_size if self.trainer is not None else 1
        if len(self._train_split) // processes < self.batch_size:
            shared = f" shared by {processes} processes" if processes > 1 else ""
            raise ConfigurationError(
                f"batch_size={self.batch_size} is larger than the training split ({len(self._train_split)} images"
                f"{shared}): not even one batch per epoch. Lower data.init_args.batch_size",
                parameter="batch_size",
            )

    def train_dataset(self) -> MultiViewDataset | SameClassDataset | SingleViewDataset | SeededIndices:
        self.setup()
        if self.images_on_device:
            return SeededIndices(len(self._train_split))
        if self.augment_on_device:
            return SingleViewDataset(self._train_split, resize_transform(self.source.image_size), 1)
        if self.batch_views is not None:
            return SeededImageDataset(self._train_split, resize_transform(self.source.image_size))
        if self.sample_views is not None:
            return MultiViewDataset(
                self._train_split, self.train_transforms, self.num_views, all_views=self.sample_views
            )
        dataset_class = {"views": MultiViewDataset, "same_class": SameClassDataset, "single": SingleViewDataset}[
            self.mode
        ]
        return dataset_class(self._train_split, self.train_transforms, self.num_views)

    def _loader(
        self, dataset: torch.utils.data.Dataset, batch_size: int, workers: int | None = None, **kwargs: object
    ) -> DataLoader:
        workers = self.num_workers if workers is None else workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=self.persistent_workers and workers > 0,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=_leave_sigterm_to_the_main_process if workers > 0 else None,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Per-process batches of ``batch_size`` groups; under DDP the global batch is ``world_size * batch_size``."""
        dataset = self.train_dataset()
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = SeededRandomSampler(len(dataset), self.seed, num_replicas=replicas, rank=rank)
        if self._resume_position is not None:
            sampler.resume(self._resume_position.epoch, self._resume_position.samples_seen)
            self._resume_position = None
        workers = 0 if self.images_on_device else None  # a batch is its indices and seeds: nothing for workers to do
        return self._loader(
            dataset, self.batch_size, workers, sampler=sampler, drop_last=True, collate_fn=self.batch_views
        )

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
        """With ``augment_on_device``: turn a training batch of uint8 images into views, on the device; with
        ``images_on_device``, a batch of indices and seeds (:meth:`draw_views`)."""
        trainer = self.trainer
        if self.images_on_device and trainer is not None and trainer.training:
            return self.draw_views(batch)
        if self.device_augmentation is None or trainer is None or not trainer.training:
            return batch
        images, targets = batch
        self.device_augmentation.to(images.device)
        devices = [images.device] if images.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=images.device.type):
            # Lightning counts the batch after this hook: the index is the previous batch's, one per batch.
            torch.manual_seed(step_seed(self.seed, trainer.fit_loop.total_batch_idx, trainer.global_rank, stream=1))
            views = self.device_augmentation(images, self.num_views)
        return views, targets

    def draw_views(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``images_on_device``: a training batch ``(indices (B,), seeds (B,))`` on a device ->
        ``(views (B, L, C, S, S), targets (B,))`` drawn there from the stored images, each sample's views from its seed
        alone. Nothing is read on the host."""
        if self.view_augmentation is None:
            raise RuntimeError("draw_views needs images_on_device: true")
        indices, seeds = batch
        self.setup()
        assert self._stored is not None
        if self._stored.device != indices.device:
            self._stored = self._stored.to(indices.device)
        self.view_augmentation.to(indices.device)
        views = self.view_augmentation.views_from_seeds(self._stored.images[indices], seeds, self.num_views)
        return views, self._stored.targets[indices]

    def val_dataloader(self) -> list[DataLoader]:
        """``[BANK, QUERIES]`` loaders of un-augmented ``(image, target)``: the source's labelled evaluation
        splits (usually the train and the test split); none when the source has no labels."""
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
        """The labelled ``(train, test)`` splits of the evaluation protocols: the kNN bank and queries, the
        linear classifier's training and test data."""
        self.setup()
        if self._evaluation is None:
            raise ConfigurationError(
                f"{type(self.source).__name__} has no labelled evaluation splits; kNN and linear evaluation need them"
            )
        return self._evaluation

    def finetune_dataloader(self, indices: Sequence[int] | None = None, seed: int = 0) -> DataLoader:
        """Shuffled (seeded), augmented ``(image, target)`` batches of ``batch_size`` images from the labelled
        training split (or its ``indices``, for label fractions): supervised fine-tuning."""
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
        """``count`` evaluation queries (training images for sources without labels) from index ``start`` on,
        only those of class ``target`` when given (the appendix's figures show samples of one class), without
        augmentation: ``(images (N, C, H, W), targets (N,))``."""
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
        """The first ``count`` images of the split :meth:`evaluation_images` draws from, without augmentation,
        in batches of ``eval_batch_size`` (never all in memory at once)."""
        dataset = EvalDataset(self._figure_split(), self.eval_transform)
        for start in range(0, min(count, len(dataset)), self.eval_batch_size):
            stop = min(start + self.eval_batch_size, count, len(dataset))
            yield torch.stack([dataset[index][0] for index in range(start, stop)])

    def denormalise(self, images: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation: ``(N, 3, H, W)`` network inputs -> pixel values in [0, 1]."""
        mean = torch.tensor(self.source.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.source.std, device=images.device).view(1, -1, 1, 1)
        return (images * std + mean).clamp(0, 1)

    def test_dataloader(self) -> list[DataLoader]:
        return self.val_dataloader()
