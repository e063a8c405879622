"""LightningModules: thin compositions of models, costs and optimisers."""

from hfmca_lightning.methods.hfmca import HFMCAModule

__all__ = ["HFMCAModule"]
