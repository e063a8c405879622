"""Device values a training step of a shipped GPU config reads on the host: a GPU waits for its queue at every
such read (``.item()``, ``int()``/``bool()`` of a tensor, boolean-mask indexing, ``nonzero``, ``.cpu()``,
``.tolist()``, ``.numpy()``: everything :class:`~hfmca_lightning.diagnostics.HostReads` counts)."""

from __future__ import annotations

from pathlib import Path

import yaml

from hfmca_lightning.callbacks import CostProgressBar
from hfmca_lightning.cli.trainer_cli import HFMCACLI
from tests.helpers import COUNTED_STEPS, REPO, CountHostReads


def test_whole_steps_of_the_cifar_config_with_internal_costs_read_nothing_on_the_host(
    tmp_path: Path, monkeypatch
) -> None:
    """The shipped config's model (ResNet-18, external + 8 internal costs) and callbacks (kNN, the online linear
    probe, spectra, checkpoints, LR monitor) with the ``hfmca`` command's progress bar drawn, shrunk data and batch,
    data-loader workers on: nothing is read in whole steps (the module, every callback, the progress bar,
    Lightning's loop). The checks of all nine costs' factorisations and of the total guard the update on the device
    and reach the host by an asynchronous copy, read a step later; the costs reach the bar the same way and the
    logger every ``log_every_n_steps``."""
    monkeypatch.chdir(tmp_path)  # the config's checkpoint folder
    monkeypatch.setattr("hfmca_lightning.cli.verbosity.draws_bars", lambda stream: True)  # as on a terminal
    overrides = {
        "trainer": {
            "max_epochs": 1,
            "max_steps": COUNTED_STEPS.stop + 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            "log_every_n_steps": 50,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "logs")},
            },
        },
        "data": {
            "init_args": {
                "source": {
                    "class_path": "hfmca_lightning.data.SyntheticShapes",
                    "init_args": {"num_classes": 4, "train_per_class": 8, "test_per_class": 2},
                },
                "batch_size": 4,
                "num_workers": 1,
            }
        },
    }
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump(overrides))
    cli = HFMCACLI(
        args=[
            "--config",
            str(REPO / "configs" / "cifar10_ss_internal.yaml"),
            "--config",
            str(path),
            "--trainer.callbacks+=tests.helpers.CountHostReads",
        ],
        run=False,
    )
    bars = [callback for callback in cli.trainer.callbacks if isinstance(callback, CostProgressBar)]
    assert len(bars) == 1 and bars[0].is_enabled
    cli.trainer.fit(cli.model, cli.datamodule)
    counter = next(callback for callback in cli.trainer.callbacks if isinstance(callback, CountHostReads))
    assert counter.until_optimizer == ["(none)"] * len(COUNTED_STEPS), counter.until_optimizer
    assert counter.whole.reads == [], counter.whole.reads
    assert "cost/external" in bars[0].get_metrics(cli.trainer, cli.model)  # the bar shows the cost
