"""What only a GPU shows (marked ``cuda``, skipped without CUDA; ``make gpu-check`` runs them first): compiled costs
in CUDA graphs equal eager ones across accumulated micro-batches with the adaptive filter, without CUDA-graph skips;
NaN statistics (CUDA's ``cholesky_ex`` reports success on them) stop the run in one line with a finite filter; views
drawn on the GPU equal the CPU's; split-TF32 statistics meet the fast path's tolerance on real tensor cores, and bf16
statistics theirs where ``auto`` takes them; and a whole training step of the shipped internal config makes no host
synchronisation."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs these)"),
]

CUDA = torch.device("cuda")


def small_module(compile_costs: bool = False, beta: float = 0.5):
    from hfmca_lightning.losses import HFMCACost
    from hfmca_lightning.methods import HFMCAModule, InternalCosts
    from hfmca_lightning.models import GridExternalHead, SmallConvNet, ViewProjector

    torch.manual_seed(0)
    return HFMCAModule(
        SmallConvNet(width=16, num_stages=2),
        projector=ViewProjector(32, 16, 32),
        external_head=GridExternalHead(16, 2, 2, 16, noise_channels=0),
        external_cost=HFMCACost(reg=0.1, beta=beta, name="external"),
        internal_costs=InternalCosts(["features.0", "features.1"], beta=beta),
        compile_costs=compile_costs,
    ).to(CUDA)


def test_compiled_costs_in_cuda_graphs_equal_eager_ones_over_accumulated_micro_batches_with_the_filter():
    """Two steps of two micro-batches each (gradient accumulation), beta = 0.5: costs, gradients, the filters'
    buffers and the merged checks of the compiled path (CUDA graphs) equal the eager path's to 1e-6 relative, with
    no CUDA-graph skip and one compilation."""
    from torch._dynamo.utils import counters

    from hfmca_lightning.losses.cost_checks import merge_checks

    counters.clear()
    generator = torch.Generator(device=CUDA).manual_seed(3)
    batches = [torch.rand(4, 4, 3, 16, 16, device=CUDA, generator=generator) for _ in range(4)]
    results = []
    for compile_costs in (False, True):
        module = small_module(compile_costs).train()
        costs, checks = [], []
        for step in range(2):
            module.zero_grad(set_to_none=True)
            pending = []
            for micro in batches[2 * step : 2 * step + 2]:
                objective = module.objective(module.collect(micro), check=False)
                objective.total.backward()
                costs.append(torch.stack(list(objective.costs.values())).detach().clone())
                pending.append(objective.checks)
            checks.append(merge_checks(pending).packed().cpu())
        gradients = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
        filters = torch.cat([cost.joint_ema.flatten() for cost in module.cost_modules().values()])
        results.append((torch.stack(costs), gradients, filters, checks))
    (costs, gradients, filters, checks), (c_costs, c_gradients, c_filters, c_checks) = results
    torch.testing.assert_close(c_costs, costs, rtol=1e-6, atol=0)
    torch.testing.assert_close(c_gradients, gradients, rtol=1e-6, atol=1e-6 * float(gradients.abs().max()))
    torch.testing.assert_close(c_filters, filters, rtol=1e-6, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(checks, c_checks)) and not any(bool(c.any()) for c in c_checks)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # no recompilation


def test_nan_statistics_stop_the_run_in_one_line_and_leave_the_filters_finite():
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
    from hfmca_lightning.losses.cost_checks import CostFactorisationError
    from tests.helpers import PoisonBatchAt, quiet_trainer

    module = small_module(beta=0.5)
    module.optimizer_factory = partial(torch.optim.SGD, lr=0.05, fused=True)
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=16, test_per_class=2, image_size=16),
        views=SimCLRViews(count=4),
        batch_size=4,
        num_workers=0,
    )
    poison = PoisonBatchAt(step=3)
    trainer = quiet_trainer(max_steps=8, limit_val_batches=0, callbacks=[poison], accelerator="gpu", devices=1)
    with pytest.raises(
        CostFactorisationError,
        match=r"^training stopped at step 3, in epoch 1 \(epoch=0 in checkpoint names\): HFMCA cost",
    ):
        trainer.fit(module, data)
    assert all(bool(torch.isfinite(cost.joint_ema).all()) for cost in module.cost_modules().values())
    assert all(torch.equal(a, b) for a, b in zip(poison.weights[2], poison.weights[3]))  # the update was skipped


@pytest.mark.parametrize("drawer", ["batched on the device", "resident, 4 batches per call"])
def test_views_drawn_on_the_gpu_equal_the_cpu_workers_views(drawer):
    from hfmca_lightning.data import BatchedDrawer, MultiViewDataModule, ResidentDrawer, SimCLRViews, SyntheticShapes
    from hfmca_lightning.evaluation_data import view_batches

    source = SyntheticShapes(num_classes=4, train_per_class=16, test_per_class=2)
    on_gpu = BatchedDrawer(on="device") if drawer.startswith("batched") else ResidentDrawer(batches_per_call=4)
    gpu = MultiViewDataModule(source, views=SimCLRViews(count=4), drawer=on_gpu, batch_size=4, num_workers=0, seed=2)
    cpu = MultiViewDataModule(
        source, views=SimCLRViews(count=4), drawer=BatchedDrawer(), batch_size=4, num_workers=0, seed=2
    )
    gpu.setup()
    drawn = [batch.groups[0].cpu() for batch in view_batches(gpu, CUDA, limit=6)]
    expected = [views for views, _ in list(cpu.train_dataloader())[:6]]
    assert len(drawn) == len(expected) == 6
    for got, want in zip(drawn, expected):
        # the same parameters (integer counter hashes); float32 resampling and blends on another device: a few ulps
        # of the pixels (in [0, 1], normalised by std 0.25: x4)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["channels-last", "plain"])
def test_window_means_adjoint_on_the_gpu_is_autograds_on_the_cpu(layout):
    """The statistics' ``avg_pool2d`` adjoint in both layouts, with padding (where CUDA's channels-last
    ``avg_pool2d_backward`` misplaced windows, pytorch/pytorch#188344), against float64 autograd on the CPU."""
    import torch.nn.functional as F

    from hfmca_lightning.losses import WindowGeometry
    from hfmca_lightning.losses.block_arithmetic import avg_pool_means_adjoint

    for geometry in (WindowGeometry(5, 1, 2), WindowGeometry(7, 2, 3)):
        maps = torch.randn(4, 16, 12, 12, dtype=torch.float64).requires_grad_()
        means = F.avg_pool2d(maps, geometry.kernel, geometry.stride, geometry.padding, count_include_pad=False)
        d_means = torch.randn_like(means)
        (expected,) = torch.autograd.grad(means, maps, d_means)
        on_gpu = d_means.float().to(CUDA).contiguous(memory_format=layout)
        got = avg_pool_means_adjoint(on_gpu, (12, 12), geometry).cpu().double()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # float32 sums of a few terms of size ~1


# docs/conventions.md §3: tensor cores accumulate float32 with truncation, so tf32x3's rounding errors add up where
# IEEE float32's average out; its GPU tolerance is ten times the fast path's
TF32X3_TENSOR_CORE_COST_TOLERANCE = 1e-4
TF32X3_TENSOR_CORE_GRADIENT_TOLERANCE = 5e-4


def test_split_tf32_statistics_meet_their_tolerance_on_tensor_cores():
    from hfmca_lightning.losses import WindowGeometry, cost_from_statistics, feature_map_statistics
    from tests.losses.test_statistics import realistic_pair

    for k1, k2, size, geometry in ((64, 64, 32, WindowGeometry(5, 1, 2)), (256, 512, 8, WindowGeometry(7, 2, 3))):
        low, high = (x.detach().to(CUDA).requires_grad_() for x in realistic_pair(12, k1, k2, size, geometry, seed=1))
        results = {}
        for precision in ("float64", "tf32x3"):
            cost = cost_from_statistics(feature_map_statistics(low, high, geometry, precision=precision), reg=0.1)
            results[precision] = (float(cost.detach()), torch.autograd.grad(cost, (low, high)))
        (exact, exact_grads), (split, split_grads) = results["float64"], results["tf32x3"]
        cost_error = abs(split - exact) / abs(exact)
        gradient_errors = [
            float((got.double() - want.double()).norm() / want.double().norm())
            for got, want in zip(split_grads, exact_grads)
        ]
        assert cost_error <= TF32X3_TENSOR_CORE_COST_TOLERANCE, (k1, k2, cost_error)
        assert max(gradient_errors) <= TF32X3_TENSOR_CORE_GRADIENT_TOLERANCE, (k1, k2, gradient_errors)


def test_bf16_statistics_on_tensor_cores_meet_their_tolerance_where_auto_takes_them():
    """The path ``auto`` runs for bf16-mixed training on the GPU (bf16 products with float32 results, ``out_dtype``):
    at 576 views ``auto`` resolves to ``bf16`` on GPUs of compute capability 8.0 and later, and its costs and gradients
    meet the tolerance the CPU tests state (docs/conventions.md §3)."""
    from hfmca_lightning.losses import WindowGeometry
    from hfmca_lightning.losses.map_statistics import _OUT_DTYPE_PRODUCTS
    from hfmca_lightning.losses.statistics import resolved_precision
    from tests.losses.test_bfloat16_statistics import (
        BF16_GRADIENT_TOLERANCE,
        FAST_COST_TOLERANCE,
        bfloat16_maps,
        cost_and_gradients,
        relative_errors,
    )

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 statistics need bf16 tensor cores (compute capability 8.0 and later)")
    assert _OUT_DTYPE_PRODUCTS, "this torch has no bf16 products with float32 results; auto would not take bf16"
    for k1, k2, size, geometry in ((64, 64, 32, WindowGeometry(5, 1, 2)), (256, 512, 8, WindowGeometry(7, 2, 3))):
        low, high = (x.detach().to(CUDA).requires_grad_() for x in bfloat16_maps(k1, k2, size, geometry, batch=576))
        assert resolved_precision(low, high, geometry) == "bf16"
        exact = cost_and_gradients(low, high, geometry, "float64")
        cost_error, gradient_errors = relative_errors(cost_and_gradients(low, high, geometry, "auto"), exact)
        assert cost_error <= FAST_COST_TOLERANCE, (k1, k2, cost_error)
        assert max(gradient_errors) <= BF16_GRADIENT_TOLERANCE, (k1, k2, gradient_errors)


def instantiate(node):
    """``class_path`` / ``init_args`` of a config, built without jsonargparse (which GPU machines may lack)."""
    import importlib

    if isinstance(node, dict) and "class_path" in node:
        module, _, name = node["class_path"].rpartition(".")
        arguments = {key: instantiate(value) for key, value in (node.get("init_args") or {}).items()}
        return getattr(importlib.import_module(module), name)(**arguments)
    if isinstance(node, list):
        return [instantiate(item) for item in node]
    if isinstance(node, dict):
        return {key: instantiate(value) for key, value in node.items()}
    return node


def test_a_training_step_of_the_shipped_internal_config_makes_no_host_synchronisation(tmp_path):
    """configs/cifar10_ss_internal.yaml's model (ResNet-18, 9 costs, tf32x3 statistics) and optimizer (fused SGD) on
    small data whose views are drawn on the GPU from the training set kept there, bf16: steps 2-4 run under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call."""
    import yaml
    from lightning.pytorch import Callback

    from hfmca_lightning.data import MultiViewDataModule, ResidentDrawer, SimCLRViews, SyntheticShapes
    from tests.helpers import REPO, quiet_trainer

    class NoSyncSteps(Callback):
        def __init__(self) -> None:
            self.checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx in (2, 3, 4):
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx in (2, 3, 4):
                torch.cuda.set_sync_debug_mode("default")
                self.checked += 1

    config = yaml.safe_load((REPO / "configs" / "cifar10_ss_internal.yaml").read_text())["model"]["init_args"]
    optimizer = config.pop("optimizer")
    module = instantiate({"class_path": "hfmca_lightning.methods.HFMCAModule", "init_args": config})
    assert optimizer["class_path"] == "torch.optim.SGD" and optimizer["init_args"]["fused"]
    module.optimizer_factory = partial(torch.optim.SGD, **optimizer["init_args"])
    data = MultiViewDataModule(
        SyntheticShapes(train_per_class=40, test_per_class=2),
        views=SimCLRViews(count=9),
        drawer=ResidentDrawer(batches_per_call=2),
        batch_size=32,
        num_workers=0,
    )
    checker = NoSyncSteps()
    trainer = quiet_trainer(
        max_steps=6,
        precision="bf16-mixed",
        limit_val_batches=0,
        log_every_n_steps=50,
        callbacks=[checker],
        accelerator="gpu",
        devices=1,
    )
    try:
        trainer.fit(module, data)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert checker.checked == 3
