"""Baseline SSL methods on lightly's losses and heads, consuming ``MultiViewDataModule`` batches unchanged."""

from hfmca_lightning.methods.baselines.base import SSLBaseline
from hfmca_lightning.methods.baselines.contrastive import MoCo, SimCLR
from hfmca_lightning.methods.baselines.redundancy import BarlowTwins, VICReg, VICRegL
from hfmca_lightning.methods.baselines.siamese import BYOL, FastSiam, SimSiam

__all__ = ["BYOL", "BarlowTwins", "FastSiam", "MoCo", "SSLBaseline", "SimCLR", "SimSiam", "VICReg", "VICRegL"]
