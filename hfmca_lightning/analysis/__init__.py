"""Pure tensor analysis of trained costs: eigenspectra, basis functions, density ratios (paper Alg. 4), RankMe."""

from hfmca_lightning.analysis.rankme import rankme
from hfmca_lightning.analysis.spectral import SpectralDecomposition, decompose, eigenspectrum, inverse_sqrt

__all__ = ["SpectralDecomposition", "decompose", "eigenspectrum", "inverse_sqrt", "rankme"]
