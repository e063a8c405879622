"""Image files on disk: :class:`ImageFolderSource` (class trees) and :class:`UnlabelledFolderSource` (no classes)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2.functional import to_dtype

from hfmca_lightning.data.sources import UNLABELLED, ImageSource, LabelledImages, pil_rgb
from hfmca_lightning.errors import ConfigurationError, DataNotFoundError, HFMCAWarning, check_choice

__all__ = ["FolderImages", "ImageFolderSource", "UnlabelledFolderSource"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class FolderImages(LabelledImages):
    """Image files ``samples [(path, target)]`` decoded when read; an unreadable one raises (``on_bad_image='error'``)
    or is skipped with a warning for the next readable one (``'skip'``; an epoch keeps its length)."""

    def __init__(self, samples: list[tuple[str, int]], on_bad_image: Literal["error", "skip"] = "error") -> None:
        self.samples, self.on_bad_image, self.skipped = samples, on_bad_image, 0
        self.targets = [target for _, target in samples]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        for attempt in range(min(len(self.samples), 100)):
            path, target = self.samples[(index + attempt) % len(self.samples)]
            try:
                return read_image(path), target
            except (OSError, RuntimeError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as error:
                if self.on_bad_image == "error":
                    raise ConfigurationError(
                        f"cannot read image {path}: {error}. Remove or replace the file, or set on_bad_image: skip."
                    ) from None
                self.skipped += 1
                skipped = f"{self.skipped} skipped so far in this process"
                warnings.warn(f"skipping unreadable image {path} ({error}); {skipped}", HFMCAWarning, stacklevel=2)
        raise ConfigurationError(
            f"no readable image among 100 files from {self.samples[index][0]}: check the data folder"
        )


# The formats PIL may read an image file as: those of IMAGE_EXTENSIONS, never one it hands to Ghostscript (EPS).
PIL_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP", "GIF")


def read_image(path: str) -> Tensor:
    """An image file as an RGB uint8 tensor ``(3, H, W)`` (16-bit images scaled to 8 bits): JPEG, PNG, WebP and GIF by
    torchvision's decoders (libjpeg-turbo), anything else by PIL, as one of :data:`PIL_FORMATS` only."""
    if path.lower().endswith((".jpg", ".jpeg", ".png", ".webp", ".gif")):
        try:
            return to_dtype(decode_image(path, mode=ImageReadMode.RGB), torch.uint8, scale=True)  # 16-bit PNGs
        except RuntimeError:
            pass  # e.g. CMYK JPEGs, PNGs named .jpg: PIL reads those
    with Image.open(path, formats=PIL_FORMATS) as image:
        return pil_rgb(image)


def _links_up(entry: os.DirEntry, folder: str) -> bool:
    """Whether ``entry`` is a link to the real path ``folder`` or a folder above it (``self -> .``, ``up -> ..``)."""
    return entry.is_symlink() and Path(folder).is_relative_to(os.path.realpath(entry.path))


def _identity(entry: os.DirEntry) -> tuple[int, int] | None:
    """The ``(st_dev, st_ino)`` of what ``entry`` names (a link's target), or None when it cannot be read."""
    try:
        status = entry.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _image_files(folder: Path, claimed: dict[tuple[int, int], str], repeats: list[tuple[str, str]]) -> list[str]:
    """Image files under ``folder`` (recursive, links followed), none opened, in walk order: a folder's files by name,
    then its sub-folders by name. Each directory is entered once (by ``(st_dev, st_ino)``), none through a link to
    one holding ``folder`` (``up -> ..``: its siblings). A file with several names (hard links, links) is listed under
    its first: plain files by the listing's inode (no call per file), links by their target's ``(st_dev, st_ino)``.
    ``claimed``: the files of other classes (identity -> path); one of them found here is left out and added to
    ``repeats`` as ``(path, claimed path)``, and this folder's files are added to ``claimed``."""
    try:
        top = os.stat(folder)
    except OSError:
        return []
    root = os.path.realpath(folder)
    visited = {(top.st_dev, top.st_ino)}
    seen: dict[tuple[int, int], str] = {}
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
                key = _identity(entry)
                if key is None or key in visited or _links_up(entry, root):
                    continue
                visited.add(key)
                subdirectories.append((entry.path, key[0]))
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                key = _identity(entry) if entry.is_symlink() else (device, entry.inode())
                if key is None:  # a broken link: listed, and named when it cannot be read
                    found.append(entry.path)
                elif key in claimed:
                    repeats.append((entry.path, claimed[key]))
                elif key not in seen:
                    seen[key] = entry.path
                    found.append(entry.path)
        pending.extend(reversed(subdirectories))
    claimed.update(seen)
    return found


class ImageFolderSource(ImageSource):
    """Any ``root/<split>/<class>/<image>`` tree (torchvision ``ImageFolder`` layout), ImageNet included; start-up only
    lists the files (100k in well under a second). Classes are the folder names, sorted, the same in both splits, none
    empty. Links are followed, each folder and image once, but not back up the tree (``self -> .``, ``up -> ..``);
    an image in two class folders is kept in the first, with a warning.

    Args:
        root: folder with one sub-folder per split.
        train_dir: the training split's folder.
        test_dir: the test split's folder (ImageNet: ``val``); ``null`` trains without kNN evaluation.
        class_list: a text file of class folder names, one per line (``#`` comments); only those classes
            are used (``configs/imagenet100_classes.txt``: ImageNet-100).
        image_size: side of the (square) images fed to the network.
        eval_resize: shorter side of evaluation images before the centre crop (ImageNet: 256 for 224).
        mean: per-channel normalisation mean (default ImageNet's).
        std: per-channel normalisation standard deviation (default ImageNet's).
        on_bad_image: ``error`` (default; names the file) or ``skip`` (warns, counts, reads the next image).
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
        check_choice(on_bad_image, ("error", "skip"), "on_bad_image", type(self).__name__)
        self.root, self.on_bad_image = Path(root).expanduser(), on_bad_image
        self._image_settings(image_size, eval_resize, mean, std)
        if test_dir is not None and os.path.normpath(test_dir) == os.path.normpath(train_dir):
            raise ConfigurationError(
                f"ImageFolderSource: test_dir is the training split ({train_dir}): kNN and probes would score the "
                "training images against themselves; name the held-out split, or null for none",
                parameter="test_dir",
            )
        self.train_dir, self.test_dir, self.class_list = train_dir, test_dir, class_list
        self.classes: list[str] | None = None
        self.num_classes = 0
        self._splits: dict[bool, FolderImages] = {}

    def prepare(self) -> None:
        if self.class_list is not None and self.classes is None:
            path = Path(self.class_list).expanduser()
            if not path.is_file():
                raise DataNotFoundError(
                    f"class_list file not found: {path.resolve()} (relative paths start at the working folder)"
                )
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ConfigurationError(
                    f"class_list {path} is not a text file (UTF-8)", parameter="class_list"
                ) from None
            classes = [name for line in text.splitlines() if (name := line.split("#", 1)[0].strip())]
            if not classes or len(set(classes)) != len(classes):
                raise ConfigurationError(
                    f"class_list {path} must list distinct class folder names, one per line", parameter="class_list"
                )
            self.classes, self.num_classes = sorted(classes), len(classes)
        splits = [self.train_dir] + ([self.test_dir] if self.test_dir is not None else [])
        for split in splits:
            if not (self.root / split).is_dir():
                raise DataNotFoundError(
                    f"image folder split not found: looked for {self.root / split}. Expected the layout "
                    f"{self.root}/{{{','.join(splits)}}}/<class name>/<image file>."
                )
        if len(splits) == 2 and os.path.samefile(self.root / splits[0], self.root / splits[1]):  # a link, a mount
            raise ConfigurationError(
                f"ImageFolderSource: {self.root / str(self.test_dir)} is the training split's folder "
                f"{self.root / self.train_dir}: kNN and probes would score the training images against themselves; "
                "name the held-out split, or null for none",
                parameter="test_dir",
            )

    def split(self, train: bool) -> FolderImages:
        if train not in self._splits:
            self.prepare()
            if not train and self.test_dir is None:
                raise ConfigurationError(f"{self.root} has no test split (test_dir is null)", parameter="test_dir")
            self._splits[train] = self._scan(self.root / (self.train_dir if train else str(self.test_dir)))
        return self._splits[train]

    def evaluation_splits(self) -> tuple[LabelledImages, LabelledImages] | None:
        return None if self.test_dir is None else (self.split(True), self.split(False))

    def _scan(self, folder: Path) -> FolderImages:
        real = os.path.realpath(folder)
        with os.scandir(folder) as listing:  # links up the tree are not classes but the split again
            present = sorted(entry.name for entry in listing if entry.is_dir() and not _links_up(entry, real))
        if not present:
            raise ConfigurationError(
                f"{folder} has no class folders: ImageFolderSource expects one sub-folder of images per class, "
                f"{folder}/<class name>/<image file> (for images without classes, use UnlabelledFolderSource)"
            )
        if self.classes is None:
            self.classes, self.num_classes = present, len(present)
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
        claimed: dict[tuple[int, int], str] = {}  # every class's files: one of two classes is kept in the first
        repeats: list[tuple[str, str]] = []
        for target, name in enumerate(self.classes):
            files = _image_files(folder / name, claimed, repeats)
            if not files and repeats and Path(repeats[-1][0]).is_relative_to(folder / name):
                raise ConfigurationError(
                    f"{folder / name} holds only images of other class folders ({repeats[-1][0]} is "
                    f"{repeats[-1][1]}: a link or a hard link); a class needs images of its own"
                )
            if not files:
                raise ConfigurationError(
                    f"{folder / name}: Found no valid file for the classes {name}. Add images to that class folder "
                    "or remove it."
                )
            samples += [(path, target) for path in files]
        if repeats:
            warnings.warn(
                f"{len(repeats)} image files under {folder} are in two class folders (e.g. {repeats[0][0]} is "
                f"{repeats[0][1]}: a link or a hard link); each is kept in its first class only",
                HFMCAWarning,
                stacklevel=2,
            )
        return FolderImages(samples, self.on_bad_image)


class UnlabelledFolderSource(ImageSource):
    """Every image file under ``root`` (links followed as in :class:`ImageFolderSource`); no classes: training only.

    Args:
        root: folder searched recursively for image files.
        image_size: as :class:`ImageFolderSource`.
        eval_resize: as :class:`ImageFolderSource`.
        mean: as :class:`ImageFolderSource`.
        std: as :class:`ImageFolderSource`.
        on_bad_image: as :class:`ImageFolderSource`.
        evaluation: a labelled source (e.g. an ``ImageFolderSource``) whose evaluation splits kNN and probes use,
            with the same ``image_size``, ``eval_resize``, ``mean`` and ``std``; ``null``: kNN skipped, with a warning.
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
        check_choice(on_bad_image, ("error", "skip"), "on_bad_image", type(self).__name__)
        self.root, self.on_bad_image = Path(root).expanduser(), on_bad_image
        self._image_settings(image_size, eval_resize, mean, std)
        for name in ("image_size", "eval_resize", "mean", "std"):
            if evaluation is not None and getattr(evaluation, name) != getattr(self, name):
                raise ConfigurationError(
                    f"UnlabelledFolderSource: evaluation has {name} {getattr(evaluation, name)}, this source "
                    f"{getattr(self, name)}; evaluation images are read as training images: give both the same {name}",
                    parameter="evaluation",
                )
        self.evaluation, self.num_classes = evaluation, evaluation.num_classes if evaluation is not None else 0
        self._images: FolderImages | None = None

    def prepare(self) -> None:
        if not self.root.is_dir():
            raise DataNotFoundError(f"image folder not found: looked for {self.root}")
        if self.evaluation is not None:
            self.evaluation.prepare()

    def split(self, train: bool) -> LabelledImages:
        if not train:
            if (splits := self.evaluation_splits()) is None:
                raise ConfigurationError(
                    f"{self.root} has no labels: give `evaluation` a labelled source for test images"
                )
            return splits[1]
        if self._images is None:
            self.prepare()
            files = _image_files(self.root, {}, [])
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
