"""Pure tensor analysis of trained costs: eigenspectra, basis functions, density ratios (paper Alg. 4), the
label-free health metrics (RankMe, effective rank, alpha-ReQ, LiDAR), and the window of training statistics that
spectra are taken from."""

from hfmca_lightning.analysis.health import HealthStatistics, alpha_req, effective_rank, lidar
from hfmca_lightning.analysis.rankme import rankme
from hfmca_lightning.analysis.spectral import SpectralDecomposition, decompose, eigenspectrum, inverse_sqrt
from hfmca_lightning.analysis.spectrum_window import SpectrumWindow

__all__ = [
    "HealthStatistics",
    "SpectralDecomposition",
    "SpectrumWindow",
    "alpha_req",
    "decompose",
    "effective_rank",
    "eigenspectrum",
    "inverse_sqrt",
    "lidar",
    "rankme",
]
