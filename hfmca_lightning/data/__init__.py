"""Data: image sources, SimCLR view transforms, multi-view datasets and the DataModule."""

from hfmca_lightning.data.datamodule import MultiViewDataModule
from hfmca_lightning.data.datasets import (
    EvalDataset,
    MultiViewDataset,
    SameClassDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.sources import CIFAR, ArrayImages, ImageFolderSource, ImageSource, LabelledImages, SyntheticShapes
from hfmca_lightning.data.transforms import eval_transform, view_transform

__all__ = [
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
    "eval_transform",
    "view_transform",
]
