"""CIFAR10/100 and STL-10 from the files of their official releases in torchvision's on-disk layout: ``prepare``
downloads the archive if asked, names the first missing file and, with ``verify``, checks every file's md5."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import ConcatDataset
from torchvision.datasets import CIFAR10 as _TorchvisionCIFAR10
from torchvision.datasets import CIFAR100 as _TorchvisionCIFAR100
from torchvision.datasets import STL10 as _TorchvisionSTL10
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from hfmca_lightning.data.sources import UNLABELLED, ArrayImages, ImageSource, LabelledImages
from hfmca_lightning.errors import ConfigurationError, DataNotFoundError, check_choice

__all__ = ["CIFAR", "STL10"]

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class _ReleaseSource(ImageSource):
    """A source whose files are those of an official release, as the torchvision class ``_spec`` names them."""

    root: Path
    download: bool
    verify: bool
    _spec: Any  # the torchvision data set class: url, filename, tgz_md5, base_folder, train_list, test_list
    _label: str  # the data set's name in messages
    _prepared = False  # a source checks its files once (an md5 pass reads every byte), with its first settings

    @property
    def folder(self) -> Path:
        return self.root / self._spec.base_folder

    def prepare(self) -> None:
        if self._prepared:
            return
        files = {self.folder / name: md5 for name, md5 in [*self._spec.train_list, *self._spec.test_list]}
        if self.download and not all(path.is_file() for path in files):
            try:
                download_and_extract_archive(
                    self._spec.url, str(self.root), filename=self._spec.filename, md5=self._spec.tgz_md5
                )
            except Exception as error:  # network errors come in many types; all mean the same to the user
                raise ConfigurationError(
                    f"could not download {self._label} from {self._spec.url} into {self.root}: {error}. Without "
                    f"network access, copy the extracted '{self._spec.base_folder}' folder into {self.root}."
                ) from error
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise DataNotFoundError(
                f"{self._label} not found: looked for {missing[0]} (and {len(missing) - 1} other files). Set "
                f"`download: true` to fetch it (needs network), or set `root` to the folder that holds "
                f"'{self.folder.name}'."
            )
        for path, md5 in files.items():
            if self.verify and not check_integrity(str(path), md5):
                raise ConfigurationError(
                    f"{path} does not have the md5 sum of the official {self._label} release (corrupt or partial "
                    "download?). Delete it and download again; set `verify: false` only for data you wrote yourself."
                )
        self._prepared = True


class CIFAR(_ReleaseSource):
    """CIFAR10 / CIFAR100 (fine labels) in torchvision's layout (``cifar-10-batches-py`` / ``cifar-100-python``) under
    ``root``. Its pickles are read by an unpickler building only dicts, lists and numpy arrays (a pickle can run code).

    Args:
        name: ``cifar10`` or ``cifar100``.
        root: folder that holds (or will hold) the extracted data set.
        download: fetch and extract the archive into ``root`` if it is missing.
        verify: check md5 sums (``false`` only for data you wrote in this layout yourself).

    Raises:
        ConfigurationError: when ``name`` is neither of the above.
    """

    image_size = 32

    def __init__(
        self,
        name: Literal["cifar10", "cifar100"] = "cifar10",
        root: str = "data",
        download: bool = False,
        verify: bool = True,
    ) -> None:
        check_choice(name, ("cifar10", "cifar100"), "name", "CIFAR")
        self.name = self._label = name
        self.root, self.download, self.verify = Path(root).expanduser(), download, verify
        self._spec, self.num_classes = (_TorchvisionCIFAR10, 10) if name == "cifar10" else (_TorchvisionCIFAR100, 100)
        self.mean, self.std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else (CIFAR100_MEAN, CIFAR100_STD)
        self._splits: dict[bool, ArrayImages] = {}  # read once: the training split is also the kNN bank

    def split(self, train: bool) -> ArrayImages:
        if train not in self._splits:
            self.prepare()
            label_key = "labels" if self.name == "cifar10" else "fine_labels"
            files = self._spec.train_list if train else self._spec.test_list
            images, labels = zip(*(_read_cifar_batch(self.folder / name, label_key) for name, _ in files))
            targets = [target for batch in labels for target in batch]
            if not all(0 <= target < self.num_classes for target in targets):
                raise ConfigurationError(
                    f"{self.folder}: the labels of {self.name} are 0 to {self.num_classes - 1}, but its files hold "
                    f"{min(targets)} to {max(targets)}; replace them with the files of the official release"
                )
            self._splits[train] = ArrayImages(np.concatenate(images).transpose(0, 2, 3, 1), targets)
        return self._splits[train]


# The only globals of a CIFAR batch (python format): numpy arrays (1.x: numpy.core, 2.x: numpy._core) pickled with
# protocols 0-4 (_reconstruct, ndarray, dtype) or 5 (_frombuffer), Python 3 bytes with protocols 0-2 (_codecs.encode).
CIFAR_PICKLE_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }
)


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a global that a CIFAR batch never holds."""


class _CIFARUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CIFAR_PICKLE_GLOBALS:
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, list[int]]:
    """The ``(N, 3, 32, 32)`` uint8 images and ``N`` labels of a CIFAR batch file; one clear error for any other."""
    try:
        with open(path, "rb") as handle:
            entry = _CIFARUnpickler(handle, encoding="latin1").load()
    except _RefusedGlobal as error:
        raise ConfigurationError(
            f"{path} is not a CIFAR batch: its pickle refers to {error}, which CIFAR batches never do (a pickle can "
            "run code, so it was not read). Replace it with the official release's file, checked by `verify: true`."
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise ConfigurationError(
            f"{path} is not a readable CIFAR batch (truncated or corrupt?): {error}. Replace it with the file of the "
            "official release."
        ) from None
    try:
        images, labels = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32), entry[label_key]
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        return images, [int(label) for label in labels]
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ConfigurationError(
            f"{path} is not a CIFAR batch: it holds no 3 x 32 x 32 uint8 'data' with one '{label_key}' entry per "
            f"image ({type(error).__name__}: {error})"
        ) from None


class _BinaryImages(LabelledImages):
    """STL-10's ``*_X.bin`` (uint8, column-major 3 x 96 x 96 per image), memory-mapped, with its labels."""

    def __init__(self, images: np.ndarray, targets: Sequence[int] | np.ndarray) -> None:
        self.images, self.targets = images, [int(t) for t in targets]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.from_numpy(np.ascontiguousarray(self.images[index].transpose(0, 2, 1))), self.targets[index]


class _ConcatImages(ConcatDataset, LabelledImages):
    def __init__(self, parts: list[LabelledImages]) -> None:
        super().__init__(parts)
        self.targets = [target for part in parts for target in part.targets]


class STL10(_ReleaseSource):
    """STL-10 (torchvision's ``stl10_binary`` under ``root``; 2.6 GB), memory-mapped, 96 x 96: training uses the 100k
    unlabelled images (and the 5k labelled: ``train_on_labelled``), kNN the labelled as bank, the 8k test as queries.

    Args:
        root: folder that holds (or will hold) ``stl10_binary``.
        download: fetch and extract the archive if it is missing.
        verify: check md5 sums (``false`` only for data you wrote in this layout yourself).
        train_on_labelled: add the 5k labelled training images to the training split (the usual protocol).
        image_size: side fed to the network (96: no resize).
    """

    mean, std = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)
    num_classes = 10
    _spec = _TorchvisionSTL10
    _label = "STL-10"

    def __init__(
        self,
        root: str = "data",
        download: bool = False,
        verify: bool = True,
        train_on_labelled: bool = True,
        image_size: int = 96,
    ) -> None:
        self._image_settings(image_size, None, self.mean, self.std)
        self.root, self.download, self.verify = Path(root).expanduser(), download, verify
        self.train_on_labelled = train_on_labelled

    def _read(self, name: str) -> _BinaryImages:
        self.prepare()
        images_file = self.folder / f"{name}_X.bin"
        size = images_file.stat().st_size
        if size == 0 or size % (3 * 96 * 96):
            raise ConfigurationError(
                f"{images_file} holds {size} bytes, not a whole number of 3 x 96 x 96 images (truncated?); replace it "
                "with the file of the official release"
            )
        images = np.memmap(images_file, dtype=np.uint8, mode="r").reshape(-1, 3, 96, 96)
        labels_file = self.folder / f"{name}_y.bin"
        if not labels_file.is_file():
            return _BinaryImages(images, [UNLABELLED] * len(images))
        targets = np.fromfile(labels_file, dtype=np.uint8).astype(np.int64) - 1
        if len(targets) != len(images):
            raise ConfigurationError(f"{labels_file} has {len(targets)} labels for {len(images)} images")
        if not 0 <= targets.min() <= targets.max() < self.num_classes:  # len(targets) > 0: the file holds images
            raise ConfigurationError(
                f"{labels_file} holds labels {targets.min() + 1} to {targets.max() + 1}; STL-10's are 1 to 10. Replace "
                "it with the file of the official release"
            )
        return _BinaryImages(images, targets)

    def split(self, train: bool) -> LabelledImages:
        return self._read("train" if train else "test")

    def training_split(self) -> LabelledImages:
        unlabelled = self._read("unlabeled")
        return _ConcatImages([unlabelled, self._read("train")]) if self.train_on_labelled else unlabelled
