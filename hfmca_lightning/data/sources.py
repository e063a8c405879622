"""Image sources: where the images come from (docs/conventions.md §5).

A source owns the on-disk (or generated) data and hands out its splits as :class:`LabelledImages`,
datasets of ``(uint8 tensor (3, H, W) or PIL image, class index)``: the training split (labels may be
unknown, ``-1``) and, when it has labels, the evaluation splits (kNN bank and queries). Missing roots,
wrong checksums and malformed trees are raised by :meth:`ImageSource.prepare` or the split methods, which
the DataModule calls before any training starts; an image that cannot be decoded is found when it is
first read (folders of a million files start in seconds).
"""

from __future__ import annotations

import os
import pickle
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10 as _TorchvisionCIFAR10
from torchvision.datasets import CIFAR100 as _TorchvisionCIFAR100
from torchvision.datasets import STL10 as _TorchvisionSTL10
from torchvision.datasets.utils import check_integrity, download_and_extract_archive
from torchvision.io import ImageReadMode, decode_image

from hfmca_lightning.data.synthetic import SHAPES, generate_shapes
from hfmca_lightning.errors import ConfigurationError, DataNotFoundError, HFMCAWarning

__all__ = [
    "ArrayImages",
    "CIFAR",
    "FolderImages",
    "ImageFolderSource",
    "ImageSource",
    "LabelledImages",
    "STL10",
    "SyntheticShapes",
    "UnlabelledFolderSource",
    "UNLABELLED",
]

UNLABELLED = -1  # the target of an image without a class
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def channel_values(values: Sequence[float], name: str) -> tuple[float, float, float]:
    """Per-channel normalisation values (RGB) as a triple; one clear error for anything else."""
    if len(values) != 3:
        raise ConfigurationError(
            f"{name} needs one value per RGB channel (3 values); got {list(values)}", parameter=name
        )
    return float(values[0]), float(values[1]), float(values[2])


class LabelledImages(Dataset):
    """A split: ``dataset[i] -> (image, target)``, with all targets available as :attr:`targets`."""

    targets: list[int]


class ArrayImages(LabelledImages):
    """Images held in memory as one ``(N, H, W, 3)`` uint8 array: ``dataset[i] -> (uint8 tensor (3, H, W), target)``.

    Args:
        images: ``(N, H, W, 3)`` uint8 array.
        targets: ``N`` class indices (``UNLABELLED`` for images without a class).

    Raises:
        ValueError: when ``images`` is not an ``(N, H, W, 3)`` uint8 array or ``targets`` has not ``N`` entries.
    """

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
    """Where images come from. Subclasses are configured from YAML with ``class_path`` / ``init_args``.

    ``eval_resize``: the shorter side evaluation images are resized to before the centre crop of
    ``image_size`` (``None``: ``image_size``; ImageNet's convention is 256 for 224).
    """

    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    eval_resize: int | None = None

    def prepare(self) -> None:  # noqa: B027 - optional: sources without files to fetch or check keep this no-op
        """Download (if asked) and check that the data is there; run once, on one process."""

    @abstractmethod
    def split(self, train: bool) -> LabelledImages:
        """One split of the source.

        Args:
            train: the train (``True``) or test (``False``) split.

        Returns:
            The split's images and targets.
        """

    def training_split(self) -> LabelledImages:
        """The images the model trains on.

        Returns:
            The training split (targets may be ``UNLABELLED``).
        """
        return self.split(train=True)

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        """The labelled splits of the evaluation protocols.

        Returns:
            ``(bank, queries)`` for kNN and probes, both labelled, or ``None`` when the source has no labels.
        """
        return self.split(train=True), self.split(train=False)


class CIFAR(ImageSource):
    """CIFAR10 / CIFAR100 from torchvision's on-disk layout (``cifar-10-batches-py`` / ``cifar-100-python``).

    The pickles are read directly, by an unpickler that builds dicts, lists and numpy arrays and refuses
    anything else (a pickle can run code). With ``verify`` (default) each file's md5 is checked against
    torchvision's published checksums, so a truncated download is an error, not silent garbage; set
    ``verify: false`` only for data you wrote yourself in the same layout (as the tests do).

    Args:
        name: ``cifar10`` or ``cifar100`` (fine labels).
        root: folder that holds (or will hold) the extracted data set.
        download: fetch and extract the archive into ``root`` if it is missing.
        verify: check md5 sums.

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
                download_and_extract_archive(
                    self._spec.url, str(self.root), filename=self._spec.filename, md5=self._spec.tgz_md5
                )
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
            entry = _read_cifar_batch(self.folder / name)
            images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            targets.extend(entry[label_key])
        return ArrayImages(np.concatenate(images).transpose(0, 2, 3, 1), targets)


# The only globals a CIFAR batch (python format) refers to: its arrays, as numpy (1.x: numpy.core, 2.x: numpy._core)
# pickles them with protocols 0-4 (_reconstruct, ndarray, dtype) or 5 (_frombuffer), and bytes as Python 3 writes
# them with protocols 0-2 (_codecs.encode).
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
    """``pickle.Unpickler`` that builds dicts, lists, strings, numbers and numpy arrays, and nothing else: a pickle
    can call any function it names, so every other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CIFAR_PICKLE_GLOBALS:
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> dict:
    """One CIFAR batch file (python format), read with :class:`_CIFARUnpickler`; one clear error for anything else."""
    try:
        with open(path, "rb") as handle:
            entry = _CIFARUnpickler(handle, encoding="latin1").load()
    except _RefusedGlobal as error:
        raise ConfigurationError(
            f"{path} is not a CIFAR batch: its pickle refers to {error}, which CIFAR batches never do (a pickle can "
            "run code, so it was not read). Replace it with the file of the official release, checked by `verify: "
            "true`."
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise ConfigurationError(
            f"{path} is not a readable CIFAR batch (truncated or corrupt?): {error}. Replace it with the file of the "
            "official release."
        ) from None
    if not isinstance(entry, dict):
        raise ConfigurationError(
            f"{path} is not a CIFAR batch: it holds a {type(entry).__name__}, not a dict of arrays and labels"
        )
    return entry


class FolderImages(LabelledImages):
    """Image files decoded when read: ``dataset[i] -> (uint8 tensor (3, H, W), target)``.

    JPEG, PNG, WebP and GIF go through torchvision's decoders (libjpeg-turbo), anything else through PIL.
    A file that cannot be decoded is, with ``on_bad_image='error'``, a :class:`ConfigurationError` naming
    it; with ``'skip'``, a warning naming it (and how many were skipped so far in this process) and the
    next readable image of the list in its place, so an epoch keeps its length.

    Args:
        samples: ``(path, target)`` of every image.
        on_bad_image: ``error`` or ``skip``.
    """

    def __init__(self, samples: list[tuple[str, int]], on_bad_image: Literal["error", "skip"] = "error") -> None:
        self.samples = samples
        self.targets = [target for _, target in samples]
        self.on_bad_image = on_bad_image
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        for attempt in range(min(len(self.samples), 100)):
            path, target = self.samples[(index + attempt) % len(self.samples)]
            try:
                return read_image(path), target
            except (OSError, RuntimeError, ValueError, UnidentifiedImageError) as error:
                if self.on_bad_image == "error":
                    raise ConfigurationError(
                        f"cannot read image {path}: {error}. Remove or replace the file, or set on_bad_image: skip."
                    ) from None
                self.skipped += 1
                warnings.warn(
                    f"skipping unreadable image {path} ({error}); {self.skipped} skipped so far in this process",
                    HFMCAWarning,
                    stacklevel=2,
                )
        raise ConfigurationError(
            f"no readable image among 100 files from {self.samples[index][0]}: check the data folder"
        )


def read_image(path: str) -> Tensor:
    """An image file as an RGB uint8 tensor ``(3, H, W)``."""
    if path.lower().endswith((".jpg", ".jpeg", ".png", ".webp", ".gif")):
        try:
            return decode_image(path, mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # e.g. CMYK JPEGs, PNGs named .jpg: PIL reads those
    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)


def _contains(directory: str, path: str) -> bool:
    """Whether the real path ``directory`` is ``path`` or a folder above it."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _image_files(folder: Path) -> list[str]:
    """Every image file under ``folder`` (recursively, links followed), each file once, in walk order (a folder's
    files by name, then its sub-folders by name); no file is opened.

    Each directory is entered at most once (by its ``(st_dev, st_ino)``), and a link to a directory that holds
    ``folder`` (``up -> ..``: the folder's siblings, other classes or splits) is not followed, so a link loop
    (``self -> .``) neither lists an image many times nor walks forever. A file reached under several names (hard
    links, links to a file) is listed under its first name: names of plain files are told apart by their inode
    number from the directory listing (no call per file), links to files by their target's ``(st_dev, st_ino)``.
    """
    try:
        top = os.stat(folder)
    except OSError:
        return []
    root = os.path.realpath(folder)
    visited = {(top.st_dev, top.st_ino)}
    seen: set[tuple[int, int]] = set()
    found: list[str] = []
    pending = [(os.fspath(folder), top.st_dev)]
    while pending:
        directory, device = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError:  # unreadable, or gone since it was listed: skipped, as os.walk does
            continue
        subdirectories = []
        for entry in entries:
            try:
                is_directory = entry.is_dir()
            except OSError:
                is_directory = False
            if is_directory:
                try:
                    status = entry.stat()
                except OSError:
                    continue
                key = (status.st_dev, status.st_ino)
                if key in visited or (entry.is_symlink() and _contains(os.path.realpath(entry.path), root)):
                    continue
                visited.add(key)
                subdirectories.append((entry.path, status.st_dev))
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                identity: tuple[int, int] | None = (device, entry.inode())
                if entry.is_symlink():
                    try:
                        status = entry.stat()
                        identity = (status.st_dev, status.st_ino)
                    except OSError:  # a broken link: listed, and named when it cannot be read
                        identity = None
                if identity is not None:
                    if identity in seen:
                        continue
                    seen.add(identity)
                found.append(entry.path)
        pending.extend(reversed(subdirectories))
    return found


def _class_folders(folder: Path) -> list[str]:
    """The names of ``folder``'s sub-folders, sorted, without links back to ``folder`` or above it (``self -> .``,
    ``up -> ..``: not classes, but the split again)."""
    split = os.path.realpath(folder)
    with os.scandir(folder) as listing:
        return sorted(
            entry.name
            for entry in listing
            if entry.is_dir() and not (entry.is_symlink() and _contains(os.path.realpath(entry.path), split))
        )


def _read_class_list(path: str) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in Path(path).expanduser().read_text().splitlines()]
    classes = [line for line in lines if line]
    if not classes or len(set(classes)) != len(classes):
        raise ConfigurationError(
            f"class_list {path} must list distinct class folder names, one per line", parameter="class_list"
        )
    return sorted(classes)


class ImageFolderSource(ImageSource):
    """Any ``root/<split>/<class>/<image>`` tree (torchvision ``ImageFolder`` layout), ImageNet included.

    Start-up only lists the files (no image is opened: 100k files take well under a second); images are
    decoded when read, an unreadable one handled by ``on_bad_image``. Classes are the folder names,
    sorted; both splits must have the same classes, none of them empty. Links are followed, each folder and
    each image once: a link back up the tree (``self -> .``, ``up -> ..``) is skipped, not walked again.

    Args:
        root: folder with one sub-folder per split.
        train_dir: name of the training split's folder.
        test_dir: name of the test split's folder (ImageNet: ``val``); ``test_dir: null`` trains without kNN
            evaluation.
        class_list: a text file of class folder names, one per line (``#`` comments); only those classes
            are used (``configs/imagenet100_classes.txt``: ImageNet-100).
        image_size: side of the (square) images fed to the network.
        eval_resize: shorter side of evaluation images before the centre crop (ImageNet: 256 for 224).
        mean: per-channel normalisation mean (default ImageNet's).
        std: per-channel normalisation standard deviation (default ImageNet's).
        on_bad_image: ``error`` (default; names the file) or ``skip`` (warns, counts, reads the next image).

    Raises:
        ConfigurationError: when ``on_bad_image`` is neither of the above or ``mean`` / ``std`` are not three values.
    """

    def __init__(
        self,
        root: str,
        train_dir: str = "train",
        test_dir: str | None = "test",
        class_list: str | None = None,
        image_size: int = 224,
        eval_resize: int | None = None,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        on_bad_image: Literal["error", "skip"] = "error",
    ) -> None:
        if on_bad_image not in ("error", "skip"):
            raise ConfigurationError(
                f"on_bad_image must be 'error' or 'skip'; got {on_bad_image!r}", parameter="on_bad_image"
            )
        self.root = Path(root).expanduser()
        self.train_dir, self.test_dir = train_dir, test_dir
        self.class_list = class_list
        self.image_size = image_size
        self.eval_resize = eval_resize
        self.mean, self.std = channel_values(mean, "mean"), channel_values(std, "std")
        self.on_bad_image = on_bad_image
        self.classes: list[str] | None = None
        self.num_classes = 0
        self._splits: dict[bool, FolderImages] = {}

    def _folder(self, train: bool) -> Path:
        return self.root / (self.train_dir if train else str(self.test_dir))

    def prepare(self) -> None:
        if self.class_list is not None and self.classes is None:
            if not Path(self.class_list).expanduser().is_file():
                raise DataNotFoundError(
                    f"class_list file not found: {Path(self.class_list).expanduser().resolve()} (relative paths "
                    "start at the working folder)"
                )
            self.classes = _read_class_list(self.class_list)
            self.num_classes = len(self.classes)
        splits = [self.train_dir] + ([self.test_dir] if self.test_dir is not None else [])
        for split in splits:
            if not (self.root / split).is_dir():
                raise DataNotFoundError(
                    f"image folder split not found: looked for {self.root / split}. Expected the layout "
                    f"{self.root}/{{{','.join(splits)}}}/<class name>/<image file>."
                )

    def split(self, train: bool) -> FolderImages:
        if train not in self._splits:
            self.prepare()
            if not train and self.test_dir is None:
                raise ConfigurationError(f"{self.root} has no test split (test_dir is null)", parameter="test_dir")
            self._splits[train] = self._scan(self._folder(train))
        return self._splits[train]

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        return None if self.test_dir is None else (self.split(True), self.split(False))

    def _scan(self, folder: Path) -> FolderImages:
        present = _class_folders(folder)
        if not present:
            raise ConfigurationError(
                f"{folder} has no class folders: ImageFolderSource expects one sub-folder of images per class, "
                f"{folder}/<class name>/<image file> (for images without classes, use UnlabelledFolderSource)"
            )
        if self.classes is None:
            self.classes = present
            self.num_classes = len(present)
        missing = sorted(set(self.classes) - set(present))
        if self.class_list is not None and missing:
            raise ConfigurationError(
                f"{folder} lacks {len(missing)} classes of class_list {self.class_list} (e.g. {missing[:3]}); "
                "kNN and probes need the same classes in every split"
            )
        extra = sorted(set(present) - set(self.classes)) if self.class_list is None else []
        if missing or extra:
            raise ConfigurationError(
                f"the splits of {self.root} have different class folders (only in {self.train_dir}: {missing[:5]}; "
                f"only in {folder.name}: {extra[:5]}); kNN and probes need the same classes in every split"
            )
        samples: list[tuple[str, int]] = []
        for target, name in enumerate(self.classes):
            files = _image_files(folder / name)
            if not files:
                raise ConfigurationError(
                    f"{folder / name}: Found no valid file for the classes {name}. Add images to that class folder "
                    "or remove it."
                )
            samples += [(path, target) for path in files]
        return FolderImages(samples, self.on_bad_image)


class UnlabelledFolderSource(ImageSource):
    """Any tree of images without classes (every image file under ``root``), for training only.

    kNN evaluation needs labels: give ``evaluation`` (a labelled source, e.g. an ``ImageFolderSource`` of a
    labelled subset) for its bank and queries; without it, training runs and kNN is skipped with a warning.
    Links are followed as in :class:`ImageFolderSource`: each folder and each image once.

    Args:
        root: folder searched recursively for image files.
        image_size: as :class:`ImageFolderSource`.
        eval_resize: as :class:`ImageFolderSource`.
        mean: as :class:`ImageFolderSource`.
        std: as :class:`ImageFolderSource`.
        on_bad_image: as :class:`ImageFolderSource`.
        evaluation: the labelled source whose evaluation splits kNN and probes use.

    Raises:
        ConfigurationError: when ``mean`` / ``std`` are not three values.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        eval_resize: int | None = None,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        on_bad_image: Literal["error", "skip"] = "error",
        evaluation: ImageSource | None = None,
    ) -> None:
        self.root = Path(root).expanduser()
        self.image_size = image_size
        self.eval_resize = eval_resize
        self.mean, self.std = channel_values(mean, "mean"), channel_values(std, "std")
        self.on_bad_image = on_bad_image
        self.evaluation = evaluation
        self.num_classes = evaluation.num_classes if evaluation is not None else 0
        self._images: FolderImages | None = None

    def prepare(self) -> None:
        if not self.root.is_dir():
            raise DataNotFoundError(f"image folder not found: looked for {self.root}")
        if self.evaluation is not None:
            self.evaluation.prepare()

    def split(self, train: bool) -> LabelledImages:
        if not train:
            splits = self.evaluation_splits()
            if splits is None:
                raise ConfigurationError(
                    f"{self.root} has no labels: give `evaluation` a labelled source for test images"
                )
            return splits[1]
        if self._images is None:
            self.prepare()
            files = _image_files(self.root)
            if not files:
                raise ConfigurationError(
                    f"no image files under {self.root} (extensions: {', '.join(IMAGE_EXTENSIONS)})"
                )
            self._images = FolderImages([(path, UNLABELLED) for path in files], self.on_bad_image)
        return self._images

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        if self.evaluation is None:
            return None
        splits = self.evaluation.evaluation_splits()
        self.num_classes = self.evaluation.num_classes
        return splits


class _BinaryImages(LabelledImages):
    """STL-10's ``*_X.bin`` (uint8, column-major 3 x 96 x 96 per image), memory-mapped, with its labels."""

    def __init__(self, images: np.ndarray, targets: Sequence[int]) -> None:
        self.images = images
        self.targets = [int(t) for t in targets]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.from_numpy(np.ascontiguousarray(self.images[index].transpose(0, 2, 1))), self.targets[index]


class _ConcatImages(LabelledImages):
    def __init__(self, parts: list[LabelledImages]) -> None:
        self.parts = parts
        self.targets = [target for part in parts for target in part.targets]
        self.offsets = np.cumsum([0] + [len(part) for part in parts])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[part][index - int(self.offsets[part])]


class STL10(ImageSource):
    """STL-10 from torchvision's on-disk layout (``stl10_binary``): 100k unlabelled and 5k labelled training
    images, 8k test images, 96 x 96.

    Training uses the ``unlabeled`` images and, with ``train_on_labelled``, the labelled ones (the usual
    protocol); kNN uses the labelled training images as bank and the test images as queries. The binaries
    are memory-mapped, not loaded. md5 sums of the official release are checked unless ``verify: false``.

    Args:
        root: folder that holds (or will hold) ``stl10_binary``.
        download: fetch and extract the archive (2.6 GB) if it is missing.
        verify: check md5 sums (``false`` only for data you wrote in this layout yourself).
        train_on_labelled: add the 5k labelled training images to the training split.
        image_size: side fed to the network (96: no resize).
    """

    mean, std = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)
    num_classes = 10

    def __init__(
        self,
        root: str = "data",
        download: bool = False,
        verify: bool = True,
        train_on_labelled: bool = True,
        image_size: int = 96,
    ) -> None:
        self.root = Path(root).expanduser()
        self.download = download
        self.verify = verify
        self.train_on_labelled = train_on_labelled
        self.image_size = image_size

    @property
    def folder(self) -> Path:
        return self.root / _TorchvisionSTL10.base_folder

    def _files(self) -> list[tuple[str, str]]:
        return [*_TorchvisionSTL10.train_list, *_TorchvisionSTL10.test_list]

    def prepare(self) -> None:
        missing = [self.folder / name for name, _ in self._files() if not (self.folder / name).is_file()]
        if missing and self.download:
            try:
                download_and_extract_archive(
                    _TorchvisionSTL10.url,
                    str(self.root),
                    filename=_TorchvisionSTL10.filename,
                    md5=_TorchvisionSTL10.tgz_md5,
                )
            except Exception as error:  # network errors come in many types
                raise ConfigurationError(
                    f"could not download STL-10 into {self.root}: {error}. Copy the extracted stl10_binary folder "
                    "there instead."
                ) from error
            missing = [self.folder / name for name, _ in self._files() if not (self.folder / name).is_file()]
        if missing:
            raise DataNotFoundError(
                f"STL-10 not found: looked for {missing[0]} (and {len(missing) - 1} other files). Set `download: true` "
                "to fetch it (needs network), or set `root` to the folder that contains 'stl10_binary'."
            )
        if self.verify:
            for name, md5 in self._files():
                if not check_integrity(str(self.folder / name), md5):
                    raise ConfigurationError(
                        f"{self.folder / name} does not have the md5 sum of the official STL-10 release (partial "
                        "download?). "
                        "Delete it and download again; set `verify: false` only for data you generated yourself."
                    )

    def _read(self, name: str) -> _BinaryImages:
        images = np.memmap(self.folder / f"{name}_X.bin", dtype=np.uint8, mode="r").reshape(-1, 3, 96, 96)
        labels_file = self.folder / f"{name}_y.bin"
        targets = (
            np.fromfile(labels_file, dtype=np.uint8).astype(np.int64) - 1
            if labels_file.is_file()
            else np.full(len(images), UNLABELLED)
        )
        if len(targets) != len(images):
            raise ConfigurationError(f"{labels_file} has {len(targets)} labels for {len(images)} images")
        return _BinaryImages(images, targets)

    def split(self, train: bool) -> LabelledImages:
        self.prepare()
        return self._read("train" if train else "test")

    def training_split(self) -> LabelledImages:
        self.prepare()
        unlabelled = self._read("unlabeled")
        return _ConcatImages([unlabelled, self._read("train")]) if self.train_on_labelled else unlabelled


class SyntheticShapes(ImageSource):
    """The embedded, procedurally generated data set for the offline demo and the tests.

    Each class is a shape (disk, square, triangle, ring, cross, stripes, ...) drawn with random colours,
    position and size over a noisy background; a representation must see shape, not colour, to
    separate the classes. Deterministic from ``seed``; nothing is stored on disk.

    Args:
        num_classes: shapes, hence classes, in ``[2, number of shapes]``.
        train_per_class: training images per class.
        test_per_class: test images per class.
        image_size: side of the square images, ``>= 8``.
        seed: seeds the generation.

    Raises:
        ConfigurationError: when a setting is out of its range.
    """

    def __init__(
        self,
        num_classes: int = 10,
        train_per_class: int = 200,
        test_per_class: int = 50,
        image_size: int = 32,
        seed: int = 0,
    ) -> None:
        self.num_classes = num_classes
        self.train_per_class = train_per_class
        self.test_per_class = test_per_class
        self.image_size = image_size
        self.seed = seed
        self.mean, self.std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
        if not 2 <= num_classes <= len(SHAPES):
            raise ConfigurationError(
                f"SyntheticShapes has {len(SHAPES)} shapes; num_classes must be in [2, {len(SHAPES)}], got "
                f"{num_classes}",
                parameter="num_classes",
            )
        for name, value, least in (
            ("train_per_class", train_per_class, 1),
            ("test_per_class", test_per_class, 1),
            ("image_size", image_size, 8),
        ):
            if value < least:
                raise ConfigurationError(f"SyntheticShapes needs {name} >= {least}; got {value}", parameter=name)

    def split(self, train: bool) -> ArrayImages:
        per_class = self.train_per_class if train else self.test_per_class
        images, targets = generate_shapes(self.num_classes, per_class, self.image_size, self.seed * 2 + int(not train))
        return ArrayImages(images, targets)
