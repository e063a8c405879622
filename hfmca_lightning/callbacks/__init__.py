"""Thin Lightning adapters around the pure maths: kNN evaluation, spectra and heatmaps, label-free health, exact
resume and preemption."""

from hfmca_lightning.callbacks.checkpoint import PreemptionCheckpoint
from hfmca_lightning.callbacks.eigenspectrum import EigenspectrumCallback
from hfmca_lightning.callbacks.health import CollapseError, HealthMetrics
from hfmca_lightning.callbacks.heatmaps import DensityRatioHeatmapCallback
from hfmca_lightning.callbacks.knn import KNNEvaluation
from hfmca_lightning.callbacks.linear_probe import LinearProbe
from hfmca_lightning.callbacks.optimizer_settings import ConfiguredOptimizerSettings
from hfmca_lightning.callbacks.progress import CostProgressBar, EpochLines
from hfmca_lightning.callbacks.run_state import RunState
from hfmca_lightning.callbacks.stored_config import StoredConfig

__all__ = [
    "CollapseError",
    "ConfiguredOptimizerSettings",
    "CostProgressBar",
    "DensityRatioHeatmapCallback",
    "EigenspectrumCallback",
    "EpochLines",
    "HealthMetrics",
    "KNNEvaluation",
    "LinearProbe",
    "PreemptionCheckpoint",
    "RunState",
    "StoredConfig",
]
