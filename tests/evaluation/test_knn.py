import math

import pytest
import torch

from hfmca_lightning.evaluation import knn_accuracy, knn_grid, knn_predict


def reference_knn(queries, bank, targets, num_classes, k, temperature):
    """One query at a time, sorted neighbours, explicit vote in float64 (exp(1 / 0.002) still fits)."""
    predictions = []
    for query in queries:
        sims = [
            (float(torch.nn.functional.cosine_similarity(query, item, dim=0)), int(t)) for item, t in zip(bank, targets)
        ]
        sims.sort(key=lambda pair: -pair[0])
        votes = [0.0] * num_classes
        for sim, target in sims[:k]:
            votes[target] += math.exp(sim / temperature)
        predictions.append(max(range(num_classes), key=lambda c: votes[c]))
    return torch.tensor(predictions)


@pytest.mark.parametrize(("k", "chunk_size"), [(1, 1024), (5, 3), (200, 7)])
def test_knn_predict_matches_reference(k, chunk_size):
    generator = torch.Generator().manual_seed(0)
    bank = torch.randn(40, 6, generator=generator)
    targets = torch.randint(0, 4, (40,), generator=generator)
    queries = torch.randn(15, 6, generator=generator)
    got = knn_predict(queries, bank, targets, 4, k=k, temperature=0.1, chunk_size=chunk_size)
    assert torch.equal(got, reference_knn(queries, bank, targets, 4, min(k, 40), 0.1))


@pytest.mark.parametrize("temperature", [0.01, 0.002])
def test_small_temperatures_vote_as_the_reference(temperature):
    """Non-negative features (ReLU-pooled backbones) have cosines near 1: exp(cos / t) overflows float32 once 1 / t
    passes 88.7, which tied every class at inf and gave the first class."""
    generator = torch.Generator().manual_seed(1)
    bank = torch.rand(60, 8, generator=generator) + 1.0
    targets = torch.randint(0, 5, (60,), generator=generator)
    queries = torch.rand(20, 8, generator=generator) + 1.0
    got = knn_predict(queries, bank, targets, 5, k=20, temperature=temperature)
    expected = reference_knn(queries, bank, targets, 5, 20, temperature)
    assert torch.equal(got, expected) and len(set(expected.tolist())) > 1


def test_separable_clusters_are_classified_perfectly():
    centres = torch.eye(3) * 10
    bank = centres.repeat_interleave(10, 0) + torch.randn(30, 3) * 0.1
    targets = torch.arange(3).repeat_interleave(10)
    assert knn_accuracy(centres + 0.05, torch.arange(3), bank, targets, 3, k=5) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature > 0"):
        knn_predict(torch.rand(2, 3), torch.rand(4, 3), torch.zeros(4, dtype=torch.long), 2, temperature=0)
    with pytest.raises(ValueError, match="bank has 4 features but 3 targets"):
        knn_predict(torch.rand(2, 3), torch.rand(4, 3), torch.zeros(3, dtype=torch.long), 2)


def test_the_grid_reports_each_k_as_used():
    """A k above the bank's size votes with the whole bank: the row says so (k = the bank's size), once."""
    torch.manual_seed(0)
    bank, targets = torch.randn(10, 4), torch.arange(10) % 2
    queries, query_targets = torch.randn(5, 4), torch.arange(5) % 2
    rows = knn_grid(queries, query_targets, bank, targets, 2, ks=[3, 50, 200], temperatures=[0.1])
    assert [row["k"] for row in rows] == [3, 10]
    assert rows[1]["top1"] == knn_accuracy(queries, query_targets, bank, targets, 2, k=10, temperature=0.1)
