"""LightningModules: thin compositions of models, costs and optimisers."""

from hfmca_lightning.methods.hfmca import HFMCAModule
from hfmca_lightning.methods.internal_costs import InternalCosts

__all__ = ["HFMCAModule", "InternalCosts"]
