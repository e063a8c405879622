"""Pure evaluation maths on embeddings (no Lightning): kNN, linear classifiers, feature extraction."""

from hfmca_lightning.evaluation.features import extract_features
from hfmca_lightning.evaluation.knn import knn_accuracy, knn_grid, knn_predict
from hfmca_lightning.evaluation.linear import (
    LinearClassifier,
    NonFiniteLossError,
    class_balanced_subset,
    classes_raised_to_one_image,
    topk_accuracies,
    train_linear_classifier,
)

__all__ = [
    "LinearClassifier",
    "NonFiniteLossError",
    "class_balanced_subset",
    "classes_raised_to_one_image",
    "extract_features",
    "knn_accuracy",
    "knn_grid",
    "knn_predict",
    "topk_accuracies",
    "train_linear_classifier",
]
