"""Thin Lightning adapters around the pure maths: kNN evaluation, spectra and heatmaps, exact resume."""

from hfmca_lightning.callbacks.eigenspectrum import EigenspectrumCallback
from hfmca_lightning.callbacks.heatmaps import DensityRatioHeatmapCallback
from hfmca_lightning.callbacks.knn import KNNEvaluation
from hfmca_lightning.callbacks.run_state import RunState

__all__ = ["DensityRatioHeatmapCallback", "EigenspectrumCallback", "KNNEvaluation", "RunState"]
