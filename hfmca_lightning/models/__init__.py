"""Plain ``nn.Module``s: backbones, the per-view projector, the external head LF, reusable layers."""

from hfmca_lightning.models.backbones import CIFARResNet18, SmallConvNet, TimmBackbone, TorchvisionBackbone
from hfmca_lightning.models.heads import GridExternalHead, ViewProjector
from hfmca_lightning.models.layers import NoiseChannels, PaddingLayer
from hfmca_lightning.models.spectrum_cnn import SpectrumCNN, spectrum_block

__all__ = [
    "CIFARResNet18",
    "GridExternalHead",
    "NoiseChannels",
    "PaddingLayer",
    "SmallConvNet",
    "SpectrumCNN",
    "TimmBackbone",
    "TorchvisionBackbone",
    "ViewProjector",
    "spectrum_block",
]
