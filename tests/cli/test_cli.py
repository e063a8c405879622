"""The ``hfmca`` command end to end: configs, real fits on on-disk data layouts, resume (clear errors:
test_cli_errors.py; resume after real kills: test_resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import fit, interrupted_fit, logged, write_image_folder


def test_fit_on_cifar_pickles(tmp_path, cifar10_on_disk):
    source = {
        "class_path": "hfmca_lightning.data.CIFAR",
        "init_args": {"name": "cifar10", "root": str(cifar10_on_disk), "verify": False},
    }
    fit(tmp_path, **{"data.init_args.source": source})
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    costs = logged(tmp_path, "cost/external")
    assert costs and all(c < 0 for c in costs)
    assert 0.0 <= logged(tmp_path, "knn/top1")[-1] <= 1.0


def test_fit_on_an_image_folder(tmp_path):
    write_image_folder(tmp_path / "images", per_class=6, num_classes=3, size=40)
    source = {
        "class_path": "hfmca_lightning.data.ImageFolderSource",
        "init_args": {"root": str(tmp_path / "images"), "image_size": 32},
    }
    fit(tmp_path, **{"data.init_args.source": source})
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert logged(tmp_path, "knn/top1")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    # Noise channels (global RNG) and beta > 0 (EMA buffers) make the test sensitive to lost state.
    changes = {
        "model.init_args.external_head.init_args.noise_channels": 3,
        "model.init_args.external_cost": {
            "class_path": "hfmca_lightning.losses.HFMCACost",
            "init_args": {"reg": 0.1, "beta": 0.5},
        },
    }
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fit(straight, "--trainer.max_epochs", "2", **changes)
    interrupted_fit(resumed, 1, "--trainer.max_epochs", "2", **changes)
    assert torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 0
    fit(resumed, "--trainer.max_epochs", "2", "--ckpt_path", "last", **changes)
    expected, got = _weights(straight / "checkpoints" / "last.ckpt"), _weights(resumed / "checkpoints" / "last.ckpt")
    assert expected.keys() == got.keys()
    assert int(got["external_cost.num_updates"]) == int(expected["external_cost.num_updates"]) > 0
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)


def _optimizer_state(path: Path) -> tuple[list[dict], dict]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in checkpoint["optimizer_states"][0]["param_groups"]]
    return groups, checkpoint["lr_schedulers"][0]


def test_a_resumed_run_trains_with_the_learning_rate_and_length_of_its_config(tmp_path, caplog):
    """Resumed with a tenth of the learning rate and a longer run (what the project's errors advise after a
    divergence), the optimiser and cosine schedule are those of a run started with those settings, at the same
    point: before, the checkpoint's settings were restored over the config's without a word."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    interrupted_fit(resumed, 1, "--trainer.max_epochs", "2")  # lr 0.002, cosine over 2 epochs
    new = ["--trainer.max_epochs", "3", "--model.init_args.optimizer.init_args.lr", "0.0002"]
    interrupted_fit(straight, 2, *new)
    caplog.clear()
    interrupted_fit(resumed, 2, *new, "--ckpt_path", "last")
    assert "not the checkpoint's: lr 0.002 -> 0.0002, CosineAnnealingLR T_max 2 -> 3 (the schedule" in caplog.text
    (expected_groups, expected_schedule), (groups, schedule) = (
        _optimizer_state(folder / "checkpoints" / "last.ckpt") for folder in (straight, resumed)
    )
    assert schedule["T_max"] == expected_schedule["T_max"] == 3
    for key in ("base_lrs", "_last_lr"):  # the cosine's closed form against torch's recursive one: float64 rounding
        assert schedule[key] == pytest.approx(expected_schedule[key], rel=1e-12)
    for group, expected in zip(groups, expected_groups):
        assert group["lr"] == pytest.approx(expected["lr"], rel=1e-12) and group["initial_lr"] == 0.0002
        assert {k: v for k, v in group.items() if "lr" not in k} == {k: v for k, v in expected.items() if "lr" not in k}


def test_bf16_mixed_precision_keeps_the_cost_in_float64(tmp_path):
    fit(tmp_path, "--trainer.precision", "bf16-mixed", "--trainer.log_every_n_steps", "1")
    costs = logged(tmp_path, "cost/external")
    assert len(costs) == 4 and all(-1e3 < c < 0 for c in costs)


def test_fit_with_augmentation_on_the_device(tmp_path):
    fit(
        tmp_path,
        "--data.init_args.drawer",
        "hfmca_lightning.data.BatchedDrawer",
        "--data.init_args.drawer.on",
        "device",
        "--trainer.log_every_n_steps",
        "1",
    )
    costs = logged(tmp_path, "cost/external")
    assert len(costs) == 4 and all(c < 0 for c in costs)


@pytest.mark.extended
@pytest.mark.integration  # a subprocess or a training run
def test_limit_train_batches_counts_batches_when_an_integer_and_is_a_fraction_otherwise(tmp_path):
    """``hfmca fit --config configs/demo.yaml --trainer.limit_train_batches 1 --trainer.max_epochs 1`` trains one batch,
    ``0.5`` half an epoch (4 batches of the shrunk demo here), in a fresh process as users run it: typing's union cache
    made Lightning's ``Optional[Union[int, float]]`` try ``float`` first, and ``1`` meant 100 %."""
    from tests.helpers import DEMO, finish_hfmca, start_hfmca, tiny_overrides

    runs = {}
    for limit in ("1", "0.5"):
        folder = tmp_path / limit
        overrides = tiny_overrides(folder)
        runs[limit] = (
            folder,
            start_hfmca(
                folder,
                "fit",
                "--config",
                str(DEMO),
                "--config",
                str(overrides),
                "--trainer.limit_train_batches",
                limit,
                "--trainer.max_epochs",
                "1",
            ),
        )
    for limit, steps in (("1", 1), ("0.5", 2)):
        folder, process = runs[limit]
        result = finish_hfmca(process, folder, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:]
        assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == steps, limit
