"""Data-path figures at ImageNet scale: start-up on a large folder tree, and full-size JPEG decoding.

    python benchmarks/data_pipeline.py                      # 100k files, 300 JPEGs of 500 x 375
    python benchmarks/data_pipeline.py --files 20000 --jpegs 100

1. Writes a tree of ``--files`` tiny PNG files (1,000 class folders, ImageNet's layout) once under ``--root``
   and times ``MultiViewDataModule.setup()`` on it: listing, no image opened.
2. Writes ``--jpegs`` JPEGs of 500 x 375 (the median ImageNet size) and times, per image, decoding alone
   (torchvision's decoder and PIL) and decoding + 9 SimCLR ImageNet views of 224 px, in one process.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from hfmca_lightning.data import ImageFolderSource, MultiViewDataModule
from hfmca_lightning.data.folder_sources import read_image
from hfmca_lightning.data.transforms import ViewAugmentation, view_transforms


def write_tree(root: Path, files: int, classes: int = 1000) -> None:
    marker = root / f".complete-{files}"
    if marker.exists():
        return
    pixel = Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8))
    for split, count in (("train", files), ("val", classes)):
        for index in range(count):
            folder = root / split / f"n{index % classes:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            pixel.save(folder / f"{index}.png")
    marker.touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/benchmark_data", help="where the generated files go (kept for reruns)")
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--jpegs", type=int, default=300)
    args = parser.parse_args()
    root = Path(args.root)

    started = time.perf_counter()
    write_tree(root / "tree", args.files)
    print(
        f"tree of {args.files:,} training files (1,000 classes): written or found in "
        f"{time.perf_counter() - started:.1f} s"
    )
    data = MultiViewDataModule(
        ImageFolderSource(str(root / "tree"), test_dir="val", image_size=224), batch_size=64, num_workers=0
    )
    started = time.perf_counter()
    data.setup()
    seconds = time.perf_counter() - started
    print(
        f"MultiViewDataModule.setup(): {seconds:.2f} s for {len(data.train_dataset()):,} training images "
        f"({seconds / args.files * 1e6:.1f} us per file)"
    )

    jpegs = root / "jpegs"
    jpegs.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for index in range(args.jpegs):
        path = jpegs / f"{index}.JPEG"
        if not path.exists():
            Image.fromarray(rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(str(path))

    def per_second(step) -> float:
        step(paths[0])
        started = time.perf_counter()
        for path in paths:
            step(path)
        return len(paths) / (time.perf_counter() - started)

    spec = ViewAugmentation.from_strengths(224, color_strength=1.0, blur=0.5)
    transforms = view_transforms(spec, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

    def decode_and_augment(path: str) -> torch.Tensor:
        image = read_image(path)
        return torch.stack([transforms[v % len(transforms)](image) for v in range(9)])

    torch.set_num_threads(1)
    decoded = per_second(read_image)
    pil = per_second(lambda path: np.asarray(Image.open(path).convert("RGB")))
    augmented = per_second(decode_and_augment)
    print(
        f"one process, 500 x 375 JPEG: decode {decoded:.0f} images/s (PIL {pil:.0f}); decode + 9 views of 224 px: "
        f"{augmented:.1f} images/s = {augmented * 9:.0f} views/s"
    )


if __name__ == "__main__":
    main()
