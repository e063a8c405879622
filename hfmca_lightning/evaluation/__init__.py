"""Pure evaluation maths on embeddings (no Lightning)."""

from hfmca_lightning.evaluation.knn import knn_accuracy, knn_predict

__all__ = ["knn_accuracy", "knn_predict"]
