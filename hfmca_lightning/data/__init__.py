"""Data: image sources, view specs (what to draw), drawers (where to draw it), the DataModule; internals: submodules."""

from hfmca_lightning.data.archive_sources import CIFAR, STL10
from hfmca_lightning.data.datamodule import MultiViewDataModule
from hfmca_lightning.data.dataset_source import DatasetSource
from hfmca_lightning.data.drawers import BatchedDrawer, TorchvisionDrawer
from hfmca_lightning.data.folder_sources import ImageFolderSource, UnlabelledFolderSource
from hfmca_lightning.data.resident import ResidentDrawer
from hfmca_lightning.data.sources import ImageSource
from hfmca_lightning.data.synthetic import SyntheticShapes
from hfmca_lightning.data.view_specs import MultiCrop, SameClassViews, SimCLRViews, SingleView, TransformViews

__all__ = [
    "CIFAR",
    "STL10",
    "BatchedDrawer",
    "DatasetSource",
    "ImageFolderSource",
    "ImageSource",
    "MultiCrop",
    "MultiViewDataModule",
    "ResidentDrawer",
    "SameClassViews",
    "SimCLRViews",
    "SingleView",
    "SyntheticShapes",
    "TorchvisionDrawer",
    "TransformViews",
    "UnlabelledFolderSource",
]
