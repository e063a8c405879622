"""Throughput of the data path, the training step and the kNN pass, as ratios measured in one run.

    python benchmarks/throughput.py                          # ResNet-18, CIFAR-sized views, auto device
    python benchmarks/throughput.py --device cuda --batch-size 64 --precision bf16
    python benchmarks/throughput.py --device cuda --backbone resnet50 --image-size 224 --batch-size 32 --precision bf16
    python benchmarks/throughput.py --backbone small --batch-size 8 --steps 3   # quick CPU check

Prints views/s for: the data path (CPU workers running the torchvision pipeline per view, or kornia per
image, vs uint8 loading plus kornia augmentation on the device), the training step (backbone
forward/backward alone vs HFMCA external cost with the views as one batch or one backbone call per view,
with activation checkpointing, with checkpointing in chunks, vs external + internal costs on every block)
and the kNN evaluation pass; ratios are to the first row of each section, and on CUDA each step row's
memory. The step rows are built first and timed in interleaved rounds (medians; benchmarks/step_timing.py),
so that a machine whose speed drifts during the run moves all rows alike. Uses the embedded SyntheticShapes data
(no download).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from step_timing import add_malloc_option, format_rows, measure_rows, set_malloc  # noqa: E402

from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
from hfmca_lightning.evaluation import knn_predict
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import CIFARResNet18, GridExternalHead, SmallConvNet, TorchvisionBackbone, ViewProjector


def timed(step: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call of ``step`` (one warm-up call, then the mean of ``repeats``)."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


INTERNAL_LAYERS = {
    "resnet18": [f"net.layer{s}.{b}" for s in range(1, 5) for b in range(2)],
    "resnet50": [f"net.layer{s}.{b}" for s, blocks in zip(range(1, 5), (3, 4, 6, 3)) for b in range(blocks)],
    "small": ["features.0", "features.1"],
}


def build(backbone_name: str, views: int, internal: bool, view_mode: str = "concat", **options: object) -> HFMCAModule:
    """An HFMCA-SS(*) module (optionally with internal costs on every block); ``options`` go to HFMCAModule
    (checkpoint_backbone, backbone_chunk_size, channels_last, compile_backbone)."""
    backbones = {"resnet18": CIFARResNet18, "resnet50": lambda: TorchvisionBackbone("resnet50"), "small": SmallConvNet}
    backbone = backbones[backbone_name]()
    grid = {4: (2, 2), 9: (3, 3), 16: (4, 4)}[views]
    return HFMCAModule(
        backbone,
        projector=ViewProjector(backbone.feature_dim, 128, 512),
        external_head=GridExternalHead(128, *grid, hidden_dim=200),
        external_cost=HFMCACost(reg=0.1),
        internal_costs=InternalCosts(INTERNAL_LAYERS[backbone_name]) if internal else None,
        views_through_backbone=view_mode,
        **options,  # type: ignore[arg-type]
    )


def training_step(
    module: HFMCAModule,
    views: torch.Tensor,
    cost: bool,
    autocast: AbstractContextManager,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[], None]:
    """One forward/backward of ``module`` on ``views``: the backbone alone (``cost=False``: a plain loss on its
    features) or the HFMCA objective with its checks read after the backward pass, as a training step reads them
    before the optimizer step; ``augment`` first turns a uint8 batch into views on the device."""

    def step() -> None:
        module.zero_grad(set_to_none=True)
        objective = None
        with autocast:
            batch = augment(views) if augment is not None else views
            if not cost:
                loss = module.embed(batch.flatten(0, 1)).float().square().mean()
            else:
                objective = module.objective(module.collect(batch), check=False)
                loss = objective.total
        loss.backward()
        if objective is not None:
            objective.checks.raise_if_failed()

    return step


def data_paths(workers: int) -> dict[str, tuple[str, dict[str, object]]]:
    """The data paths the benchmarks compare, by name: ``(label, MultiViewDataModule options)``."""
    return {
        "torchvision-workers": (f"torchvision per view on {workers} CPU workers", {}),
        "kornia-workers": (f"kornia per image on {workers} CPU workers", {"worker_augmentation": "kornia"}),
        "batched-workers": (f"batched per batch on {workers} CPU workers", {"worker_augmentation": "batched"}),
        "kornia-device": ("uint8 + kornia on device", {"augment_on_device": True, "device_pipeline": "kornia"}),
        "device": ("uint8 + batched on device", {"augment_on_device": True, "device_pipeline": "batched"}),
        "images-on-device": ("training set on device, batched from seeds", {"images_on_device": True}),
    }


def data_path_rows(
    views: int, batch_size: int, steps: int, workers: int, device: torch.device, image_size: int = 32
) -> list[tuple[str, float]]:
    """Seconds per batch of ``views``-view groups delivered on ``device``: CPU workers running the torchvision
    pipeline per view, CPU workers drawing an image's views in one call of kornia or of
    ``BatchedViewAugmentation``, uint8 batches augmented on ``device`` by either, and the training set kept on
    ``device`` (``images_on_device``). SyntheticShapes images of side ``image_size``; ``steps`` batches after
    ``workers`` + 1 warm-up batches (the loader's prefetch)."""
    warmup = workers + 1
    source = SyntheticShapes(
        num_classes=10, train_per_class=max(20, batch_size * (steps + warmup + 2) // 10 + 1), image_size=image_size
    )
    rows = []
    for label, options in data_paths(workers).values():
        data = MultiViewDataModule(source, num_views=views, batch_size=batch_size, num_workers=workers, **options)  # type: ignore[arg-type]
        data.setup()
        loader = iter(data.train_dataloader())

        def next_views(loader=loader, data=data) -> torch.Tensor:
            batch = [part.to(device, non_blocking=True) for part in next(loader)]
            if data.images_on_device:
                return data.draw_views(batch)[0]
            return data.device_augmentation(batch[0], views) if data.augment_on_device else batch[0]

        for _ in range(warmup - 1):
            next_views()
        rows.append((f"data: {label}", timed(next_views, steps, device)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backbone", choices=["resnet18", "resnet50", "small"], default="resnet18")
    parser.add_argument("--image-size", type=int, default=32, help="side of the views in the step rows")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step (each with --views views)")
    parser.add_argument("--views", type=int, default=9, choices=[4, 9, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4, help="CPU data-loader workers")
    parser.add_argument("--precision", choices=["32", "bf16"], default="32")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = set_malloc(args)
    device = torch.device(args.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    hardware = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"device: {hardware}; backbone {args.backbone}; {args.batch_size} images x {args.views} views; precision "
        f"{args.precision}; {malloc}"
    )

    # Data path: CPU workers (torchvision, per view) vs uint8 loading + on-device kornia views.
    report(data_path_rows(args.views, args.batch_size, args.steps, args.workers, device), args.batch_size * args.views)

    # Training step, forward + backward on the same views, rows timed side by side (step_timing).
    views = torch.randn(args.batch_size, args.views, 3, args.image_size, args.image_size, device=device)
    chunk = max(1, args.batch_size * args.views // 4)
    variants = (
        ("step: backbone fwd/bwd alone", False, False, "concat", {}),
        ("step: HFMCA external", False, True, "concat", {}),
        ("step: HFMCA external, per-view backbone calls", False, True, "per_view", {}),
        ("step: HFMCA external, activation checkpointing", False, True, "concat", {"checkpoint_backbone": True}),
        (
            f"step: HFMCA external, checkpointing, chunks of {chunk}",
            False,
            True,
            "concat",
            {"checkpoint_backbone": True, "backbone_chunk_size": chunk},
        ),
        ("step: HFMCA external + internal", True, True, "concat", {}),
    )
    rows = [
        (
            label,
            partial(
                training_step,
                build(args.backbone, args.views, internal, view_mode, **memory).to(device).train(),
                views,
                cost,
                autocast,
            ),
        )
        for label, internal, cost, view_mode, memory in variants
    ]
    print("\n".join(format_rows(measure_rows(rows, args.steps, device), args.batch_size * args.views)))

    # kNN pass: 10,000 queries against a 50,000 x 512 bank (CIFAR test vs train), chunked.
    bank = torch.randn(50_000, 512, device=device)
    targets = torch.randint(0, 10, (50_000,), device=device)
    queries = torch.randn(10_000, 512, device=device)
    seconds = timed(
        lambda: knn_predict(queries, bank, targets, 10, k=200, temperature=0.1), max(1, args.steps // 5), device
    )
    report([("kNN: 10k queries vs 50k bank (k=200)", seconds)], 10_000, unit="queries/s")


def report(rows: list[tuple], items: int, unit: str = "views/s") -> None:
    """One line per row: rate, time, ratio to the first row, and peak memory (GiB, CUDA) when measured."""
    base = rows[0][1]
    for label, seconds, *peak in rows:
        memory = (
            f"   peak {peak[0]:6.2f} GiB"
            if peak and peak[0] is not None
            else ("   peak memory: CUDA only" if peak else "")
        )
        print(
            f"  {label:58s} {items / seconds:12,.0f} {unit}   {seconds * 1000:9.1f} ms   x{seconds / base:5.2f} time "
            f"of first row{memory}"
        )


if __name__ == "__main__":
    main()
