"""hfmca_lightning: PyTorch Lightning experiments for HFMCA (Hierarchical Functional Maximal Correlation)."""

__version__ = "0.1.0"
