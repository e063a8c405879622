"""Data: image sources, SimCLR view transforms, multi-view datasets and the DataModule."""

from hfmca_lightning.data.datamodule import BANK, QUERIES, MultiViewDataModule
from hfmca_lightning.data.datasets import (
    EvalDataset,
    MultiViewDataset,
    SameClassDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.sources import CIFAR, ArrayImages, ImageFolderSource, ImageSource, LabelledImages, SyntheticShapes
from hfmca_lightning.data.transforms import ViewAugmentation, eval_transform, view_transform

__all__ = [
    "BANK",
    "QUERIES",
    "CIFAR",
    "ArrayImages",
    "EvalDataset",
    "ImageFolderSource",
    "ImageSource",
    "LabelledImages",
    "MultiViewDataModule",
    "MultiViewDataset",
    "SameClassDataset",
    "SeededRandomSampler",
    "SingleViewDataset",
    "SyntheticShapes",
    "ViewAugmentation",
    "eval_transform",
    "view_transform",
]
