"""Thin Lightning adapters around the pure maths: evaluation, exact resume."""

from hfmca_lightning.callbacks.knn import KNNEvaluation
from hfmca_lightning.callbacks.run_state import RunState

__all__ = ["KNNEvaluation", "RunState"]
