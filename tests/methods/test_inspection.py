"""Looking inside a module: BatchNorm normalisation of analysed images by a recorded batch's statistics."""

from __future__ import annotations

import torch

from hfmca_lightning.evaluation.batch_norm import recorded_batch_norm
from hfmca_lightning.methods import HFMCAModule
from hfmca_lightning.methods.inspection import collect_for_analysis, layer_pairs
from hfmca_lightning.methods.internal_costs import InternalCosts
from hfmca_lightning.models import SmallConvNet


def stale_module() -> HFMCAModule:
    """A SmallConvNet with internal costs on its two stages whose BatchNorm running statistics are far from any
    batch's (as after a few steps): a test that fell back on them would show it."""
    torch.manual_seed(0)
    module = HFMCAModule(
        SmallConvNet(width=4, num_stages=2), internal_costs=InternalCosts(["features.0", "features.1"])
    )
    for norm in module.modules():
        if isinstance(norm, torch.nn.BatchNorm2d):
            norm.running_mean.fill_(5.0)
            norm.running_var.fill_(9.0)
    return module.eval()


def test_a_recorded_batch_normalises_other_images_as_batch_statistics_normalised_it():
    """The statistics recorded of a batch, pooled over the calls that saw it (two halves here: the first layer's
    inputs are the same as in one call), normalise that batch as ``batch_norm="batch"`` did; with them an image's
    maps are its own, the same drawn alone or with others; the running statistics and the modes are as before."""
    module = stale_module()
    batch = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with recorded_batch_norm(module) as reference:
        whole = collect_for_analysis(module, batch, keep_maps=True, batch_norm="batch")
    with recorded_batch_norm(module) as halves:
        for half in batch.split(8):
            collect_for_analysis(module, half, batch_norm="batch")
    assert set(reference) == {"backbone.features.0.1", "backbone.features.1.1"}
    first = "backbone.features.0.1"
    torch.testing.assert_close(halves[first][0], reference[first][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(halves[first][1], reference[first][1], rtol=1e-12, atol=1e-12)
    replayed = collect_for_analysis(module, batch, keep_maps=True, batch_norm="batch", reference=reference)
    for name, (low, high) in whole.maps.items():
        torch.testing.assert_close(replayed.maps[name][0], low, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(replayed.maps[name][1], high, rtol=1e-5, atol=1e-5)
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    alone = layer_pairs(module, images[:1], whole.statistics, batch_norm="batch", reference=reference)
    together = layer_pairs(module, images, whole.statistics, batch_norm="batch", reference=reference)
    for one, many in zip(alone, together):
        torch.testing.assert_close(many.low_map[:1], one.low_map, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(many.high_map[:1], one.high_map, rtol=1e-5, atol=1e-6)
    own = layer_pairs(module, images[:1], whole.statistics, batch_norm="batch")  # one image's own statistics
    assert not torch.allclose(own[0].high_map, alone[0].high_map, atol=1e-3)
    for norm in module.modules():
        if isinstance(norm, torch.nn.BatchNorm2d):
            assert norm.running_mean.eq(5.0).all() and norm.running_var.eq(9.0).all() and not norm.training
    assert not module.training
