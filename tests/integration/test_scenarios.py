"""The paper's §5 scenarios and HFMCA-SS as configs: each trains real steps; unsupervised costs go down."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfmca_lightning.cli import main
from hfmca_lightning.cli.runs import load_run
from hfmca_lightning.models import SpectrumCNN
from tests.helpers import REPO, block_sizes, logged, tiny_overrides

TINY_SPECTRUM_CNN = {
    "class_path": "hfmca_lightning.models.SpectrumCNN",
    "init_args": {"channels": 8, "hidden_dim": 16, "noise_channels": 2},
}
TINY_HEAD = {
    "class_path": "hfmca_lightning.models.GridExternalHead",
    "init_args": {"feature_dim": 8, "grid_height": 3, "grid_width": 3, "hidden_dim": 16, "noise_channels": 2},
}


def run_scenario(config: str, tmp_path: Path, model: dict, *args: str, **extra: object) -> None:
    overrides = tiny_overrides(tmp_path, model=model, **{"trainer.log_every_n_steps": 1, **extra})
    main(["fit", "--config", str(REPO / "configs" / config), "--config", str(overrides), *args])


@pytest.mark.parametrize(
    ("config", "model", "internal"),
    [
        ("spectrum_unsupervised.yaml", {"init_args": {"backbone": TINY_SPECTRUM_CNN}}, [f"L{i}" for i in range(1, 10)]),
        (
            "spectrum_supervised.yaml",
            {"init_args": {"backbone": TINY_SPECTRUM_CNN, "external_head": TINY_HEAD}},
            [f"L{i}" for i in range(1, 10)],
        ),
        (
            "spectrum_selfsupervised.yaml",
            {"init_args": {"backbone": TINY_SPECTRUM_CNN, "external_head": TINY_HEAD}},
            [f"L{i}" for i in range(1, 10)],
        ),
        ("cifar10_ss_internal.yaml", {"init_args": {}}, [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]),
    ],
    ids=["unsupervised", "supervised", "selfsupervised", "cifar10_ss_internal"],
)
def test_scenario_trains_real_steps_and_logs_every_cost(config, model, internal, tmp_path):
    # 12 images per class: same-class groups need 9 distinct members.
    data = {"data.init_args.batch_size": 4, "data.init_args.source.init_args.train_per_class": 12}
    run_scenario(config, tmp_path, model, "--trainer.limit_train_batches", "2", **data)
    for name in internal:
        values = logged(tmp_path, f"cost/internal/{name}")
        assert len(values) == 2 and all(v < 0 for v in values), name
    has_head = "external_head" in model["init_args"] or config.startswith("cifar")
    assert bool(logged(tmp_path, "cost/external")) == has_head
    assert len(logged(tmp_path, "cost/total")) == 2
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    backbone = load_run(tmp_path / "checkpoints" / "last.ckpt")[0].backbone
    if isinstance(backbone, SpectrumCNN):  # the shipped configs train the tables' literal layout
        assert backbone.layout == "paper"
        assert block_sizes(backbone, 32)["L9"] == (2, 4, 1)


def test_unsupervised_internal_costs_decrease_on_the_embedded_data(tmp_path):
    model = {
        "init_args": {
            "backbone": TINY_SPECTRUM_CNN,
            "optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.003}},
        }
    }
    run_scenario(
        "spectrum_unsupervised.yaml",
        tmp_path,
        model,
        "--trainer.max_epochs",
        "3",
        **{"data.init_args.batch_size": 16, "data.init_args.source.init_args.train_per_class": 16},
    )
    totals = logged(tmp_path, "cost/total")
    assert len(totals) == 12  # 64 images / batch 16 x 3 epochs
    first, last = sum(totals[:3]) / 3, sum(totals[-3:]) / 3
    assert last < first - 0.1 * abs(first), (first, last)
