"""``hfmca dashboard``: the W&B eigenvalue-dynamics view, built offline and checked against the keys a run logs."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from hfmca_lightning.callbacks import EigenspectrumCallback, HealthMetrics
from hfmca_lightning.cli import main
from hfmca_lightning.cli.dashboard import eigenvalue_dynamics_workspace, save_workspace, stable_view_name
from tests.helpers import quiet_trainer, tiny_data, tiny_spectrum_module

pytest.importorskip("wandb_workspaces")

PAIRS = ["external", *(f"internal/L{i}" for i in range(1, 10))]
HEALTH_METRICS = ["rankme", "effective_rank", "alpha_req", "lidar", "samples"]


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> list[str]:
    """Every metric key a short spectrum-CNN run writes (CSV logger: scalars), the health metrics included."""
    folder = tmp_path_factory.mktemp("dashboard_run")
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(folder, name="run"),
        callbacks=[EigenspectrumCallback(every_n_steps=1, top_k=20, min_groups=1), HealthMetrics(every_n_steps=2)],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    trainer.fit(tiny_spectrum_module(), tiny_data())
    return next(csv.reader(open(Path(trainer.log_dir) / "metrics.csv")))


def panels(workspace, section: str) -> list:
    (found,) = [s for s in workspace.sections if s.name == section]
    return found.panels


def matches(panel, key: str) -> bool:
    if panel.metric_regex:
        return re.fullmatch(panel.metric_regex, key) is not None
    return key in (panel.y or [])


def test_every_logged_key_has_its_panel(logged_keys):
    workspace = eigenvalue_dynamics_workspace("team", "hfmca", PAIRS)
    assert [s.name for s in workspace.sections] == [
        "Costs and kNN",
        "Eigenvalue dynamics",
        "Spectrum distributions",
        "Spectrum summaries",
        "Label-free health",
        "Figures",
    ]
    dynamics = panels(workspace, "Eigenvalue dynamics")
    assert [p.title for p in dynamics] == [f"Top eigenvalues: {pair}" for pair in PAIRS]
    series = [key for key in logged_keys if key.startswith("eigenvalues/")]
    assert {key.rsplit("/", 1)[0].removeprefix("eigenvalues/") for key in series} == set(PAIRS)
    for key in series:
        pair = key.rsplit("/", 1)[0].removeprefix("eigenvalues/")
        assert [p.title for p in dynamics if matches(p, key)] == [f"Top eigenvalues: {pair}"], key
    for key in (k for k in logged_keys if k.startswith("cost/")):
        assert matches(panels(workspace, "Costs and kNN")[0], key), key
    summaries = panels(workspace, "Spectrum summaries")
    for key in (k for k in logged_keys if k.startswith(("spectrum/", "rankme/"))):
        assert sum(matches(p, key) for p in summaries) == 1, key
    distributions = panels(workspace, "Spectrum distributions")
    for pair in PAIRS:  # the histograms (W&B only, so not in the CSV)
        assert [p.title for p in distributions if matches(p, f"spectrum/{pair}/eigenvalues")] == [
            f"Spectrum over time: {pair}"
        ]
    health = panels(workspace, "Label-free health")  # one panel per metric, every run in it
    assert [p.y for p in health] == [[f"health/{name}"] for name in HEALTH_METRICS]
    logged_health = [key for key in logged_keys if key.startswith("health/")]
    assert sorted(logged_health) == sorted(f"health/{name}" for name in HEALTH_METRICS)
    plots = [p for section in workspace.sections for p in section.panels if hasattr(p, "metric_regex")]
    for key in logged_health:  # in its own panel, and in no other of the view
        assert [p.title for p in plots if matches(p, key)] == [p.title for p in health if p.y == [key]], key
    assert panels(workspace, "Figures")[0].media_keys == ["learning_dynamics", "layer_spectra", "density_ratio"]
    # The whole view serialises to W&B's format without a network.
    assert "eigenvalues/internal/L9" in workspace._to_model().spec.model_dump_json(by_alias=True)


def test_without_pairs_one_regex_panel_covers_every_pair(logged_keys):
    workspace = eigenvalue_dynamics_workspace("team", "hfmca")
    (dynamics,) = panels(workspace, "Eigenvalue dynamics")
    assert all(matches(dynamics, key) for key in logged_keys if key.startswith("eigenvalues/"))
    assert not matches(dynamics, "cost/external")


def test_saving_twice_updates_the_same_view(monkeypatch):
    """Against a fake W&B API: the first save creates the view, the second finds it and updates it."""
    from wandb_workspaces.workspaces import Workspace, internal

    server: dict[str, str] = {}
    saved: list[tuple[str, str]] = []

    class Found:
        def __init__(self, view_id: str) -> None:
            self.id = view_id

    def from_name(entity, project, name):
        if name not in server:
            raise ValueError("no such view")
        return Found(server[name])

    def save(self):
        saved.append((self._internal_name, self._internal_id))
        server.setdefault(self._internal_name, f"id-{len(server)}")
        self._internal_id = server[self._internal_name]
        return self

    monkeypatch.setattr(internal.View, "from_name", staticmethod(from_name))
    monkeypatch.setattr(Workspace, "save", save)
    monkeypatch.setattr(
        Workspace,
        "url",
        property(lambda self: f"https://wandb.test/{self.entity}/{self.project}?nw={self._internal_name}"),
    )
    for _ in range(2):
        url = save_workspace(eigenvalue_dynamics_workspace("team", "hfmca", PAIRS))
    name = stable_view_name("team", "hfmca", "HFMCA eigenvalue dynamics")
    assert re.fullmatch(r"nw-[0-9a-f]{11}-v", name)
    assert saved == [(name, ""), (name, "id-0")]
    assert url == f"https://wandb.test/team/hfmca?nw={name}"


def test_dry_run_prints_the_view_without_saving(capsys):
    main(["dashboard", "--entity", "team", "--project", "hfmca", "--dry-run"])
    view = json.loads(capsys.readouterr().out)
    assert view["title"] == "HFMCA eigenvalue dynamics"
    assert [section["name"] for section in view["sections"]][1] == "Eigenvalue dynamics"


def test_a_baselines_spectra_land_in_the_same_panels(tmp_path):
    """A SimCLR run logs its hooked spectra, RankMe and health metrics under the HFMCA keys: every one of them has its
    panel in the view that shows HFMCA runs (one view for both)."""
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
    from hfmca_lightning.methods.baselines import SimCLR
    from hfmca_lightning.models import SmallConvNet

    trainer = quiet_trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[
            EigenspectrumCallback(every_n_steps=1, top_k=5, min_groups=1),
            HealthMetrics(every_n_steps=2, samples_per_dim=1),
        ],
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    data = MultiViewDataModule(  # tiny_data()'s, with the two views SimCLR compares
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3),
        views=SimCLRViews(count=2),
        batch_size=6,
        num_workers=0,
    )
    trainer.fit(SimCLR(SmallConvNet(width=4, num_stages=2), hidden_dim=8, output_dim=4), data)
    keys = next(csv.reader(open(Path(trainer.log_dir) / "metrics.csv")))
    pairs = {"external", "internal/features.0", "internal/features.1"}
    workspace = eigenvalue_dynamics_workspace("team", "hfmca")
    summaries, (dynamics,) = panels(workspace, "Spectrum summaries"), panels(workspace, "Eigenvalue dynamics")
    assert {key.split("/", 1)[1].rsplit("/", 1)[0] for key in keys if key.startswith("spectrum/")} == pairs
    assert "rankme/backbone" in keys
    assert sorted(key for key in keys if key.startswith("health/")) == sorted(f"health/{n}" for n in HEALTH_METRICS)
    health = panels(workspace, "Label-free health")
    for key in keys:
        if key.startswith("health/"):
            assert sum(matches(p, key) for p in health) == 1, key
        if key.startswith(("spectrum/", "rankme/")):
            assert sum(matches(p, key) for p in summaries) == 1, key
        if key.startswith("eigenvalues/"):
            assert matches(dynamics, key), key


@pytest.mark.parametrize("has_key", [False, True])
def test_a_failed_save_says_what_to_do_once(monkeypatch, has_key):
    """Without an API key: log in (W&B's own words about it are not repeated); with one: the error and what to check."""
    from wandb_workspaces.workspaces import Workspace, internal

    from hfmca_lightning.errors import ConfigurationError

    def refused(self):
        raise RuntimeError("No API key configured. Use `wandb login` to log in." if not has_key else "403 Forbidden")

    monkeypatch.setattr(internal.View, "from_name", staticmethod(lambda *args: None))
    monkeypatch.setattr(Workspace, "save", refused)
    monkeypatch.setattr("hfmca_lightning.cli.dashboard.wandb_credentials_available", lambda: has_key)
    with pytest.raises(ConfigurationError) as raised:
        save_workspace(eigenvalue_dynamics_workspace("team", "hfmca", PAIRS))
    message = str(raised.value)
    assert message.startswith("could not save the W&B view to team/hfmca: ")
    if has_key:
        assert "403 Forbidden" in message and "entity and project" in message
    else:
        assert message.count("wandb login") == 1 and "No API key configured" not in message
