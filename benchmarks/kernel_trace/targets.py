"""The GPU targets of a config, from its predicted steps (docs/benchmarks/index.md lists them)."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from .predict import Prediction
from .report import Target, target_table

# The phases of a plain backbone step: the backbone's forward and backward, the optimizer's update, and the views a
# device drawer draws (gpu-check's "backbone alone" row, on the same settings).
BACKBONE_PHASES = ("backbone", "optimizer", "data")


def has_internal_costs(config: Path) -> bool:
    model = yaml.safe_load(Path(config).read_text()).get("model", {})
    return (model.get("init_args") or {}).get("internal_costs") is not None


def batch_size(config: Path) -> int:
    data = yaml.safe_load(Path(config).read_text()).get("data", {})
    return int((data.get("init_args") or {}).get("batch_size", 64))


def backbone_milliseconds(prediction: Prediction) -> float:
    return sum(prediction.phase_milliseconds(phase) for phase in BACKBONE_PHASES)


def config_targets(
    full: Prediction, external: Prediction, epoch_images: int, batch: int
) -> tuple[list[Target], list[str]]:
    """The targets and their table: step ratios to the backbone step of the same settings, the external-only step
    (HFMCA-SS(*)) against the same step with its views on the device beforehand, the training seconds of one epoch of
    the external-only step, the host syncs per step."""
    backbone = backbone_milliseconds(external)
    steps = math.ceil(epoch_images / batch)
    targets = [
        Target("external / backbone step", "<= 1.05x", f"{external.milliseconds / backbone:.2f}x",
               external.milliseconds / backbone <= 1.05),
    ]  # fmt: skip
    if full is not external:
        ratio = full.milliseconds / backbone
        targets.append(
            Target("external + internal / backbone step", "<= 1.5x (goal 1.25x)", f"{ratio:.2f}x", ratio <= 1.5)
        )
    data = external.phase_milliseconds("data")
    if data > 0:  # the transfer and the views a device drawer draws, against views already on the device
        ratio = external.milliseconds / (external.milliseconds - data)
        targets.append(
            Target("step with views drawn on the device / step with views drawn beforehand", "<= 1.05x",
                   f"{ratio:.2f}x", ratio <= 1.05)
        )  # fmt: skip
    epoch = steps * external.milliseconds / 1e3
    targets.append(
        Target(f"training seconds of one {epoch_images:,}-image epoch, HFMCA-SS(*)", "<= 10 s", f"{epoch:.1f} s",
               epoch <= 10)
    )  # fmt: skip
    if full is not external:
        targets.append(
            Target(f"training seconds of one {epoch_images:,}-image epoch, HFMCA-SS", "—",
                   f"{steps * full.milliseconds / 1e3:.1f} s", None)
        )  # fmt: skip
    syncs = full.host_syncs_per_step
    targets.append(Target("host syncs per training step", "0", f"{syncs:g}", syncs == 0))
    lines = [
        f"Backbone step (backbone forward and backward, optimizer, device views): {backbone:.2f} ms predicted.",
        "",
        *target_table(targets),
    ]
    return targets, lines
