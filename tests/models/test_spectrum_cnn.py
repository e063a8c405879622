"""SpectrumCNN as the appendix tables give it (paper Tables L0, L1-L8, L9 and the text below them)."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses import WindowGeometry, window_geometry
from hfmca_lightning.models import SpectrumCNN
from tests.helpers import block_sizes


def test_paper_layout_pads_every_block_and_pools_four_times():
    sizes = block_sizes(SpectrumCNN(channels=4, hidden_dim=6, noise_channels=2), 32)
    assert sizes["L0"] == (32, 34, 34)  # L0's padding layer: 32 -> 34, all-1x1 body keeps 34
    # L1..L8 keep their size (pad 1, 3x3 without padding); 2x2 pools after L2, L4, L6, L8: 34 -> 17 -> 8 -> 4 -> 2
    expected_inputs = {1: 34, 2: 34, 3: 17, 4: 17, 5: 8, 6: 8, 7: 4, 8: 4}
    for index, size in expected_inputs.items():
        assert sizes[f"L{index}"] == (size, size + 2, size), index
    assert sizes["L9"] == (2, 4, 1)  # L9: 2x2 padded to 4x4, 1x1 convs, 4x4 average pool to 1x1


def test_three_pools_layout_is_the_documented_option():
    sizes = block_sizes(SpectrumCNN(channels=4, hidden_dim=6, noise_channels=2, layout="three_pools"), 32)
    assert sizes["L0"] == (32, 32, 32)
    assert [sizes[f"L{i}"][0] for i in range(1, 9)] == [32, 32, 16, 16, 8, 8, 4, 4]
    assert sizes["L9"] == (4, 4, 1)


def test_window_geometries_of_the_cost_blocks():
    paper, three_pools = (
        SpectrumCNN(channels=4, hidden_dim=6),
        SpectrumCNN(channels=4, hidden_dim=6, layout="three_pools"),
    )
    for model in (paper, three_pools):
        for index in range(1, 9):
            assert window_geometry(model.get_submodule(f"blocks.L{index}")) == WindowGeometry(3, 1, 1)
    # pad 1, 1x1 convs, 4x4 pool: every position of the 2x2 map plus the padding ring in one window
    assert window_geometry(paper.get_submodule("blocks.L9")) == WindowGeometry(4, 4, 1)
    assert window_geometry(paper.get_submodule("blocks.L9")).output_size((2, 2)) == (1, 1)
    assert window_geometry(three_pools.get_submodule("blocks.L9")) == WindowGeometry(4, 4, 0)


def test_other_image_sizes_end_in_one_position():
    assert block_sizes(SpectrumCNN(channels=4, hidden_dim=6, image_size=64), 64)["L9"] == (
        4,
        6,
        1,
    )  # 66 -> 33 -> 16 -> 8 -> 4
    assert block_sizes(SpectrumCNN(channels=4, hidden_dim=6, image_size=16), 16)["L9"] == (
        1,
        3,
        1,
    )  # 18 -> 9 -> 4 -> 2 -> 1


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"layout": "four_pools"}, "layout"),
        ({"image_size": 12}, "image_size"),
        ({"image_size": 20, "layout": "three_pools"}, "image_size"),
    ],
)
def test_bad_layouts_are_configuration_errors(kwargs, parameter):
    with pytest.raises(ConfigurationError) as error:
        SpectrumCNN(**kwargs)
    assert error.value.parameter == parameter


def test_the_layout_travels_with_the_weights():
    torch.manual_seed(0)
    paper = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0).eval()
    state = paper.state_dict()
    assert state["_extra_state"] == {"layout": "paper"}
    configured_otherwise = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0, layout="three_pools").eval()
    with pytest.warns(UserWarning, match="trained with layout 'paper'"):
        configured_otherwise.load_state_dict(state)
    assert configured_otherwise.layout == "paper"
    images = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(configured_otherwise(images), paper(images), rtol=0, atol=0)
    assert block_sizes(configured_otherwise, 32)["L9"] == (2, 4, 1)


def test_weights_without_a_layout_entry_load_as_the_three_pool_network():
    torch.manual_seed(0)
    old = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0, layout="three_pools").eval()
    state = {
        key: value for key, value in old.state_dict().items() if key != "_extra_state"
    }  # a checkpoint without the layout entry
    model = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0).eval()
    with pytest.warns(UserWarning, match="trained with layout 'three_pools'"):
        model.load_state_dict(state)  # strict: nothing missing
    assert model.layout == "three_pools" and block_sizes(model, 32)["L9"] == (4, 4, 1)
    images = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(model(images), old(images), rtol=0, atol=0)


def test_internal_costs_follow_a_layout_taken_from_loaded_weights():
    from hfmca_lightning.methods import HFMCAModule, InternalCosts
    from hfmca_lightning.methods.inspection import collect_for_analysis

    def module(layout: str) -> HFMCAModule:
        backbone = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0, layout=layout)
        return HFMCAModule(backbone, internal_costs=InternalCosts(backbone.internal_layers, reg=1e-3)).eval()

    trained, configured = module("three_pools"), module("paper")
    with pytest.warns(UserWarning, match="three_pools"):
        configured.load_state_dict(trained.state_dict())
    images = torch.rand(3, 3, 32, 32)
    got, expected = (
        collect_for_analysis(configured, images).statistics,
        collect_for_analysis(trained, images).statistics,
    )
    assert configured.internal_costs.pairs[-1].geometry == WindowGeometry(4, 4, 0)  # L9 without the padding ring
    for name in expected:
        torch.testing.assert_close(got[name].low_outer_sum, expected[name].low_outer_sum)


def test_no_internal_pair_is_bounded_by_its_padding_at_initialisation():
    """Padding positions are no window members (docs/conventions.md §3). As zero members they bounded every
    eigenvalue of a window with ``n`` of ``kernel**2`` members on the map by ``n / kernel**2``: L9 of the paper layout
    (a 2x2 map padded to 4x4 under a 4x4 pool) at 0.25 from initialisation on. Here every pair's largest eigenvalue
    (the near-constant function's, for sigmoid maps close to 1) is far above that bound, L9's included, and the
    windows that reach the padding hold fewer members than ``kernel**2``."""
    from hfmca_lightning.analysis import decompose
    from hfmca_lightning.methods import InternalCosts

    torch.manual_seed(0)
    model = SpectrumCNN(channels=8, hidden_dim=16, noise_channels=2, layout="paper")
    internal = InternalCosts(model.internal_layers, reg=1e-3, precision="float64")
    internal.attach(model)
    with torch.no_grad(), internal.record() as recording:
        model(torch.rand(256, 3, 32, 32))
    assert set(recording.statistics) == {f"internal/L{i}" for i in range(1, 10)}
    for name, stats in recording.statistics.items():
        largest = float(decompose(stats, reg=1e-3).eigenvalues[0])
        assert largest > 0.9, f"{name}: largest eigenvalue {largest:.3f}"


def test_a_padded_window_has_the_spectrum_of_the_same_members_without_padding():
    """L9's pair (a 2x2 map, one 4x4 window over it padded by 1) and the unpadded 2x2 window over the same four
    positions group the same members with the same outputs: equal statistics, so equal spectra (as zero members
    the padded one's would all be a quarter of the other's)."""
    from hfmca_lightning.analysis import decompose
    from hfmca_lightning.losses import feature_map_statistics

    torch.manual_seed(1)
    low = torch.sigmoid(torch.randn(2000, 6, 2, 2, dtype=torch.float64))
    window_mean = low.mean(dim=(2, 3), keepdim=True)  # (B, 6, 1, 1)
    high = torch.sigmoid(torch.einsum("bkhw,kl->blhw", window_mean - 0.5, 4 * torch.randn(6, 5, dtype=torch.float64)))
    padded = feature_map_statistics(low, high, WindowGeometry(4, 1, 1), precision="float64")
    plain = feature_map_statistics(low, high, WindowGeometry(2, 1, 0), precision="float64")
    padded_values = decompose(padded, reg=1e-3).eigenvalues
    plain_values = decompose(plain, reg=1e-3).eigenvalues
    # the same sums: float64 rounding of the coverage weights (16 / 4 against 1) and window means, ~4 n u relative
    torch.testing.assert_close(padded_values, plain_values, rtol=0, atol=1e-12)
    assert float(padded_values[0]) > 0.9  # as zero members: at most 4 / 16


@pytest.mark.parametrize("setting", ["in_channels", "channels", "hidden_dim"])
def test_a_size_below_one_is_refused_when_built(setting):
    with pytest.raises(ConfigurationError, match=f"SpectrumCNN: {setting} must be >= 1; got 0"):
        SpectrumCNN(**{setting: 0})


def test_a_backbone_for_other_than_rgb_images_is_refused_before_the_first_batch():
    """Every source gives RGB images: ``in_channels=1`` was a convolution error in the first training step."""
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
    from hfmca_lightning.methods.compatibility import check_image_size

    data = MultiViewDataModule(SyntheticShapes(num_classes=2, train_per_class=4), views=SimCLRViews(count=4))
    check_image_size(SpectrumCNN(channels=4, hidden_dim=6), data)
    with pytest.raises(
        ConfigurationError, match="takes 1-channel images, but the data source SyntheticShapes gives RGB"
    ):
        check_image_size(SpectrumCNN(in_channels=1, channels=4, hidden_dim=6), data)
