import pytest
import torch

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SmallConvNet, SpectrumCNN


def test_a_module_without_any_cost_is_rejected():
    with pytest.raises(ConfigurationError, match="needs an external_head, internal_costs, or both"):
        HFMCAModule(SmallConvNet())


def test_a_projector_without_a_head_is_rejected():
    with pytest.raises(ConfigurationError, match="no external_head"):
        HFMCAModule(SpectrumCNN(), projector=torch.nn.Identity(), internal_costs=InternalCosts(["blocks.L1"]))


def test_cost_modules_are_named_like_their_logs():
    module = HFMCAModule(
        SpectrumCNN(channels=4, hidden_dim=8, noise_channels=0),
        external_head=GridExternalHead(4, 3, 3, 8),
        internal_costs=InternalCosts(["blocks.L1", "blocks.L9"], reg=1e-3, beta=0.5),
    )
    costs = module.cost_modules()
    assert list(costs) == ["external", "internal/L1", "internal/L9"]
    assert costs["internal/L9"].beta == 0.5 and costs["external"].reg == 0.1
    # The EMA buffers of every internal cost are part of the checkpointed state.
    assert "internal_costs.costs.blocks/L9.joint_ema" in module.state_dict()
