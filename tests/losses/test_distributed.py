"""Two CPU processes (gloo): global-batch statistics and DDP gradients equal the single-process ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hfmca_lightning.losses import HFMCACost, all_reduce_statistics, group_statistics, hfmca_cost
from tests.helpers import FLOAT64_UNIT, cost_error, cost_matrices, gamma, inverse_error

pytestmark = pytest.mark.integration  # two processes

WORLD_SIZE = 2
GROUPS, MEMBERS, FEATURES = 12, 3, 6


class TwoLevelModel(nn.Module):
    """Member features from a view encoder, group features from a head over the members."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(5, FEATURES), nn.Sigmoid())
        self.head = nn.Sequential(nn.Linear(MEMBERS * FEATURES, FEATURES), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low = self.encoder(x)  # (M, L, K)
        return low, self.head(low.flatten(1))


def _data() -> torch.Tensor:
    return torch.rand(GROUPS, MEMBERS, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _model() -> TwoLevelModel:
    torch.manual_seed(1)
    return TwoLevelModel().double()  # float64 end to end: sharding changes nothing but the reduction


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        shard = _data().chunk(WORLD_SIZE)[rank]
        model = DistributedDataParallel(_model())
        cost_module = HFMCACost(reg=0.1, beta=0.5, sync_dist=True)
        results = {}
        for step in range(2):  # two steps: the second one uses the EMA of the first
            model.zero_grad()
            low, high = model(shard)
            cost = cost_module(low, high)
            cost.backward()
            results[f"cost{step}"] = cost.detach()
            results[f"grads{step}"] = [p.grad.clone() for p in model.parameters()]
        results["joint_ema"] = cost_module.joint_ema.clone()
        low, high = model(shard)
        results["functional"] = hfmca_cost(low, high, reg=0.1, sync_dist=True).detach()
        results["local"] = hfmca_cost(low, high, reg=0.1, sync_dist=False).detach()
        results["global_counts"] = all_reduce_statistics(group_statistics(low, high)).group_count.detach()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _single_process() -> dict[str, object]:
    model = _model()
    cost_module = HFMCACost(reg=0.1, beta=0.5)
    results = {}
    for step in range(2):
        model.zero_grad()
        low, high = model(_data())
        cost = cost_module(low, high)
        cost.backward()
        results[f"cost{step}"] = cost.detach()
        results[f"grads{step}"] = [p.grad.clone() for p in model.parameters()]
    results["joint_ema"] = cost_module.joint_ema.clone()
    low, high = model(_data())
    results["functional"] = hfmca_cost(low, high, reg=0.1).detach()
    # Sharded, the float64 sums of the moments are added in another order (twice 2 gamma_n of the terms'
    # magnitudes, n = 36 members); the costs and gradients carry that through the factorisations, within their bounds.
    low, high = low.detach(), high.detach()
    results["cost_bound"] = cost_error(low, high, 0.1)
    results["moment_bound"] = 4 * gamma(GROUPS * MEMBERS, FLOAT64_UNIT)
    # a gradient is linear in J^-1, A^-1 and C^-1 (relative error inverse_error each) times sums over the members
    results["gradient_rtol"] = 4 * (
        sum(inverse_error(m) for m in cost_matrices(low, high, 0.1)) + results["moment_bound"]
    )
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("gloo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def test_each_rank_cost_equals_the_whole_batch_cost(ranks):
    single = _single_process()
    for result in ranks:
        assert float(result["global_counts"]) == GROUPS
        for key in ("cost0", "cost1", "functional"):
            torch.testing.assert_close(result[key], single[key], rtol=0, atol=single["cost_bound"])
    # Without sync each rank sees only its half: a different number.
    assert abs(float(ranks[0]["local"]) - float(single["functional"])) > 1e-6


def test_ddp_averaged_gradients_equal_single_process_gradients(ranks):
    single = _single_process()
    for result in ranks:
        for step in range(2):
            for got, expected in zip(result[f"grads{step}"], single[f"grads{step}"]):
                tolerance = single["gradient_rtol"]
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


def test_adaptive_filter_state_is_identical_on_every_rank(ranks):
    single = _single_process()
    for result in ranks:
        # means of at most 36 terms of magnitude <= 1 (sigmoid features), summed in two orders
        torch.testing.assert_close(result["joint_ema"], single["joint_ema"], rtol=0, atol=single["moment_bound"])
