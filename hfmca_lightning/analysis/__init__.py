"""Pure tensor analysis of trained costs: eigenspectra, basis functions, density ratios (paper Alg. 4), RankMe, and
the window of training statistics that spectra are taken from."""

from hfmca_lightning.analysis.rankme import rankme
from hfmca_lightning.analysis.spectral import SpectralDecomposition, decompose, eigenspectrum, inverse_sqrt
from hfmca_lightning.analysis.spectrum_window import SpectrumWindow

__all__ = ["SpectralDecomposition", "SpectrumWindow", "decompose", "eigenspectrum", "inverse_sqrt", "rankme"]
