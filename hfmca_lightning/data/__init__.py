"""Data: image sources, SimCLR view transforms, multi-view datasets and the DataModule."""

from hfmca_lightning.data.batch_formats import BATCH_FORMATS, ViewBatch, first_views, format_batch
from hfmca_lightning.data.datamodule import BANK, QUERIES, MultiViewDataModule
from hfmca_lightning.data.dataset_source import DatasetSource
from hfmca_lightning.data.datasets import (
    EvalDataset,
    MultiViewDataset,
    SameClassDataset,
    SeededRandomSampler,
    SingleViewDataset,
)
from hfmca_lightning.data.sources import (
    CIFAR,
    STL10,
    UNLABELLED,
    ArrayImages,
    FolderImages,
    ImageFolderSource,
    ImageSource,
    LabelledImages,
    SyntheticShapes,
    UnlabelledFolderSource,
)
from hfmca_lightning.data.transforms import ViewAugmentation, eval_transform, view_transform, view_transforms
from hfmca_lightning.data.views import (
    BatchedViews,
    MultiCrop,
    ResidentViews,
    TorchvisionViews,
    TransformViews,
    ViewPipeline,
)

__all__ = [
    "BATCH_FORMATS",
    "BatchedViews",
    "MultiCrop",
    "ResidentViews",
    "TorchvisionViews",
    "TransformViews",
    "ViewBatch",
    "ViewPipeline",
    "first_views",
    "format_batch",
    "BANK",
    "QUERIES",
    "CIFAR",
    "DatasetSource",
    "STL10",
    "UNLABELLED",
    "ArrayImages",
    "FolderImages",
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
    "UnlabelledFolderSource",
    "ViewAugmentation",
    "eval_transform",
    "view_transform",
    "view_transforms",
]
