"""Pure tensor maths of the HFMCA cost: statistics, window geometry, the cost and its adaptive filter."""

from hfmca_lightning.losses.distributed import all_reduce_statistics
from hfmca_lightning.losses.hfmca_cost import CostFactorisationError, HFMCACost, cost_from_statistics, hfmca_cost
from hfmca_lightning.losses.statistics import (
    CorrelationStatistics,
    feature_map_statistics,
    group_statistics,
    regularised_blocks,
    window_coverage,
)
from hfmca_lightning.losses.window_geometry import WindowGeometry, input_geometry, window_geometry

__all__ = [
    "CorrelationStatistics",
    "CostFactorisationError",
    "HFMCACost",
    "WindowGeometry",
    "all_reduce_statistics",
    "cost_from_statistics",
    "feature_map_statistics",
    "group_statistics",
    "hfmca_cost",
    "input_geometry",
    "regularised_blocks",
    "window_coverage",
    "window_geometry",
]
