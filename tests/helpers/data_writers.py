"""Tiny data sets written in the real on-disk layouts (CIFAR's pickles, STL10's binaries, image folders, JPEG trees),
read back through the package's own code."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from hfmca_lightning.data.synthetic import generate_shapes


def _shapes(per_class: int, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return generate_shapes(num_classes, per_class, 32, seed)


def write_cifar(root: Path, name: str = "cifar10", per_class: int = 4, num_classes: int = 10) -> Path:
    """torchvision's ``cifar-10-batches-py`` (5 train batches, test batch, meta) or ``cifar-100-python``.

    Pixels are synthetic shapes so that a model can learn something; labels use the real key names.
    """
    if name == "cifar10":
        folder, train_files, test_file, label_key = (
            root / "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            "test_batch",
            "labels",
        )
        meta_file, meta = "batches.meta", {"label_names": [f"class{i}" for i in range(10)]}
    else:
        folder, train_files, test_file, label_key = root / "cifar-100-python", ["train"], "test", "fine_labels"
        meta_file, meta = "meta", {"fine_label_names": [f"class{i}" for i in range(100)]}
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = _shapes(per_class * len(train_files), num_classes, seed=1)
    order = np.random.default_rng(0).permutation(len(labels))
    chunks = np.array_split(order, len(train_files))
    for file_name, chunk in zip(train_files, chunks):
        _dump(folder / file_name, images[chunk], labels[chunk], label_key)
    test_images, test_labels = _shapes(per_class, num_classes, seed=2)
    _dump(folder / test_file, test_images, test_labels, label_key)
    with open(folder / meta_file, "wb") as handle:
        pickle.dump(meta, handle)
    return folder


def _dump(path: Path, images: np.ndarray, labels: np.ndarray, label_key: str) -> None:
    entry = {
        "data": images.transpose(0, 3, 1, 2).reshape(len(images), -1),
        label_key: labels.tolist(),
        "batch_label": path.name,
    }
    with open(path, "wb") as handle:
        pickle.dump(entry, handle)


def write_image_folder(root: Path, per_class: int = 4, num_classes: int = 3, size: int = 40) -> Path:
    """``root/{train,test}/<class>/<n>.png`` with images of ``size x size`` pixels (not the network size)."""
    for split, seed in (("train", 3), ("test", 4)):
        images, labels = generate_shapes(num_classes, per_class, size, seed)
        for index, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{index}.png")
    return root


def write_stl10(root: Path, unlabelled: int = 6, train: int = 4, test: int = 3) -> Path:
    """torchvision's ``stl10_binary`` layout: ``*_X.bin`` (uint8, each image 3 x 96 x 96 column-major),
    ``*_y.bin`` (labels 1..10), ``unlabeled_X.bin``, ``class_names.txt``."""
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("unlabeled", unlabelled), ("train", train), ("test", test)):
        rng.integers(0, 256, (count, 3, 96, 96), dtype=np.uint8).tofile(folder / f"{name}_X.bin")
        if name != "unlabeled":
            (np.arange(count) % 10 + 1).astype(np.uint8).tofile(folder / f"{name}_y.bin")
    (folder / "class_names.txt").write_text("\n".join(f"class{i}" for i in range(10)))
    return folder


def write_jpeg_tree(
    root: Path,
    classes: list[str],
    per_class: int = 1,
    splits: tuple[str, ...] = ("train", "val"),
    size: tuple[int, int] = (240, 300),
) -> Path:
    """An ImageNet-style tree ``root/<split>/<wnid>/<name>.JPEG`` of full-size JPEGs (``size`` = height, width)."""
    rng = np.random.default_rng(0)
    for split in splits:
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for item in range(per_class):
                pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                pixels[:, : size[1] // 2] = (index * 37) % 256  # a class-dependent half
                Image.fromarray(pixels).save(folder / f"{name}_{item}.JPEG", quality=85)
    return root
