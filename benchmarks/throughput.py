"""Throughput of the data path, the training step and the kNN pass, as ratios measured in one run.

    python benchmarks/throughput.py                          # ResNet-18, CIFAR-sized views, auto device
    python benchmarks/throughput.py --device cuda --batch-size 64 --precision bf16
    python benchmarks/throughput.py --device cuda --backbone resnet50 --image-size 224 --batch-size 32 --precision bf16
    python benchmarks/throughput.py --backbone small --batch-size 8 --steps 3   # quick CPU check

Prints views/s for: the data path (SimCLR views by every drawer of ``hfmca_lightning.data``: torchvision per view and
batched per batch in CPU workers, batched on the device after the transfer of uint8 images, and the training set kept
on the device), the training step (backbone forward/backward alone vs HFMCA external cost with the views as one batch
or one backbone call per view, with activation checkpointing, with checkpointing in chunks, vs external + internal
costs on every block) and the kNN pass; ratios are to the first row of each section, and on CUDA each step row's
memory. The step rows are built first and timed in interleaved rounds (medians; benchmarks/step_timing.py), so that a
machine whose speed drifts during the run moves all rows alike. Uses the embedded SyntheticShapes data (no download).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from step_timing import add_malloc_option, format_rows, measure_rows, set_malloc  # noqa: E402

from hfmca_lightning.data import (
    BatchedDrawer,
    MultiViewDataModule,
    ResidentDrawer,
    SimCLRViews,
    SyntheticShapes,
    TorchvisionDrawer,
)
from hfmca_lightning.data.batch_formats import ViewBatch
from hfmca_lightning.data.drawers import ViewDrawer
from hfmca_lightning.evaluation import knn_predict
from hfmca_lightning.evaluation_data import view_batches
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.methods.deferred_checks import DeferredChecks, SkipUpdateIfFailed
from hfmca_lightning.models import CIFARResNet18, GridExternalHead, SmallConvNet, TorchvisionBackbone, ViewProjector


def timed(step: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Seconds per call of ``step`` (``warmup`` calls, then the mean of ``repeats``)."""
    for _ in range(warmup):
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


def build(
    backbone_name: str,
    views: int,
    internal: bool,
    view_mode: str = "concat",
    precision: str = "auto",
    **options: object,
) -> HFMCAModule:
    """An HFMCA-SS(*) module as configs/cifar10_ss.yaml builds it (optionally with internal costs on every block, their
    statistics in ``precision``: ``auto`` as configs/cifar10_ss_internal.yaml); ``options`` go to HFMCAModule
    (checkpoint_backbone, backbone_chunk_size, channels_last, compile_backbone, compile_costs)."""
    backbones = {"resnet18": CIFARResNet18, "resnet50": lambda: TorchvisionBackbone("resnet50"), "small": SmallConvNet}
    backbone = backbones[backbone_name]()
    grid = {4: (2, 2), 9: (3, 3), 16: (4, 4)}[views]
    return HFMCAModule(
        backbone,
        projector=ViewProjector(backbone.feature_dim, 128, 512),
        external_head=GridExternalHead(128, *grid, hidden_dim=200),
        external_cost=HFMCACost(reg=0.1),
        internal_costs=InternalCosts(INTERNAL_LAYERS[backbone_name], precision=precision) if internal else None,  # type: ignore[arg-type]
        views_through_backbone=view_mode,
        **options,  # type: ignore[arg-type]
    )


def training_step(
    module: HFMCAModule,
    views: torch.Tensor | Callable[[], torch.Tensor],
    cost: bool,
    autocast: AbstractContextManager,
    update: bool = False,
) -> Callable[[], None]:
    """One training step of ``module`` on ``views`` ``(B, L, C, H, W)``, or on the views a callable draws inside the
    step (before the forward pass, outside autocast, as Lightning's ``on_after_batch_transfer``): the backbone alone
    (``cost=False``: a plain loss on its features) or the HFMCA objective; forward (in ``autocast``) and backward,
    and with ``update`` the optimizer update of configs/cifar10_ss.yaml (fused SGD, momentum 0.9, weight decay 5e-4;
    lr 1e-3, as the update's size does not change its time), guarded on the device by the step's checks.

    As ``HFMCAModule``'s training step, the step reads no device value on the host: its checks reach the host by an
    asynchronous copy and are read at the next step (a failed step raises there)."""
    optimizer = (
        torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4, fused=True) if update else None
    )
    guard, deferred = SkipUpdateIfFailed(), DeferredChecks()
    count = [0]

    def step() -> None:
        module.zero_grad(set_to_none=True)
        batch = views() if callable(views) else views
        objective = None
        with autocast:
            if not cost:
                loss = module.embed(batch.flatten(0, 1)).float().square().mean()
            else:
                objective = module.objective(module.collect(batch), check=False)
                loss = objective.total
        loss.backward()
        failure = deferred.first_failure()  # the previous step's checks, copied by now
        if failure is not None:
            raise failure.error
        if objective is not None:
            packed = objective.checks.packed()
            deferred.push(objective.checks, packed, count[0], 0)
            if optimizer is not None:
                guard.arm(optimizer, packed.any())
        count[0] += 1
        if optimizer is not None:
            try:
                optimizer.step()
            finally:
                guard.finish()

    return step


@dataclass(frozen=True)
class DataPath:
    """One way of drawing the training views: a ``label`` and the drawer (made anew for every data module)."""

    label: str
    make: Callable[[], ViewDrawer]
    batches_per_call: int = 1


@dataclass
class DataRow:
    """Seconds per batch delivered on the device by a data path, or why there is no number (``note``)."""

    label: str
    seconds: float | None = None
    note: str = ""


def data_paths(workers: int, output_dtype: str = "float32", channels_last: bool = False) -> dict[str, DataPath]:
    """The data paths the benchmarks compare, by name; the device paths emit ``output_dtype`` views, channels-last if
    ``channels_last`` (what a bf16 channels-last backbone takes)."""
    device_output: dict[str, object] = {"output_dtype": output_dtype, "channels_last": channels_last}
    return {
        "torchvision-workers": DataPath(f"torchvision per view on {workers} CPU workers", TorchvisionDrawer),
        "batched-workers": DataPath(
            f"batched per batch on {workers} CPU workers", partial(BatchedDrawer, on="workers")
        ),
        "batched-device": DataPath(
            "uint8 + batched on device",
            partial(BatchedDrawer, on="device", **device_output),  # type: ignore[arg-type]
        ),
        "resident": DataPath(
            "training set on device (ResidentDrawer)",
            partial(ResidentDrawer, **device_output),  # type: ignore[arg-type]
        ),
        "resident-8": DataPath(
            "training set on device, 8 batches per call",
            partial(ResidentDrawer, batches_per_call=8, **device_output),  # type: ignore[arg-type]
            batches_per_call=8,
        ),
    }


def view_stream(data: MultiViewDataModule, device: torch.device) -> Generator[ViewBatch, None, None]:
    """Training batches of ``data`` as :class:`ViewBatch` on ``device``, epoch after epoch (closing the iterator shuts
    the loader's workers down)."""
    while True:
        yield from view_batches(data, device)


def data_path_rows(
    views: int,
    batch_size: int,
    steps: int,
    workers: int,
    device: torch.device,
    image_size: int = 32,
    output_dtype: str = "float32",
    channels_last: bool = False,
    names: list[str] | None = None,
) -> list[DataRow]:
    """Seconds per batch of ``views``-view groups delivered on ``device`` by each data path of :func:`data_paths`
    (``names``: those only): SyntheticShapes images of side ``image_size``, ``steps`` batches (rounded up to whole
    calls of paths that draw several batches per call) after warm-up batches (the loader's prefetch, or one call).
    A path that fails gets a note instead of a number; the others are still measured."""
    paths = data_paths(workers, output_dtype, channels_last)
    warmup = workers + 1
    most_per_call = max(path.batches_per_call for path in paths.values())
    per_class = max(20, batch_size * (max(steps, most_per_call) + max(warmup, most_per_call) + 4) // 10 + 1)
    source = SyntheticShapes(num_classes=10, train_per_class=per_class, test_per_class=2, image_size=image_size)
    rows = []
    for name in names or list(paths):
        path = paths[name]
        label = f"data: {path.label}"
        batches: Generator[ViewBatch, None, None] | None = None
        try:
            data = MultiViewDataModule(
                source,
                views=SimCLRViews(count=views),
                drawer=path.make(),
                batch_size=batch_size,
                num_workers=workers,
            )
            data.setup()
            batches = view_stream(data, device)
            per_call = path.batches_per_call
            repeats = -(-max(steps, 1) // per_call) * per_call
            warm = per_call if per_call > 1 or not data.drawer.uses_workers else warmup
            rows.append(DataRow(label, timed(partial(next, batches), repeats, device, warmup=warm)))
        except Exception as error:  # noqa: BLE001 - one path's failure is reported, the others still run
            first = str(error).splitlines()[0] if str(error) else ""
            rows.append(DataRow(label, note=f"failed: {type(error).__name__}: {first}"[:200]))
        finally:
            if batches is not None:
                batches.close()
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

    # Data path: every drawer, views delivered on the device.
    data_rows = data_path_rows(args.views, args.batch_size, args.steps, args.workers, device)
    report([(row.label, row.seconds, row.note) for row in data_rows], args.batch_size * args.views)

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
    report([("kNN: 10k queries vs 50k bank (k=200)", seconds, "")], 10_000, unit="queries/s")


def report(rows: list[tuple[str, float | None, str]], items: int, unit: str = "views/s") -> None:
    """One line per ``(label, seconds, note)`` row: rate, time and ratio to the first measured row, or the note."""
    base = next((seconds for _, seconds, _ in rows if seconds), None)
    for label, seconds, note in rows:
        if not seconds or not base:
            print(f"  {label:58s} {note or 'not measured'}")
            continue
        print(
            f"  {label:58s} {items / seconds:12,.0f} {unit}   {seconds * 1000:9.1f} ms   x{seconds / base:5.2f} time "
            "of first row"
        )


if __name__ == "__main__":
    main()
