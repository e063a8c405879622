"""``MultiViewDataModule``: L-view (or same-class) training batches plus kNN evaluation loaders (SPEC §5)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from hfmca_lightning.data.datasets import (
    EvalDataset,
    MultiViewDataset,
    SameClassDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.sources import ImageSource, LabelledImages
from hfmca_lightning.data.device_augment import DeviceViewAugmentation
from hfmca_lightning.data.transforms import ViewAugmentation, eval_transform, resize_transform, view_transform
from hfmca_lightning.errors import ConfigurationError

__all__ = ["MultiViewDataModule"]


class MultiViewDataModule(LightningDataModule):
    """Multi-view batches for HFMCA and any other SSL method.

    * ``train_dataloader``: ``(views (B, L, C, H, W), target)``. ``mode='views'``: L SimCLR views of each
      image; ``mode='same_class'``: L different images of the same class (each through the same view
      transform; set the strengths to 0 for plain images). ``mode='single'`` (``num_views: 1``): batches of
      single augmented images ``(image (B, C, H, W), target)``, e.g. for internal costs alone.
    * ``val_dataloader``: ``[bank, queries]`` of ``(image (B, C, H, W), target)`` without augmentation:
      the train split (kNN bank) and the test split (kNN queries).
    * ``test_dataloader``: the same ``[bank, queries]`` pair (kNN needs the bank to classify queries).

    Augmentation is drawn per sample from a seed given by the sampler, so runs do not depend on the
    number of workers and resume exactly.

    Args:
        source: where the images come from (``CIFAR``, ``ImageFolderSource``, ``SyntheticShapes``).
        mode: ``views``, ``same_class`` or ``single``.
        num_views: L, members per group.
        batch_size: groups (source images) per training batch.
        eval_batch_size: images per evaluation batch.
        num_workers: DataLoader worker processes.
        seed: seeds shuffling and augmentation.
        crop_strength / color_strength / gray_strength: Table 2 knobs in [0, 1]; null = SimCLR default.
        horizontal_flip: random horizontal flips in the views.
        augment_on_device: ``mode: views`` only. The loader yields resized uint8 images and the views
            are drawn on the accelerator after the batch is transferred (:class:`DeviceViewAugmentation`,
            same distributions, per-sample parameters); frees the CPU workers. Not bit-reproducible
            across worker counts (it uses the device generator).
    """

    def __init__(
        self,
        source: ImageSource,
        mode: Literal["views", "same_class", "single"] = "views",
        num_views: int = 9,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 4,
        seed: int = 0,
        crop_strength: float | None = None,
        color_strength: float | None = None,
        gray_strength: float | None = None,
        horizontal_flip: bool = True,
        augment_on_device: bool = False,
    ) -> None:
        super().__init__()
        if mode not in ("views", "same_class", "single"):
            raise ValueError(f"mode must be 'views', 'same_class' or 'single'; got {mode!r}")
        if mode == "single" and num_views != 1:
            raise ConfigurationError(f"mode 'single' yields one image per sample; set num_views: 1 (got {num_views})")
        if num_views < 1 or batch_size < 1 or eval_batch_size < 1 or num_workers < 0:
            raise ValueError(
                "need num_views >= 1, batch_size >= 1, eval_batch_size >= 1 and num_workers >= 0; got "
                f"{num_views}, {batch_size}, {eval_batch_size}, {num_workers}"
            )
        self.source = source
        self.mode = mode
        self.num_views = num_views
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.seed = seed
        if augment_on_device and mode != "views":
            raise ConfigurationError(f"augment_on_device supports mode 'views' only; got mode {mode!r}")
        self.augment_on_device = augment_on_device
        self.train_transform = view_transform(
            source.image_size, source.mean, source.std, crop_strength, color_strength, gray_strength, horizontal_flip
        )
        spec = ViewAugmentation.from_strengths(source.image_size, crop_strength, color_strength, gray_strength, horizontal_flip)
        self.device_augmentation = DeviceViewAugmentation(spec, source.mean, source.std) if augment_on_device else None
        self.eval_transform = eval_transform(source.image_size, source.mean, source.std)
        self._train_split: LabelledImages | None = None
        self._test_split: LabelledImages | None = None

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self._train_split is None:
            self._train_split = self.source.split(train=True)
            self._test_split = self.source.split(train=False)
            if len(self._train_split) < self.batch_size:
                raise ConfigurationError(
                    f"the training split has {len(self._train_split)} images, fewer than one batch "
                    f"(batch_size={self.batch_size}); lower batch_size"
                )

    def train_dataset(self) -> MultiViewDataset | SameClassDataset | SingleViewDataset:
        self.setup()
        if self.augment_on_device:
            return SingleViewDataset(self._train_split, resize_transform(self.source.image_size), 1)
        dataset_class = {"views": MultiViewDataset, "same_class": SameClassDataset, "single": SingleViewDataset}[self.mode]
        return dataset_class(self._train_split, self.train_transform, self.num_views)

    def _loader(self, dataset: torch.utils.data.Dataset, batch_size: int, **kwargs: object) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Per-process batches of ``batch_size`` groups; under DDP the global batch is ``world_size * batch_size``."""
        dataset = self.train_dataset()
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = SeededRandomSampler(len(dataset), self.seed, num_replicas=replicas, rank=rank)
        return self._loader(dataset, self.batch_size, sampler=sampler, drop_last=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With ``augment_on_device``: turn a training batch of uint8 images into views, on the device."""
        trainer = self.trainer
        if self.device_augmentation is None or trainer is None or not trainer.training:
            return batch
        images, targets = batch
        self.device_augmentation.to(images.device)
        return self.device_augmentation(images, self.num_views), targets

    def val_dataloader(self) -> list[DataLoader]:
        self.setup()
        return [
            self._loader(EvalDataset(self._train_split, self.eval_transform), self.eval_batch_size),
            self._loader(EvalDataset(self._test_split, self.eval_transform), self.eval_batch_size),
        ]

    def evaluation_images(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` test images without augmentation: ``(images (N, C, H, W), targets (N,))``."""
        self.setup()
        dataset = EvalDataset(self._test_split, self.eval_transform)
        items = [dataset[index] for index in range(min(count, len(dataset)))]
        return torch.stack([image for image, _ in items]), torch.tensor([target for _, target in items])

    def denormalise(self, images: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation: ``(N, 3, H, W)`` network inputs -> pixel values in [0, 1]."""
        mean = torch.tensor(self.source.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.source.std, device=images.device).view(1, -1, 1, 1)
        return (images * std + mean).clamp(0, 1)

    def test_dataloader(self) -> list[DataLoader]:
        return self.val_dataloader()
