import pytest
import torch

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SmallConvNet, SpectrumCNN, ViewProjector
from tests.helpers import quiet_trainer


def test_a_module_without_any_cost_is_rejected():
    with pytest.raises(ConfigurationError, match="needs an external_head, internal_costs, or both"):
        HFMCAModule(SmallConvNet())


def test_a_projector_without_a_head_is_rejected():
    with pytest.raises(ConfigurationError, match="no external_head"):
        HFMCAModule(SpectrumCNN(), projector=torch.nn.Identity(), internal_costs=InternalCosts(["blocks.L1"]))


def test_cost_modules_are_named_like_their_logs():
    module = HFMCAModule(
        SpectrumCNN(channels=4, hidden_dim=8, noise_channels=0),
        external_head=GridExternalHead(4, 3, 3, 8, noise_channels=0),
        internal_costs=InternalCosts(["blocks.L1", "blocks.L9"], reg=1e-3, beta=0.5),
    )
    costs = module.cost_modules()
    assert list(costs) == ["external", "internal/L1", "internal/L9"]
    assert costs["internal/L9"].beta == 0.5 and costs["external"].reg == 0.1
    # The EMA buffers of every internal cost are part of the checkpointed state.
    assert "internal_costs.costs.blocks/L9.joint_ema" in module.state_dict()


def _bn_free_module(**kwargs) -> HFMCAModule:
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    )
    return HFMCAModule(
        backbone,
        projector=torch.nn.Linear(4, 4),
        external_head=GridExternalHead(4, 2, 2, 8, noise_channels=0),
        **kwargs,
    )


def test_per_view_and_concatenated_views_agree_without_batch_norm_in_the_backbone():
    views = torch.rand(3, 4, 3, 8, 8)
    concat, per_view = _bn_free_module(), _bn_free_module(views_through_backbone="per_view")
    per_view.load_state_dict(concat.state_dict())
    for module in (concat, per_view):
        module.eval()
    for got, expected in zip(per_view.encode_views(views), concat.encode_views(views)):
        torch.testing.assert_close(got, expected)


def test_per_view_batch_norm_sees_one_view_at_a_time():
    module = HFMCAModule(
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(3)),
        external_head=GridExternalHead(3, 1, 2, 4, noise_channels=0),
        views_through_backbone="per_view",
    )
    seen = []
    module.backbone[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    module.encode_views(torch.rand(5, 2, 3, 1, 1))
    assert seen == [5, 5]


def test_channels_last_and_compiled_backbone_give_the_same_features():
    images = torch.rand(2, 3, 8, 8)
    reference = _bn_free_module()
    fast = _bn_free_module(channels_last=True, compile_backbone=True)
    fast.load_state_dict(reference.state_dict())
    assert list(fast.state_dict()) == list(reference.state_dict())  # compiling does not rename weights
    assert fast.backbone[0].weight.is_contiguous(memory_format=torch.channels_last)
    # float32 sums in other orders: a 3x3 convolution over 3 channels (27 terms) and a mean over 64 positions,
    # 2 (gamma_27 + gamma_64) ~ 1.1e-5 of the terms' magnitudes (non-negative images, ReLU features)
    torch.testing.assert_close(fast(images), reference(images), rtol=1e-5, atol=1e-6)


def test_compiled_backbone_with_internal_costs_records_them_after_a_hookless_compiled_backbone():
    """compile_backbone with internal costs: the hooks run eagerly inside the compiled backbone, also when a
    backbone of the same class without hooks was compiled first in the process (TorchDynamo shares compiled
    code between instances and, by default, ignores hooks: the internal costs then never ran). Costs and
    gradients equal the eager module's."""
    views = torch.rand(2, 4, 3, 8, 8)
    default = torch._dynamo.config.skip_nnmodule_hook_guards
    hookless = _bn_free_module(compile_backbone=True)
    hookless.collect(views)  # compiles Sequential.forward without hooks
    assert torch._dynamo.config.skip_nnmodule_hook_guards == default  # scoped to the module's compiled calls
    results = []
    for compile_backbone in (False, True):
        module = _bn_free_module(internal_costs=InternalCosts(["0"]), compile_backbone=compile_backbone)
        objective = module.objective(module.collect(views))
        objective.total.backward()
        results.append(
            (
                {name: float(cost.detach()) for name, cost in objective.costs.items()},
                module.backbone[0].weight.grad.clone(),
            )
        )
    (eager_costs, eager_grad), (compiled_costs, compiled_grad) = results
    assert torch._dynamo.config.skip_nnmodule_hook_guards == default
    assert list(compiled_costs) == ["external", "internal/0"]
    # the compiled convolution sums its 27 terms in another order (2 gamma_27 ~ 3e-6 of the features); the costs of
    # these well-conditioned 4-d features (reg 0.1) move by a few times that, their gradients (sums over the
    # 8 x 64 positions of the backbone's weight gradient: 2 gamma_512 ~ 6e-5) by more
    assert compiled_costs == pytest.approx(eager_costs, rel=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_channels_last_backbone_with_internal_costs_gives_the_plain_costs_and_gradients():
    """HFMCAModule(channels_last=True) hands channels-last maps to every internal cost (their own statistics path,
    no copies; tests/losses/test_statistics.py checks it against float64): the costs and backbone gradients are
    the plain layout's. 2 x 9 views of ResNet-18 (with more than one chunk of images this crashed before the
    channels-last path existed; tests/losses/test_statistics.py checks the chunks)."""
    from hfmca_lightning.models import CIFARResNet18

    layers = [f"net.layer{stage}.{block}" for stage in range(1, 5) for block in range(2)]
    views = torch.rand(2, 9, 3, 32, 32)
    results = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        module = HFMCAModule(
            CIFARResNet18(),
            projector=torch.nn.Linear(512, 16),
            external_head=GridExternalHead(16, 3, 3, 8, noise_channels=0),
            internal_costs=InternalCosts(layers),
            channels_last=channels_last,
        ).train()
        objective = module.objective(module.collect(views))
        objective.total.backward()
        results.append((objective.costs, [p.grad for p in module.backbone.parameters()]))
    (plain_costs, plain_grads), (fast_costs, fast_grads) = results
    assert len(plain_costs) == 9 and plain_costs.keys() == fast_costs.keys()
    for name, cost in plain_costs.items():
        assert abs(float(fast_costs[name].detach()) - float(cost.detach())) <= 1e-5 * abs(float(cost.detach())), name
    # The backbone's convolutions alone differ by ~3e-3 between the layouts here (BN in training mode on 18
    # images amplifies float32 rounding; the external cost alone shows the same), so this bound is loose.
    for got, expected in zip(fast_grads, plain_grads):
        assert float((got - expected).norm()) <= 2e-2 * float(expected.norm())


def test_unknown_view_mode_is_rejected():
    with pytest.raises(ConfigurationError, match="views_through_backbone"):
        _bn_free_module(views_through_backbone="stacked")


def _bn_module(**kwargs) -> HFMCAModule:
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    )
    return HFMCAModule(
        backbone,
        projector=torch.nn.Linear(4, 4),
        external_head=GridExternalHead(4, 2, 2, 8, noise_channels=0),
        **kwargs,
    )


def _gradients_and_running_stats(
    module: HFMCAModule, views: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    module.train()
    module.objective(module.collect(views)).total.backward()
    norm = module.backbone[1]
    return [p.grad.clone() for p in module.parameters()], norm.running_mean.clone() if isinstance(
        norm, torch.nn.BatchNorm2d
    ) else None


def test_activation_checkpointing_gives_the_same_gradients_and_updates_batchnorm_once():
    views = torch.rand(3, 4, 3, 8, 8)
    plain_grads, plain_stats = _gradients_and_running_stats(_bn_module(), views)
    checkpointed = _bn_module(checkpoint_backbone=True)
    grads, stats = _gradients_and_running_stats(checkpointed, views)
    for got, expected in zip(grads, plain_grads):  # the recomputation runs the same kernels on the same inputs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats, plain_stats)  # the recomputation leaves the running statistics alone
    assert int(checkpointed.backbone[1].num_batches_tracked) == 1


def test_chunks_through_the_backbone_equal_one_batch_without_batch_norm():
    views = torch.rand(3, 4, 3, 8, 8)
    whole, chunked = _bn_free_module(), _bn_free_module(backbone_chunk_size=5, checkpoint_backbone=True)
    seen = []
    chunked.backbone[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    whole_grads, _ = _gradients_and_running_stats(whole, views)
    chunk_grads, _ = _gradients_and_running_stats(chunked, views)
    assert seen[:3] == [5, 5, 2]  # 12 views in chunks of 5 (then the recomputation)
    # the weight gradients sum 12 views x 64 positions in chunks of 5 views instead of all at once: float32 sums in
    # two groupings differ by at most 2 gamma_768 ~ 9e-5 of the terms' magnitudes
    for got, expected in zip(chunk_grads, whole_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_internal_statistics_add_up_over_views_and_chunks():
    def module(**kwargs) -> HFMCAModule:
        torch.manual_seed(0)
        backbone = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0)
        return HFMCAModule(
            backbone,
            external_head=GridExternalHead(4, 2, 2, 6, noise_channels=0),
            internal_costs=InternalCosts(["blocks.L1", "blocks.L3"]),
            **kwargs,
        ).eval()

    views = torch.rand(2, 4, 3, 32, 32)
    with torch.no_grad():
        reference = module().collect(views).statistics
        for variant in (module(views_through_backbone="per_view"), module(backbone_chunk_size=3)):
            statistics = variant.collect(views).statistics
            for name in ("internal/L1", "internal/L3"):
                assert int(statistics[name].group_count) == int(reference[name].group_count)
                for got, expected in zip(statistics[name].means(), reference[name].means()):
                    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("options", [{"views_through_backbone": "per_view"}, {"backbone_chunk_size": 3}])
def test_views_and_chunks_go_through_the_backbone_as_configured_without_an_external_head(options):
    """Internal costs alone (no head): ``per_view`` and ``backbone_chunk_size`` split the backbone's batch as with a
    head, and the statistics add up to those of one batch."""

    def module(**kwargs) -> HFMCAModule:
        torch.manual_seed(0)
        backbone = SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0)
        return HFMCAModule(backbone, internal_costs=InternalCosts(["blocks.L1", "blocks.L3"]), **kwargs).eval()

    views = torch.rand(2, 4, 3, 32, 32)
    variant, seen = module(**options), []
    variant.backbone.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    with torch.no_grad():
        reference = module().collect(views).statistics
        statistics = variant.collect(views).statistics
    assert seen == ([2, 2, 2, 2] if "views_through_backbone" in options else [3, 3, 2])
    for name in ("internal/L1", "internal/L3"):
        assert int(statistics[name].group_count) == int(reference[name].group_count)
        for got, expected in zip(statistics[name].means(), reference[name].means()):
            torch.testing.assert_close(got, expected)


def test_checkpointing_and_internal_costs_are_exclusive():
    with pytest.raises(ConfigurationError, match="checkpoint_backbone recomputes") as error:
        HFMCAModule(
            SpectrumCNN(channels=4, hidden_dim=6),
            external_head=GridExternalHead(4, 3, 3, 6, noise_channels=0),
            internal_costs=InternalCosts(["blocks.L1"]),
            checkpoint_backbone=True,
        )
    assert error.value.parameter == "checkpoint_backbone"


def test_the_objective_leaves_its_checks_on_the_device_until_they_are_read():
    """Without ``check`` (a training step) the costs, the total and the backward pass read nothing on the host;
    every cost's factorisation checks and the total's finiteness are then read together, once (a GPU waits for
    its queue at each such read)."""
    torch.manual_seed(0)
    module = HFMCAModule(
        SpectrumCNN(channels=4, hidden_dim=6, noise_channels=0),
        external_head=GridExternalHead(4, 2, 2, 6, noise_channels=0),
        internal_costs=InternalCosts(["blocks.L1", "blocks.L3"]),
    ).train()
    collected = module.collect(torch.rand(2, 4, 3, 32, 32))
    with HostReads() as recorder:
        objective = module.objective(collected, check=False)
        objective.total.backward()
    assert set(objective.costs) == {"external", "internal/L1", "internal/L3"}
    assert recorder.reads == []
    with HostReads() as recorder:
        objective.checks.raise_if_failed()
    assert len(recorder.reads) == 1, recorder.reads


def _small_hfmca_and_data(**data_options) -> tuple[HFMCAModule, MultiViewDataModule]:
    module = HFMCAModule(
        SmallConvNet(width=4, num_stages=2),
        projector=ViewProjector(8, 8, 8),
        external_head=GridExternalHead(8, 2, 2, 8, noise_channels=0),
    )
    options = {"views": SimCLRViews(count=4), "batch_size": 4, **data_options}
    data = MultiViewDataModule(
        SyntheticShapes(num_classes=4, train_per_class=8, test_per_class=3, image_size=16), num_workers=0, **options
    )
    return module, data


def test_crop_grids_are_refused_before_training():
    """Crop grids (VICRegL's) make batches (views, targets, grids): before, 'too many values to unpack' at step 0."""
    module, data = _small_hfmca_and_data(views=SimCLRViews(count=4, grids=4))
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    with pytest.raises(
        ConfigurationError,
        match=r"views draws crop grids \(grids=4\), which only VICRegL reads; HFMCAModule takes \(views, targets\) "
        "batches: remove grids from the views",
    ) as refused:
        trainer.fit(module, data)
    assert refused.value.parameter == "grids" and trainer.global_step == 0


def test_one_image_per_batch_is_refused_before_training():
    """The external head's last BatchNorm sees one 1x1 map per image: before, torch's 'Expected more than 1 value per
    channel' at the first step."""
    module, data = _small_hfmca_and_data(batch_size=1)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    with pytest.raises(
        ConfigurationError,
        match=r"HFMCAModule trains on batches of 1 sample per process, but its BatchNorm layer "
        r"external_head\.layers\.8 normalises over the samples and needs at least 2 \(under DDP the batch is per "
        r"process\)",
    ) as refused:
        trainer.fit(module, data)
    assert refused.value.parameter == "batch_size" and trainer.global_step == 0
    module, data = _small_hfmca_and_data(batch_size=2)
    quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, data)  # two images train
    assert module.global_step == 1
