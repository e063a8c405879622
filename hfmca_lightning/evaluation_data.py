"""Images and batches of a :class:`~hfmca_lightning.data.MultiViewDataModule` for evaluation, analysis and figures:
the labelled splits, un-augmented images of one class, fine-tuning batches, and the training views of a trained
model's data (``hfmca analyze``)."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.data.datamodule import QUERIES, MultiViewDataModule
from hfmca_lightning.data.datasets import EvalDataset, SeededRandomSampler
from hfmca_lightning.data.sources import UNLABELLED, LabelledImages
from hfmca_lightning.data.transforms import finetune_transform
from hfmca_lightning.errors import ConfigurationError

__all__ = ["denormalise", "figure_batches", "figure_images", "finetune_loader", "labelled_splits", "view_batches"]


def labelled_splits(data: MultiViewDataModule) -> tuple[LabelledImages, LabelledImages]:
    """``(train, test)``: the kNN bank and queries, the linear classifier's training and test data.

    Raises:
        ConfigurationError: when the source has no labelled evaluation splits.
    """
    if data.evaluation_splits is None:
        raise ConfigurationError(
            f"{type(data.source).__name__} has no labelled evaluation splits; kNN and linear evaluation need them"
        )
    return data.evaluation_splits


def finetune_loader(data: MultiViewDataModule, indices: Sequence[int] | None = None, seed: int = 0) -> DataLoader:
    """Shuffled, augmented ``(image (B, C, H, W), target (B,))`` batches of ``data.batch_size`` from the labelled
    training split (``indices``: the samples to use, for label fractions), for supervised fine-tuning.

    Raises:
        ConfigurationError: when the source has no labelled evaluation splits.
    """
    train, _ = labelled_splits(data)
    source = data.source
    dataset = EvalDataset(train, finetune_transform(source.image_size, source.mean, source.std))
    subset = dataset if indices is None else Subset(dataset, list(indices))
    return data.loader(
        subset,
        data.batch_size,
        shuffle=True,
        drop_last=len(subset) > data.batch_size,
        generator=torch.Generator().manual_seed(seed),
    )


def _figure_split(data: MultiViewDataModule) -> LabelledImages:
    """The test split, or the training split of a source without labels."""
    splits = data.evaluation_splits
    return splits[QUERIES] if splits is not None else data.training_split


def figure_images(
    data: MultiViewDataModule, count: int, target: int | None = None, start: int = 0
) -> tuple[Tensor, Tensor]:
    """Up to ``count`` un-augmented images of the test split (the training split without labels) from index
    ``start`` on: of class ``target`` only where given (the appendix's figures show one class); else taken from each
    class in turn, in order (the first image of every class, then the second, ...), so that splits stored class by
    class (image folders) show several classes too.

    Returns:
        ``(images (N, C, H, W), targets (N,))``, ``N <= count``.

    Raises:
        ConfigurationError: when the split has no such image.
    """
    split = _figure_split(data)
    dataset = EvalDataset(split, data.eval_transform)
    indices = [index for index in range(start, len(split)) if target is None or split.targets[index] == target]
    if not indices:
        which = f" of class {target}" if target is not None else ""
        classes = sorted(set(split.targets) - {UNLABELLED})
        listed = ", ".join(map(str, classes[:10])) + (f", ... ({len(classes)} classes)" if len(classes) > 10 else "")
        present = f"; classes {listed}" if classes else ""
        raise ConfigurationError(
            f"the evaluation split has no images{which} from index {start} on ({len(split)} images{present})"
        )
    items = [dataset.labelled_image(index) for index in _classes_in_turn(indices, split.targets)[:count]]
    return torch.stack([image for image, _ in items]), torch.tensor([label for _, label in items])


def _classes_in_turn(indices: list[int], targets: Sequence[int]) -> list[int]:
    """``indices`` reordered by their rank within their class, then by class: ``a0 b0 c0 a1 b1 ...``."""
    seen: dict[int, int] = {}
    ranks = []
    for index in indices:
        ranks.append(seen.get(targets[index], 0))
        seen[targets[index]] = ranks[-1] + 1
    return [index for _, _, index in sorted(zip(ranks, (targets[i] for i in indices), indices))]


def figure_batches(data: MultiViewDataModule, count: int) -> Iterator[Tensor]:
    """The first ``count`` images of :func:`figure_images`'s split in its order, un-augmented, in ``(B, C, H, W)``
    batches of at most ``data.eval_batch_size`` (never all in memory at once)."""
    dataset = EvalDataset(_figure_split(data), data.eval_transform)
    for start in range(0, min(count, len(dataset)), data.eval_batch_size):
        stop = min(start + data.eval_batch_size, count, len(dataset))
        yield torch.stack([dataset.labelled_image(index)[0] for index in range(start, stop)])


def denormalise(data: MultiViewDataModule, images: Tensor) -> Tensor:
    """``(N, 3, H, W)`` network inputs -> pixel values in [0, 1] (the source's normalisation undone)."""
    mean = torch.tensor(data.source.mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(data.source.std, device=images.device).view(1, -1, 1, 1)
    return (images * std + mean).clamp(0, 1)


def view_batches(
    data: MultiViewDataModule, device: torch.device, limit: int | None = None
) -> Generator[ViewBatch, None, None]:
    """Training batches drawn by the data's spec and drawer, whatever they are, on ``device`` (one epoch, or
    ``limit`` batches). The loader's workers stop when the iteration ends or is closed.

    Yields:
        :class:`~hfmca_lightning.data.batch_formats.ViewBatch` on ``device``.
    """
    loader = data.training_loader(
        SeededRandomSampler(len(data.training_split), data.seed), None, persistent_workers=False
    )
    iterator = iter(loader)
    try:
        for number, batch in enumerate(iterator):
            if limit is not None and number >= limit:
                break
            batch = move_data_to_device(batch, device)
            yield data.drawer.draw(batch) if data.drawer.draws_on_device else batch
    finally:
        del iterator  # not persistent: its workers stop with it
