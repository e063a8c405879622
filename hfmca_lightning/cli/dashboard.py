"""``hfmca dashboard``: the W&B "eigenvalue dynamics" view of a project, built as code.

    hfmca dashboard --entity my-team --project hfmca                              # every pair by regex
    hfmca dashboard --entity my-team --project hfmca --config configs/spectrum_selfsupervised.yaml
    hfmca dashboard --entity my-team --project hfmca --dry-run                     # print, save nothing

Uses W&B's workspace library (``pip install 'hfmca_lightning[dashboard]'``, i.e. ``wandb-workspaces``). The
view has a fixed internal name derived from its title, so running the command again updates the saved
view instead of adding another. Its sections follow the keys that ``hfmca fit`` logs:

* **Costs and kNN**: ``cost/*``, ``knn/top1`` / ``knn/top1_max`` and the online probe's ``linear/*``;
* **Eigenvalue dynamics**: per cost pair, the ``eigenvalues/<pair>/01..20`` series in one panel (the
  paper's learning-dynamics figure, as lines);
* **Spectrum distributions**: per pair, ``spectrum/<pair>/eigenvalues``, the whole spectrum as a W&B
  histogram over time;
* **Spectrum summaries**: ``top1``, ``top10_mean`` and ``num_above_0.5`` of every pair's non-trivial eigenvalues,
  the constant function's eigenvalue (``trivial``), the window's ``groups``, and RankMe (``rankme/*``);
* **Label-free health**: one panel per metric of ``HealthMetrics`` (``health/rankme``, ``health/effective_rank``,
  ``health/alpha_req``, ``health/lidar``, and the ``health/samples`` each estimate came from), every run in each;
* **Figures**: the ``learning_dynamics``, ``layer_spectra`` and ``density_ratio`` images.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from hfmca_lightning.cli import options
from hfmca_lightning.cli.paths import read_config_file
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.loggers import wandb_credentials_available

__all__ = ["eigenvalue_dynamics_workspace", "pairs_of_config", "run_dashboard_command", "save_workspace"]

DEFAULT_TITLE = "HFMCA eigenvalue dynamics"
FIGURE_KEYS = ["learning_dynamics", "layer_spectra", "density_ratio"]
ALL_PAIRS = r"[^/]+(?:/[^/]+)?"  # external, internal/L3, internal/layer2.0
HEALTH_PANELS = [  # (key, title): the metrics HealthMetrics logs (docs/conventions.md §9)
    ("health/rankme", "RankMe (entropy rank of the embeddings)"),
    ("health/effective_rank", "Effective rank (of the embeddings' covariance)"),
    ("health/alpha_req", "alpha-ReQ (eigenvalue decay; near 1 healthy)"),
    ("health/lidar", "LiDAR (rank of the between- over within-sample covariance)"),
    ("health/samples", "Samples per health estimate"),
]


def _workspaces() -> tuple[Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as reports
        import wandb_workspaces.workspaces as workspaces
    except ImportError:
        raise ConfigurationError(
            "hfmca dashboard needs W&B's workspace library: pip install 'hfmca_lightning[dashboard]' (wandb-workspaces)"
        ) from None
    return workspaces, reports


def eigenvalue_dynamics_workspace(
    entity: str, project: str, pairs: list[str] | None = None, title: str = DEFAULT_TITLE
) -> Any:
    """The ``wandb_workspaces`` ``Workspace`` of the view (not saved).

    ``pairs``: cost names (``external``, ``internal/L3``, ...), one panel each; ``None``: one panel of each
    kind matching every pair by regex.
    """
    workspaces, reports = _workspaces()
    patterns = [(pair, re.escape(pair)) for pair in pairs] if pairs else [("every pair", ALL_PAIRS)]
    sections = [
        workspaces.Section(
            name="Costs and kNN",
            is_open=True,
            panels=[
                reports.LinePlot(title="Costs (lower = stronger dependence)", metric_regex=r"^cost/.*$"),
                reports.LinePlot(title="kNN top-1", y=["knn/top1", "knn/top1_max"]),
                reports.LinePlot(title="Online linear probe", y=["linear/top1", "linear/top5"]),
                reports.LinePlot(title="Linear probe training loss", y=["linear/train_loss"]),
            ],
        ),
        workspaces.Section(
            name="Eigenvalue dynamics",
            is_open=True,
            panels=[
                reports.LinePlot(title=f"Top eigenvalues: {label}", metric_regex=rf"^eigenvalues/{pattern}/\d+$")
                for label, pattern in patterns
            ],
        ),
        workspaces.Section(
            name="Spectrum distributions",
            is_open=True,
            panels=[
                reports.LinePlot(
                    title=f"Spectrum over time: {label}", metric_regex=rf"^spectrum/{pattern}/eigenvalues$"
                )
                for label, pattern in patterns
            ],
        ),
        workspaces.Section(
            name="Spectrum summaries",
            panels=[
                reports.LinePlot(
                    title=f"{summary} per pair", metric_regex=rf"^spectrum/{ALL_PAIRS}/{re.escape(summary)}$"
                )
                for summary in ("top1", "top10_mean", "num_above_0.5", "trivial", "groups")
            ]
            + [reports.LinePlot(title="RankMe (effective rank of the backbone features)", metric_regex=r"^rankme/.*$")],
        ),
        workspaces.Section(
            name="Label-free health",
            is_open=True,
            panels=[reports.LinePlot(title=title, y=[key]) for key, title in HEALTH_PANELS],
        ),
        workspaces.Section(
            name="Figures", panels=[reports.MediaBrowser(title="Figures", media_keys=FIGURE_KEYS, num_columns=1)]
        ),
    ]
    workspace = workspaces.Workspace(entity=entity, project=project, name=title, sections=sections)
    workspace._internal_name = stable_view_name(entity, project, title)
    return workspace


def stable_view_name(entity: str, project: str, title: str) -> str:
    """W&B's internal view name (``nw-<11 characters>-v``), the same every time for one project and title."""
    digest = hashlib.sha256(f"{entity}/{project}/{title}".encode()).hexdigest()[:11]
    return f"nw-{digest}-v"


def save_workspace(workspace: Any) -> str:
    """Create the view, or update it when a view of that internal name exists; returns its URL."""
    from wandb_workspaces.workspaces import internal

    try:
        existing = internal.View.from_name(workspace.entity, workspace.project, workspace._internal_name)
        workspace._internal_id = existing.id
    except Exception:  # no such view yet (the API reports that in several ways)
        workspace._internal_id = ""
    try:
        workspace.save()
    except Exception as error:  # wandb raises several types for auth / network failures
        where = f"could not save the W&B view to {workspace.entity}/{workspace.project}"
        if not wandb_credentials_available():  # W&B's own message says to log in too: one sentence of it
            raise ConfigurationError(
                f"{where}: no W&B API key; log in with `wandb login` (or set WANDB_API_KEY)"
            ) from None
        raise ConfigurationError(f"{where}: {error}. Check the entity and project names, and the network.") from None
    return str(workspace.url)


def pairs_of_config(config_path: str | Path) -> list[str]:
    """The cost names of the model a ``hfmca fit`` config builds (``external``, ``internal/L1``, ...)."""
    from hfmca_lightning.cli.trainer_cli import HFMCACLI

    config = {key: value for key, value in read_config_file(config_path).items() if key in ("model", "data")}
    config["trainer"] = {"logger": False, "callbacks": []}
    model = HFMCACLI(args=config, run=False).model
    cost_modules = getattr(model, "cost_modules", None)
    if cost_modules is None:
        raise ConfigurationError(f"{config_path}: {type(model).__name__} has no HFMCA costs, so no spectra to show")
    return list(cost_modules())


def describe(workspace: Any) -> dict[str, Any]:
    """Sections and panels of a workspace as plain data (what ``--dry-run`` prints)."""
    return {
        "title": workspace.name,
        "internal_name": workspace._internal_name,
        "sections": [
            {
                "name": section.name,
                "panels": [{"type": type(panel).__name__, **_panel_fields(panel)} for panel in section.panels],
            }
            for section in workspace.sections
        ],
    }


def _panel_fields(panel: Any) -> dict[str, Any]:
    fields = {"title": getattr(panel, "title", None)}
    for name in ("metric_regex", "y", "media_keys"):
        value = getattr(panel, name, None)
        if value:
            fields[name] = value
    return fields


def run_dashboard_command(argv: list[str]) -> None:
    """Parse and run ``hfmca dashboard ...``."""
    parser = options.OneLineParser(
        prog="hfmca dashboard", description="Create or update the W&B eigenvalue-dynamics view of a project."
    )
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project the runs log to (the configs use `hfmca`)")
    parser.add_argument("--config", default=None, help="a `hfmca fit` config: one panel per cost pair of its model")
    parser.add_argument("--title", default=DEFAULT_TITLE, help="the view's title")
    parser.add_argument("--dry-run", action="store_true", help="print the view's sections and panels; save nothing")
    args = parser.parse_args(argv)
    pairs = pairs_of_config(args.config) if args.config else None
    workspace = eigenvalue_dynamics_workspace(args.entity, args.project, pairs, args.title)
    if args.dry_run:
        print(json.dumps(describe(workspace), indent=1))
        return
    print(f"saved {save_workspace(workspace)}")
