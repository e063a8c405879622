"""SpectrumCNN as the appendix tables give it (paper Tables L0, L1-L8, L9 and the text below them)."""

from __future__ import annotations

import pytest
import torch

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses import WindowGeometry, window_geometry
from hfmca_lightning.models import SpectrumCNN
from hfmca_lightning.models.layers import PaddingLayer


def block_sizes(model: SpectrumCNN, image_size: int) -> dict[str, tuple[int, int, int]]:
    """``{block: (input size, padded size, output size)}`` of one forward pass on square images."""
    sizes: dict[str, list[int]] = {}
    handles = []
    for name, block in model.blocks.named_children():
        if not name.startswith("L"):
            continue
        padding = next(module for module in block.modules() if isinstance(module, PaddingLayer))
        handles.append(block.register_forward_hook(lambda _m, inputs, output, name=name: sizes.setdefault(name, []).extend([inputs[0].shape[-1], output.shape[-1]])))
        handles.append(padding.register_forward_hook(lambda _m, _i, output, name=name: sizes.setdefault(name + "/padded", []).append(output.shape[-1])))
    with torch.no_grad():
        features = model.eval()(torch.rand(2, 3, image_size, image_size))
    for handle in handles:
        handle.remove()
    assert features.shape == (2, model.feature_dim)
    return {name: (sizes[name][0], sizes[name + "/padded"][0], sizes[name][1]) for name in sizes if "/" not in name}


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
    paper, three_pools = SpectrumCNN(channels=4, hidden_dim=6), SpectrumCNN(channels=4, hidden_dim=6, layout="three_pools")
    for model in (paper, three_pools):
        for index in range(1, 9):
            assert window_geometry(model.get_submodule(f"blocks.L{index}")) == WindowGeometry(3, 1, 1)
    # pad 1, 1x1 convs, 4x4 pool: every position of the 2x2 map plus the padding ring in one window
    assert window_geometry(paper.get_submodule("blocks.L9")) == WindowGeometry(4, 4, 1)
    assert window_geometry(paper.get_submodule("blocks.L9")).output_size((2, 2)) == (1, 1)
    assert window_geometry(three_pools.get_submodule("blocks.L9")) == WindowGeometry(4, 4, 0)


def test_other_image_sizes_end_in_one_position():
    assert block_sizes(SpectrumCNN(channels=4, hidden_dim=6, image_size=64), 64)["L9"] == (4, 6, 1)  # 66 -> 33 -> 16 -> 8 -> 4
    assert block_sizes(SpectrumCNN(channels=4, hidden_dim=6, image_size=16), 16)["L9"] == (1, 3, 1)  # 18 -> 9 -> 4 -> 2 -> 1


@pytest.mark.parametrize(("kwargs", "parameter"), [({"layout": "four_pools"}, "layout"), ({"image_size": 12}, "image_size"), ({"image_size": 20, "layout": "three_pools"}, "image_size")])
def test_bad_layouts_are_configuration_errors(kwargs, parameter):
    with pytest.raises(ConfigurationError) as error:
        SpectrumCNN(**kwargs)
    assert error.value.parameter == parameter
