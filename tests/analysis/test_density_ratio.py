import pytest
import torch
from torch import nn

from hfmca_lightning.analysis import decompose
from hfmca_lightning.analysis.density_ratio import LayerPair, basis_function_maps, bridge_response, telescoping_response
from hfmca_lightning.losses import WindowGeometry, feature_map_statistics


def naive_step(response_above, pair):
    """Alg. 5 line 9 by explicit loops over low positions and the output windows that contain them."""
    k, s, p = pair.geometry.kernel, pair.geometry.stride, pair.geometry.padding
    batch, _, height, width = pair.low_map.shape
    out_h, out_w = pair.high_map.shape[-2:]
    result = torch.zeros(batch, height, width, dtype=torch.float64)
    for b in range(batch):
        for i in range(height):
            for j in range(width):
                for a in range(out_h):
                    for c in range(out_w):
                        if a * s - p <= i < a * s - p + k and c * s - p <= j < c * s - p + k:
                            rho = pair.decomposition.density_ratio(pair.low_map[b, :, i, j], pair.high_map[b, :, a, c])
                            result[b, i, j] += response_above[b, a, c] * rho
    return result


def naive_bridge(response, size):
    height, width = response.shape[-2:]
    factor = size[0] // height
    out = torch.zeros(response.shape[0], *size, dtype=torch.float64)
    for i in range(size[0]):
        for j in range(size[1]):
            if i // factor < height and j // factor < width:
                out[:, i, j] = response[:, i // factor, j // factor]
    return out


def small_network_pairs() -> list[LayerPair]:
    """A 3-block network: 3x3 padded conv (7x7), 2x2 avg-pool bridge (7 -> 3, a dropped row), 3x3 stride-2
    padded conv (3 -> 2), then a 2x2 pooling block to 1x1."""
    torch.manual_seed(0)
    blocks = [
        (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sigmoid()), WindowGeometry(3, 1, 1)),
        (nn.Sequential(nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.Sigmoid()), WindowGeometry(3, 2, 1)),
        (nn.Sequential(nn.AvgPool2d(2)), WindowGeometry(2, 2, 0)),
    ]
    x = torch.rand(2, 3, 7, 7, dtype=torch.float64)
    pairs = []
    for index, (block, geometry) in enumerate(blocks):
        block = block.double()
        with torch.no_grad():
            y = block(x)
        decomposition = decompose(feature_map_statistics(x, y, geometry, precision="float64"), reg=1e-3)
        pairs.append(LayerPair(f"B{index}", x, y, geometry, decomposition))
        x = nn.functional.avg_pool2d(y, 2) if index == 0 else y
    return pairs


def test_telescoping_response_equals_the_double_loop_of_alg5():
    pairs = small_network_pairs()
    got = telescoping_response(pairs)
    response = torch.ones(2, *pairs[-1].high_map.shape[-2:], dtype=torch.float64)
    expected = {}
    for pair in reversed(pairs):
        if tuple(response.shape[-2:]) != tuple(pair.high_map.shape[-2:]):
            response = naive_bridge(response, tuple(pair.high_map.shape[-2:]))
        response = naive_step(response, pair)
        expected[pair.name] = response
    assert list(got) == ["B0", "B1", "B2"]
    for name in expected:
        assert got[name].shape == pairs[int(name[1])].low_map.shape[:1] + pairs[int(name[1])].low_map.shape[-2:]
        # float64 sums over at most 9 window positions per layer, three layers deep, in two orders: 2 gamma_9 ~ 2e-15
        # of the terms' magnitudes per layer (the density ratios are O(1)); 1e-12 leaves the depth a margin
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-12)
    assert got["B0"].abs().sum() > 0


def test_bridge_rejects_non_integer_pooling():
    with pytest.raises(ValueError, match="cannot bridge"):
        bridge_response(torch.ones(1, 3, 3), (4, 5))


def test_basis_function_maps_are_the_low_basis_at_every_position():
    pair = small_network_pairs()[0]
    maps = basis_function_maps(pair.decomposition, pair.low_map[1])
    assert maps.shape == (3, 7, 7)  # min(K1, K2) = min(3, 4) basis functions
    torch.testing.assert_close(maps[:, 2, 5], pair.decomposition.low_basis(pair.low_map[1, :, 2, 5]))
