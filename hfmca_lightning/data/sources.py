"""Image sources: where labelled images come from (docs/conventions.md §5).

A source owns the on-disk (or generated) data and hands out the train and test splits as
:class:`LabelledImages`, datasets of ``(uint8 tensor (3, H, W) or PIL image, class index)``. Every
problem (missing root, wrong checksum, unreadable image) is raised by :meth:`ImageSource.prepare` or
:meth:`ImageSource.split`, which the DataModule calls before any training starts.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10 as _TorchvisionCIFAR10
from torchvision.datasets import CIFAR100 as _TorchvisionCIFAR100
from torchvision.datasets import ImageFolder
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from hfmca_lightning.data.synthetic import SHAPES, generate_shapes
from hfmca_lightning.errors import ConfigurationError, DataNotFoundError

__all__ = ["LabelledImages", "ArrayImages", "ImageSource", "CIFAR", "ImageFolderSource", "SyntheticShapes"]

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class LabelledImages(Dataset):
    """A split: ``dataset[i] -> (image, target)``, with all targets available as :attr:`targets`."""

    targets: list[int]


class ArrayImages(LabelledImages):
    """Images held in memory as one ``(N, H, W, 3)`` uint8 array."""

    def __init__(self, images: np.ndarray, targets: Sequence[int]) -> None:
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"expected (N, H, W, 3) uint8 images; got {images.shape} {images.dtype}")
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
        self.targets = [int(t) for t in targets]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.images[index], self.targets[index]


class ImageSource(ABC):
    """Where images come from. Subclasses are configured from YAML with ``class_path`` / ``init_args``."""

    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def prepare(self) -> None:
        """Download (if asked) and check that the data is there; run once, on one process."""

    @abstractmethod
    def split(self, train: bool) -> LabelledImages:
        """The train (``True``) or test (``False``) split."""


class CIFAR(ImageSource):
    """CIFAR10 / CIFAR100 from torchvision's on-disk layout (``cifar-10-batches-py`` / ``cifar-100-python``).

    The pickles are read directly. With ``verify`` (default) each file's md5 is checked against
    torchvision's published checksums, so a truncated download is an error, not silent garbage; set
    ``verify: false`` only for data you wrote yourself in the same layout (as the tests do).

    Args:
        name: ``cifar10`` or ``cifar100`` (fine labels).
        root: folder that holds (or will hold) the extracted data set.
        download: fetch and extract the archive into ``root`` if it is missing.
        verify: check md5 sums.
    """

    image_size = 32

    def __init__(
        self, name: Literal["cifar10", "cifar100"] = "cifar10", root: str = "data", download: bool = False, verify: bool = True
    ) -> None:
        if name not in ("cifar10", "cifar100"):
            raise ConfigurationError(f"CIFAR name must be 'cifar10' or 'cifar100'; got {name!r}", parameter="name")
        self.name = name
        self.root = Path(root).expanduser()
        self.download = download
        self.verify = verify
        self._spec = _TorchvisionCIFAR10 if name == "cifar10" else _TorchvisionCIFAR100
        self.num_classes = 10 if name == "cifar10" else 100
        self.mean, self.std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else (CIFAR100_MEAN, CIFAR100_STD)

    @property
    def folder(self) -> Path:
        return self.root / self._spec.base_folder

    def _files(self) -> list[tuple[str, str]]:
        return [*self._spec.train_list, *self._spec.test_list]

    def _missing(self) -> list[Path]:
        return [self.folder / name for name, _ in self._files() if not (self.folder / name).is_file()]

    def prepare(self) -> None:
        if self._missing() and self.download:
            try:
                download_and_extract_archive(self._spec.url, str(self.root), filename=self._spec.filename, md5=self._spec.tgz_md5)
            except Exception as error:  # network errors come in many types; all mean the same to the user
                raise ConfigurationError(
                    f"could not download {self.name} from {self._spec.url} into {self.root}: {error}. "
                    f"Without network access, copy the extracted '{self._spec.base_folder}' folder into {self.root}."
                ) from error
        missing = self._missing()
        if missing:
            raise DataNotFoundError(
                f"{self.name} not found: looked for {missing[0]} (and {len(missing) - 1} other files). "
                f"Set `download: true` to fetch it (needs network), or set `root` to the folder that "
                f"contains '{self._spec.base_folder}'."
            )
        if self.verify:
            for name, md5 in self._files():
                if not check_integrity(str(self.folder / name), md5):
                    raise ConfigurationError(
                        f"{self.folder / name} does not have the md5 sum of the official {self.name} release "
                        f"(corrupt or partial download?). Delete it and download again; set `verify: false` "
                        "only for data you generated yourself in this layout."
                    )

    def split(self, train: bool) -> ArrayImages:
        self.prepare()
        images, targets = [], []
        label_key = "labels" if self.name == "cifar10" else "fine_labels"
        for name, _ in self._spec.train_list if train else self._spec.test_list:
            with open(self.folder / name, "rb") as handle:
                entry = pickle.load(handle, encoding="latin1")
            images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            targets.extend(entry[label_key])
        return ArrayImages(np.concatenate(images).transpose(0, 2, 3, 1), targets)


class _CheckedImageFolder(ImageFolder):
    """torchvision ImageFolder whose load errors name the file."""

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        try:
            return super().__getitem__(index)
        except (OSError, UnidentifiedImageError) as error:
            raise ConfigurationError(f"cannot read image {self.samples[index][0]}: {error}") from error


class ImageFolderSource(ImageSource):
    """Any ``root/<split>/<class>/<image>`` tree (torchvision ``ImageFolder`` layout).

    Every image header is opened once in :meth:`split`, so an unreadable file is reported by name
    before training starts. Both splits must have the same class folders (by name), none of them empty.

    Args:
        root: folder with one sub-folder per split.
        train_dir / test_dir: names of the split folders.
        image_size: side of the (square) images fed to the network.
        mean / std: normalisation (default ImageNet's).
    """

    def __init__(
        self,
        root: str,
        train_dir: str = "train",
        test_dir: str = "test",
        image_size: int = 32,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
    ) -> None:
        self.root = Path(root).expanduser()
        self.train_dir, self.test_dir = train_dir, test_dir
        self.image_size = image_size
        self.mean, self.std = tuple(mean), tuple(std)  # type: ignore[assignment]
        self.num_classes = 0
        self.classes: list[str] = []

    def prepare(self) -> None:
        for split in (self.train_dir, self.test_dir):
            if not (self.root / split).is_dir():
                raise DataNotFoundError(
                    f"image folder split not found: looked for {self.root / split}. Expected the layout "
                    f"{self.root}/{{{self.train_dir},{self.test_dir}}}/<class name>/<image file>."
                )

    def split(self, train: bool) -> LabelledImages:
        self.prepare()
        root = self.root / (self.train_dir if train else self.test_dir)
        try:
            folder = _CheckedImageFolder(str(root))
        except FileNotFoundError as error:  # torchvision: a class folder without a single image
            raise ConfigurationError(f"{root}: {error}. Add images to that class folder or remove it.") from None
        for path, _ in folder.samples:
            try:
                with Image.open(path) as image:
                    image.size  # noqa: B018 - reads the header
            except (OSError, UnidentifiedImageError) as error:
                raise ConfigurationError(f"cannot read image {path}: {error}. Remove or replace the file.") from error
        if self.classes and folder.classes != self.classes:
            only_train = sorted(set(self.classes) - set(folder.classes))
            only_test = sorted(set(folder.classes) - set(self.classes))
            raise ConfigurationError(
                f"the splits of {self.root} have different class folders (only in {self.train_dir}: {only_train[:5]}; "
                f"only in {self.test_dir}: {only_test[:5]}); kNN and probes need the same classes in both"
            )
        self.classes = list(folder.classes)
        self.num_classes = len(folder.classes)
        return _PILImages(folder)


class _PILImages(LabelledImages):
    def __init__(self, folder: ImageFolder) -> None:
        self.folder = folder
        self.targets = list(folder.targets)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        return self.folder[index]


class SyntheticShapes(ImageSource):
    """The embedded, procedurally generated data set for the offline demo and the tests.

    Each class is a shape (disk, square, triangle, ring, cross, stripes, ...) drawn with random colours,
    position and size over a noisy background; a representation must see shape, not colour, to
    separate the classes. Deterministic from ``seed``; nothing is stored on disk.
    """

    def __init__(
        self, num_classes: int = 10, train_per_class: int = 200, test_per_class: int = 50, image_size: int = 32, seed: int = 0
    ) -> None:
        self.num_classes = num_classes
        self.train_per_class = train_per_class
        self.test_per_class = test_per_class
        self.image_size = image_size
        self.seed = seed
        self.mean, self.std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
        if not 2 <= num_classes <= len(SHAPES):
            raise ConfigurationError(f"SyntheticShapes has {len(SHAPES)} shapes; num_classes must be in [2, {len(SHAPES)}], got {num_classes}", parameter="num_classes")
        for name, value, least in (("train_per_class", train_per_class, 1), ("test_per_class", test_per_class, 1), ("image_size", image_size, 8)):
            if value < least:
                raise ConfigurationError(f"SyntheticShapes needs {name} >= {least}; got {value}", parameter=name)

    def split(self, train: bool) -> ArrayImages:
        per_class = self.train_per_class if train else self.test_per_class
        images, targets = generate_shapes(self.num_classes, per_class, self.image_size, self.seed * 2 + int(not train))
        return ArrayImages(images, targets)
