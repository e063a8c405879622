"""The cost path of a step with all nine costs of the CIFAR configs (external + 8 ResNet-18 BasicBlocks):
factorisations batched by matrix size, values and gradients equal to costs taken one at a time, and the whole
path (statistics -> costs -> total) compiling as one graph, which CUDA-graph capture needs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hfmca_lightning.diagnostics import OperationCounts
from hfmca_lightning.losses import CorrelationStatistics
from hfmca_lightning.losses.hfmca_cost import apply_filter_updates, cost_values
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.methods.hfmca import objective_values
from hfmca_lightning.models import CIFARResNet18, GridExternalHead, ViewProjector

LAYERS = [f"net.layer{stage}.{block}" for stage in range(1, 5) for block in range(2)]


def cifar_module(beta: float = 0.0) -> HFMCAModule:
    """The model of configs/cifar10_ss_internal.yaml (K = 128, LF hidden 200 with 20 noise channels)."""
    torch.manual_seed(0)
    return HFMCAModule(
        CIFARResNet18(),
        projector=ViewProjector(512, 128, 512),
        external_head=GridExternalHead(128, 3, 3, 200, noise_channels=20),
        internal_costs=InternalCosts(LAYERS, beta=beta),
    ).train()


@pytest.fixture(scope="module")
def step_statistics() -> dict[str, CorrelationStatistics]:
    """A step's float64 statistics of the nine pairs (2 images x 9 views of 32 px)."""
    module = cifar_module()
    with torch.no_grad():
        return module.collect(
            torch.rand(2, 9, 3, 32, 32, generator=torch.Generator().manual_seed(1)), precision="float64"
        ).statistics


def leaves(statistics: dict[str, CorrelationStatistics]) -> list[CorrelationStatistics]:
    """Copies whose three sums are leaves that require gradients."""
    return [
        dataclasses.replace(
            stats,
            **{
                field: getattr(stats, field).clone().requires_grad_(True)
                for field in ("low_outer_sum", "high_outer_sum", "cross_sum")
            },
        )
        for stats in statistics.values()
    ]


def sum_gradients(statistics: list[CorrelationStatistics], total: torch.Tensor) -> list[torch.Tensor]:
    return list(
        torch.autograd.grad(
            total,
            [
                getattr(stats, field)
                for stats in statistics
                for field in ("low_outer_sum", "high_outer_sum", "cross_sum")
            ],
        )
    )


def test_a_step_factors_each_matrix_size_once(step_statistics):
    """Forward and backward of a training step of the nine costs: one batched Cholesky call per distinct matrix
    size (the joint matrices J of size K1 + K2 and the C of size K2; 8 sizes here, 27 separate calls when each
    cost factored A, S and C alone), and one triangular solve per group of costs of equal dimensions."""
    sizes = {stats.low_dim + stats.high_dim for stats in step_statistics.values()} | {
        stats.high_dim for stats in step_statistics.values()
    }
    shapes = {(stats.low_dim, stats.high_dim) for stats in step_statistics.values()}
    assert len(step_statistics) == 9 and len(sizes) == 8 and len(shapes) == 7
    module = cifar_module()
    views = torch.rand(2, 9, 3, 32, 32)
    with (
        OperationCounts(torch.ops.aten.linalg_cholesky_ex) as factorisations,
        OperationCounts(torch.ops.aten.linalg_solve_triangular) as solves,
    ):
        objective = module.objective(module.collect(views), check=False)
        objective.total.backward()
    objective.checks.raise_if_failed()
    assert factorisations.count == len(sizes), factorisations.count
    assert solves.count == len(shapes), solves.count


@pytest.mark.parametrize("beta", [0.0, 0.5], ids=["exact", "filtered"])
def test_costs_taken_together_equal_costs_taken_one_at_a_time(step_statistics, beta):
    """Values and gradients (w.r.t. every pair's sums, float64) of the batched path equal those of each cost taken
    alone, to 1e-10 relative; with the adaptive filter over two steps (its EMA buffers too)."""
    results = []
    for together in (True, False):
        costs = list(cifar_module(beta).cost_modules().values())
        for _ in range(2):
            statistics = leaves(step_statistics)
            if together:
                for stats, cost in zip(statistics, costs):
                    cost.prepare_filter(stats) if cost.filtering() else None
                values, state, filters = cost_values(statistics, costs)
                apply_filter_updates(costs, filters)
            else:
                values, state = [], []
                for stats, cost in zip(statistics, costs):
                    cost.prepare_filter(stats) if cost.filtering() else None
                    (value,), row, filters = cost_values([stats], [cost])
                    apply_filter_updates([cost], filters)
                    values.append(value)
                    state.append(row)
                state = torch.cat(state)
            assert not bool(state.any())
            total = torch.stack(values).sum()
            results.append(
                (
                    torch.stack(values).detach(),
                    sum_gradients(statistics, total),
                    [cost.joint_ema.clone() for cost in costs],
                )
            )
    # Both paths factor each matrix with the same LAPACK call on the same numbers; they differ only in how the
    # float64 products of the gradients are blocked (a stack of products against one at a time): at most 2 gamma_K
    # (K <= 1,024: 2.3e-13) of the terms' magnitudes, which the difference of two inverses in G_C = S^-1 - C^-1 can
    # lift by its ratio to the result (< 100 here). The 1e-10 asked for holds with a margin.
    for (values, gradients, emas), (values_alone, gradients_alone, emas_alone) in zip(results[:2], results[2:]):
        torch.testing.assert_close(values, values_alone, rtol=1e-10, atol=0)
        for got, expected in zip(gradients, gradients_alone):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
        for got, expected in zip(emas, emas_alone):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_the_cost_path_compiles_as_one_graph(step_statistics):
    """``torch.compile(fullgraph=True)`` of statistics -> costs -> total raises on any graph break; the compiled
    path gives the eager values, checks and gradients."""
    costs = list(cifar_module().cost_modules().values())
    compiled = torch.compile(objective_values, fullgraph=True, dynamic=False, backend="aot_eager")
    results = []
    for function in (objective_values, compiled):
        statistics = leaves(step_statistics)
        values, total, state, total_failed, _ = function(statistics, costs, True, 1.0)
        results.append(
            (torch.stack(values).detach(), total.detach(), state, total_failed, sum_gradients(statistics, total))
        )
    (values, total, state, total_failed, gradients), (c_values, c_total, c_state, c_total_failed, c_gradients) = results
    # aot_eager runs the same aten operations (traced): equal up to the order of a few float64 additions
    torch.testing.assert_close(c_values, values, rtol=1e-12, atol=0)
    torch.testing.assert_close(c_total, total, rtol=1e-12, atol=0)
    assert torch.equal(c_state, state) and torch.equal(c_total_failed, total_failed)
    for got, expected in zip(c_gradients, gradients):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_compile_costs_trains_like_the_eager_module(monkeypatch):
    """``HFMCAModule(compile_costs=True)`` compiles the cost path once, as one graph (CUDA graphs only on CUDA), and its
    training steps' costs and backbone gradients equal the eager module's (two steps: the filter's EMA too)."""
    calls = []
    compile_function = torch.compile

    def recording_compile(function, **options):
        calls.append((function, options))
        return compile_function(function, **{**options, "backend": "aot_eager"})  # no C++ compiler needed

    monkeypatch.setattr(torch, "compile", recording_compile)
    results = []
    views = torch.rand(2, 9, 3, 32, 32)
    for compile_costs in (False, True):
        torch.manual_seed(0)
        module = HFMCAModule(
            torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
            ),
            projector=torch.nn.Linear(8, 8),
            external_head=GridExternalHead(8, 3, 3, 8, noise_channels=0),
            internal_costs=InternalCosts(["0", "2"], beta=0.5),
            compile_costs=compile_costs,
        ).train()
        for _ in range(2):
            module.zero_grad()
            objective = module.objective(module.collect(views))
            objective.total.backward()
        results.append((torch.stack(list(objective.costs.values())).detach(), module.backbone[0].weight.grad.clone()))
    (costs, gradient), (compiled_costs, compiled_gradient) = results
    assert calls == [(objective_values, {"fullgraph": True, "dynamic": False, "mode": None})]
    # the same aten operations; the backbone's float32 gradient sums the costs' float64 gradients cast to float32
    # over 18 images x 256 positions: 2 gamma_4608 ~ 5e-4 worst case of the terms' magnitudes, ~sqrt(n) u ~ 4e-6 in
    # practice; both runs take the same float32 path, so only the costs' last float64 bits can differ: 1e-6
    torch.testing.assert_close(compiled_costs, costs, rtol=1e-10, atol=0)
    torch.testing.assert_close(compiled_gradient, gradient, rtol=1e-6, atol=1e-9)
