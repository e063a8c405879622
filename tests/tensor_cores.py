"""CUDA's TF32 tensor-core products emulated on the CPU, and the error bounds of statistics computed with them
(docs/conventions.md §3).

A TF32 product rounds each float32 factor to a 10-bit mantissa and accumulates in float32. :class:`EmulatedTF32`
rounds the float32 factors of every matrix product dispatched inside it the same way (to nearest; the bounds below
use the unit of truncation, so they also hold for hardware that truncates), and the CPU then accumulates in float32.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hfmca_lightning.losses import CorrelationStatistics, WindowGeometry, feature_map_statistics
from tests.helpers import FLOAT32_UNIT, gamma

aten = torch.ops.aten
# product -> positions of its factors (a bias added in float32 is not rounded)
_FACTORS = {
    aten.mm: (0, 1),
    aten.bmm: (0, 1),
    aten.mv: (0, 1),
    aten.dot: (0, 1),
    aten.addmm: (1, 2),
    aten.baddbmm: (1, 2),
    aten.addbmm: (1, 2),
    aten.addmv: (1, 2),
    # in place, as the split products accumulate (x.addmm_(a, b) dispatches as its own operation)
    aten.addmm_: (1, 2),
    aten.baddbmm_: (1, 2),
    aten.addbmm_: (1, 2),
    aten.addmv_: (1, 2),
}


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to TF32's 10-bit mantissa, to nearest with ties to even (same strides)."""
    bits = x.view(torch.int32)
    rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & -0x2000
    return rounded.view(torch.float32)


class EmulatedTF32(TorchDispatchMode):
    """Every float32 matrix product inside runs on TF32-rounded factors, as CUDA's tensor cores take them
    (``products`` counts the rounded factors, ``by_operation`` by operation name)."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0
        self.by_operation: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        positions = _FACTORS.get(func.overloadpacket)
        if positions is not None:
            args = list(args)
            for position in positions:
                if isinstance(args[position], torch.Tensor) and args[position].dtype == torch.float32:
                    args[position] = round_to_tf32(args[position])
                    self.products += 1
                    self.by_operation[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


# A product of split factors, hi_x hi_y + hi_x lo_y + lo_x hi_y with |lo| <= 2^-11 |x| (hi rounded to nearest) and lo
# rounded by the tensor cores (2^-10 relative, by truncation): off from x y by |lo_x lo_y| + 2^-10 (|hi_x lo_y| +
# |lo_x hi_y|) <= (2^-22 + 2^-20 (1 + 2^-11)) |x y| < 5 * 2^-22 |x y|.
SPLIT_PRODUCT_UNIT = 5 * 2.0**-22
# A statistics sum: the product's unit, once more for a factor that is a window mean (itself a split product of members
# and band weights), and float32 accumulation over at most ~1,100 rows per block, plus the three partial products and
# the float32 shift of the shifted paths (a few more terms).
SUM_EPSILON = 2 * SPLIT_PRODUCT_UNIT + 2 * gamma(1_100 + 4, FLOAT32_UNIT)


def statistics_sums(stats: CorrelationStatistics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return stats.low_outer_sum, stats.high_outer_sum, stats.cross_sum


def sum_bounds(
    low: torch.Tensor, high: torch.Tensor, geometry: WindowGeometry, directions: list[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Elementwise bounds on the errors of split-TF32 statistics (docs/conventions.md §3).

    The maps' factors are bounded by the magnitude maps ``|x| + mean_c |x|`` (a shifted path multiplies ``x - mu``,
    ``|x - mu| <= |x| + |mu|``). Each sum is off by at most ``SUM_EPSILON S+``, ``S+`` the float64 sum of the
    magnitude maps; the backward pass in the ``directions`` (one weight matrix per sum) is linear in both the maps
    and the directions, with non-negative coefficients for magnitudes, so the same pass on the magnitude maps with
    the directions' magnitudes, times ``SUM_EPSILON``, bounds each element of its error."""
    low_plus, high_plus = (
        (x.detach().abs().double() + x.detach().abs().double().mean(dim=(0, 2, 3), keepdim=True)).requires_grad_()
        for x in (low, high)
    )
    sums = statistics_sums(feature_map_statistics(low_plus, high_plus, geometry, precision="float64"))
    objective = sum((direction.abs().double() * total).sum() for direction, total in zip(directions, sums))
    low_bound, high_bound = torch.autograd.grad(objective, (low_plus, high_plus))
    return [SUM_EPSILON * total.detach() for total in sums], (SUM_EPSILON * low_bound, SUM_EPSILON * high_bound)
