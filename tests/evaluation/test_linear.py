"""Linear evaluation maths against plain references."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.evaluation import (
    NonFiniteLossError,
    class_balanced_subset,
    classes_raised_to_one_image,
    topk_accuracies,
    train_linear_classifier,
)


def test_topk_accuracies_match_a_plain_count():
    generator = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(50, 7, generator=generator), torch.randint(0, 7, (50,), generator=generator)
    ranked = logits.argsort(dim=1, descending=True)
    for k, accuracy in topk_accuracies(logits, targets, 7, ks=(1, 3, 5)).items():
        expected = sum(int(targets[i]) in ranked[i, :k].tolist() for i in range(50)) / 50
        assert abs(accuracy - expected) < 1e-6, k


def test_top5_of_fewer_classes_is_capped():
    assert topk_accuracies(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), 3, ks=(5,)) == {5: 1.0}


def test_class_balanced_subset_takes_the_same_share_of_every_class():
    targets = torch.arange(4).repeat_interleave(torch.tensor([100, 50, 20, 10]))
    subset = class_balanced_subset(targets, 0.1, seed=3)
    assert torch.bincount(targets[subset]).tolist() == [10, 5, 2, 1]
    assert len(set(subset.tolist())) == len(subset)
    assert torch.equal(subset, class_balanced_subset(targets, 0.1, seed=3))
    assert not torch.equal(subset, class_balanced_subset(targets, 0.1, seed=4))
    assert torch.equal(class_balanced_subset(targets, 1.0), torch.arange(len(targets)))
    # 5 % of 10 rounds to none: that class still gets one image, and is counted as raised
    assert torch.bincount(targets[class_balanced_subset(targets, 0.05)]).tolist() == [5, 2, 1, 1]
    assert classes_raised_to_one_image(targets, 0.05) == 1 and classes_raised_to_one_image(targets, 0.1) == 0


def test_classifier_separates_separable_classes_whatever_their_scale():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 16, generator=generator) * 4
    targets = torch.arange(5).repeat(40)
    features = (
        centres[targets] + torch.randn(200, 16, generator=generator)
    ) * 1000 + 50  # a badly scaled feature space
    classifier = train_linear_classifier(features, targets, 5, epochs=30, batch_size=32)
    assert topk_accuracies(classifier.logits(features), targets, 5)[1] == 1.0
    again = train_linear_classifier(features, targets, 5, epochs=30, batch_size=32)
    torch.testing.assert_close(again.linear.weight, classifier.linear.weight, rtol=0, atol=0)


def test_a_feature_constant_in_training_is_not_magnified_at_test():
    """A sparse ReLU unit silent on every training image (std 0) fires weakly at test: it keeps scale 1 (scikit-learn's
    StandardScaler), so the classifier's predictions are those with the unit zeroed, not thrown by a 1e6 factor."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 32, generator=generator) * 2

    def sample(n):
        targets = torch.randint(0, 4, (n,), generator=generator)
        return torch.relu(centres[targets] + torch.randn(n, 32, generator=generator)), targets

    (train, train_targets), (test, test_targets) = sample(400), sample(400)
    train[:, 0] = 0.0  # silent in training
    test[:, 0] = 0.05  # and weakly active on every test image
    train[:, 1] = test[:, 1] = 3.0  # a constant that is not zero: its float32 variance is round-off, not spread
    train[:, 2] = 1e-4 * torch.randn(400, generator=generator)  # small, but it varies: standardised as usual
    test[:, 2] = 1e-4 * torch.randn(400, generator=generator)
    classifier = train_linear_classifier(train, train_targets, 4, epochs=50)
    assert classifier.std[:2].tolist() == [1.0, 1.0]
    assert 0.5e-4 < float(classifier.std[2]) < 2e-4
    zeroed = test.clone()
    zeroed[:, 0] = 0.0
    predictions = classifier.logits(test).argmax(1)
    assert torch.equal(predictions, classifier.logits(zeroed).argmax(1))
    assert topk_accuracies(classifier.logits(test), test_targets, 4)[1] > 0.95


def test_a_loss_that_turns_nan_stops_the_training_naming_the_epoch():
    """A learning rate far too large made every weight NaN, and the classifier still gave (chance) accuracies."""
    generator = torch.Generator().manual_seed(0)
    features, targets = torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    with pytest.raises(NonFiniteLossError, match=r"loss became NaN or Inf in epoch [1-3] of 3: lower the learning"):
        train_linear_classifier(features, targets, 4, epochs=3, batch_size=256, lr=3e38)  # float32 overflows at once
    classifier = train_linear_classifier(features, targets, 4, epochs=3, batch_size=16, lr=10.0)  # large, finite
    assert torch.isfinite(classifier.linear.weight).all()
