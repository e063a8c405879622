"""BatchNorm modes of analysis: each batch's own statistics without touching the running ones."""

from __future__ import annotations

import torch
from torch import nn

from hfmca_lightning.evaluation.batch_norm import batch_norm_age, batch_statistics_mode, evaluation_mode


def test_batch_statistics_mode_normalises_by_the_batch_and_leaves_the_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.ReLU())
    model.train()
    model(torch.rand(8, 3, 6, 6))  # one tracked batch
    before = {key: value.clone() for key, value in model.state_dict().items()}
    images = torch.rand(5, 3, 6, 6) * 3
    with torch.no_grad(), batch_statistics_mode(model):
        assert model[1].training and not model[2].training  # BatchNorm by the batch, dropout off
        got = model(images)
    with torch.no_grad(), evaluation_mode(model):
        running = model(images)
    # what training-mode BatchNorm computes, without dropout: normalised by this batch's mean and variance
    conv = model[0](images)
    mean, var = conv.mean(dim=(0, 2, 3), keepdim=True), conv.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    expected = torch.relu(
        (conv - mean) / torch.sqrt(var + model[1].eps) * model[1].weight[:, None, None] + model[1].bias[:, None, None]
    )
    # the same float32 arithmetic in another order: a few units of 2^-24 on values of order 1, inside assert_close's
    # float32 defaults (1.3e-6 relative, 1e-5 absolute)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, running)
    for key, value in model.state_dict().items():  # running statistics and the batch count unchanged
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert model.training and model[1].momentum == 0.1  # modes and momentum restored
    assert batch_norm_age(model) == 1 and batch_norm_age(nn.Linear(2, 2)) is None
