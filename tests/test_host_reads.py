"""How many device values a training step of a shipped GPU config reads on the host: a GPU waits for its queue at
every such read (``.item()``, ``int()``/``bool()`` of a tensor, boolean-mask indexing), and the internal step is
host-bound there (docs/benchmarks/README.md)."""

from __future__ import annotations

from pathlib import Path

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from hfmca_lightning.trainer_cli import HFMCACLI
from tests.cli_helpers import REPO
from tests.host_reads import HostReads

COUNTED_STEPS = range(2, 5)  # after the first steps' one-off work (caches, lazy buffers)


class CountHostReads(Callback):
    """Records host reads from the start of step ``COUNTED_STEPS.start`` to the start of step ``COUNTED_STEPS.stop``
    (everything of those steps: the module, every callback, Lightning's loop) into ``recorder.reads``."""

    def __init__(self) -> None:
        self.recorder = HostReads()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if batch_idx == COUNTED_STEPS.start:
            self.recorder.__enter__()
        elif batch_idx == COUNTED_STEPS.stop:
            self.recorder.__exit__(None, None, None)


def test_a_step_of_the_cifar_config_with_internal_costs_reads_two_device_values(tmp_path: Path, monkeypatch) -> None:
    """The shipped config's model (ResNet-18, external + 8 internal costs) and callbacks (kNN, the online linear
    probe, spectra, checkpoints, LR monitor), shrunk data and batch, data-loader workers on: two reads per step.
    The objective's check of every cost's factorisations and the total's finiteness (one for all nine costs),
    and Lightning's conversion of the progress-bar value (``cost/external``) to a number, which it makes at every
    step whether or not a bar is drawn, also of a value logged in an earlier step. The online probe's count of
    labelled images was a third (removed)."""
    monkeypatch.chdir(tmp_path)  # the config's checkpoint folder
    overrides = {
        "trainer": {
            "max_epochs": 1, "max_steps": COUNTED_STEPS.stop + 1, "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 50,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path / "logs")}},
        },
        "data": {
            "init_args": {
                "source": {"class_path": "hfmca_lightning.data.SyntheticShapes", "init_args": {"num_classes": 4, "train_per_class": 8, "test_per_class": 2}},
                "batch_size": 4,
                "num_workers": 1,
            }
        },
    }
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump(overrides))
    cli = HFMCACLI(
        args=[
            "--config", str(REPO / "configs" / "cifar10_ss_internal.yaml"), "--config", str(path),
            "--trainer.callbacks+=tests.test_host_reads.CountHostReads",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, cli.datamodule)
    reads = next(callback for callback in cli.trainer.callbacks if isinstance(callback, CountHostReads)).recorder.reads
    assert reads, "the counted steps did not run"
    assert len(reads) <= 2 * len(COUNTED_STEPS), reads  # (a Lightning that stops converting would make it one)
