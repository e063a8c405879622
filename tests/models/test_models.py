import re

import pytest
import torch
from torch import nn

from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses import WindowGeometry
from hfmca_lightning.methods import InternalCosts
from hfmca_lightning.models import (
    CIFARResNet18,
    GridExternalHead,
    NoiseChannels,
    SmallConvNet,
    TimmBackbone,
    TorchvisionBackbone,
    ViewProjector,
)


def test_cifar_resnet18_has_the_cifar_stem():
    backbone = CIFARResNet18()
    conv1 = backbone.net.conv1
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and conv1.padding == (1, 1)
    assert isinstance(backbone.net.maxpool, nn.Identity) and isinstance(backbone.net.fc, nn.Identity)
    assert backbone(torch.rand(2, 3, 32, 32)).shape == (2, 512)
    # No downsampling before layer2: layer1 keeps the 32x32 resolution.
    trunk = nn.Sequential(
        backbone.net.conv1, backbone.net.bn1, backbone.net.relu, backbone.net.maxpool, backbone.net.layer1
    )
    assert trunk(torch.rand(1, 3, 32, 32)).shape == (1, 64, 32, 32)


def test_small_conv_net_feature_dim():
    net = SmallConvNet(width=8, num_stages=2)
    assert net.feature_dim == 16 and net(torch.rand(3, 3, 16, 16)).shape == (3, 16)


def test_projector_outputs_in_unit_interval():
    out = ViewProjector(16, 8, 32)(torch.randn(10, 16) * 100)
    assert out.shape == (10, 8) and bool((out >= 0).all()) and bool((out <= 1).all())


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ViewProjector(input_dim=0), "ViewProjector: input_dim must be >= 1; got 0"),
        (lambda: ViewProjector(hidden_dim=-2), "ViewProjector: hidden_dim must be >= 1; got -2"),
        (lambda: GridExternalHead(feature_dim=0), "GridExternalHead: feature_dim must be >= 1; got 0"),
        (lambda: GridExternalHead(hidden_dim=0), "GridExternalHead: hidden_dim must be >= 1; got 0"),
        (lambda: GridExternalHead(output_dim=0), "GridExternalHead: output_dim must be >= 1; got 0"),
        (lambda: GridExternalHead(noise_channels=-1), "GridExternalHead: noise_channels must be >= 0; got -1"),
        (lambda: GridExternalHead(grid_height=0), "GridExternalHead: grid_height must be >= 1; got 0"),
        (lambda: GridExternalHead(8, 2.0, 2), "GridExternalHead: grid_height must be a whole number >= 1; got 2.0"),
        (lambda: SmallConvNet(width=8.0), "SmallConvNet: width must be a whole number >= 1; got 8.0"),
    ],
)
def test_head_and_projector_sizes_out_of_range_are_one_clear_error(build, message):
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        build()
    GridExternalHead(noise_channels=0, output_dim=None)  # no noise, and the output of feature_dim: allowed


def test_head_places_view_l_at_row_l_div_gw_and_column_l_mod_gw():
    head = GridExternalHead(feature_dim=1, grid_height=2, grid_width=3, hidden_dim=1, noise_channels=0)
    captured = {}
    head.layers[1].register_forward_hook(lambda module, args, out: captured.setdefault("grid", args[0]))
    head.eval()
    views = torch.arange(6, dtype=torch.float32).reshape(1, 6, 1)
    assert head(views).shape == (1, 1)
    grid = captured["grid"][0, 0]
    for view in range(6):
        assert grid[view // 3, view % 3] == view


def test_head_with_noise_channels_and_wrong_view_count():
    head = GridExternalHead(feature_dim=4, grid_height=3, grid_width=3, hidden_dim=8, noise_channels=20)
    assert head.layers[1].in_channels == 24 and head.num_views == 9
    assert head(torch.rand(2, 9, 4)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"expects \(B, 9, 4\) view features for its 3x3 grid"):
        head(torch.rand(2, 8, 4))


def test_noise_channels_append_uniform_noise():
    x = torch.rand(2, 3, 5, 5)
    out = NoiseChannels(20)(x)
    assert out.shape == (2, 23, 5, 5) and torch.equal(out[:, :3], x)
    assert 0 <= float(out[:, 3:].min()) and float(out[:, 3:].max()) <= 1
    assert NoiseChannels(0)(x) is x


@pytest.mark.parametrize(
    ("name", "feature_dim"),
    [
        ("resnet50", 2048),
        ("wide_resnet50_2", 2048),
        ("convnext_tiny", 768),
        ("mobilenet_v3_small", 1024),
        ("vit_b_16", 768),
    ],
)
def test_any_torchvision_classifier_by_name_without_its_classifier(name, feature_dim):
    backbone = TorchvisionBackbone(name).eval()
    assert backbone.feature_dim == feature_dim
    assert not [m for m in backbone.modules() if isinstance(m, nn.Linear) and m.out_features == 1000], (
        "the 1000-way classifier is gone"
    )
    with torch.no_grad():
        assert backbone(torch.rand(1, 3, 224, 224)).shape == (1, feature_dim)


def test_cifar_resnet18_is_the_torchvision_resnet18_with_the_cifar_stem():
    torch.manual_seed(0)
    named = TorchvisionBackbone("resnet18", cifar_stem=True)
    torch.manual_seed(0)
    cifar = CIFARResNet18()
    assert named.state_dict().keys() == cifar.state_dict().keys()
    assert all(torch.equal(value, cifar.state_dict()[key]) for key, value in named.state_dict().items())
    assert TorchvisionBackbone("resnet50", cifar_stem=True)(torch.rand(2, 3, 32, 32)).shape == (2, 2048)


def test_backbone_names_and_stems_are_checked():
    with pytest.raises(
        ConfigurationError, match="'resnet5' is not a torchvision classification model; did you mean resnet50"
    ) as error:
        TorchvisionBackbone("resnet5")
    assert error.value.parameter == "name"
    with pytest.raises(
        ConfigurationError,
        match="cifar_stem replaces conv1 and the max-pool of ResNet-family models; convnext_tiny has none",
    ):
        TorchvisionBackbone("convnext_tiny", cifar_stem=True)


def test_timm_vit_is_a_backbone_and_refuses_internal_costs_clearly():
    pytest.importorskip("timm")
    vit = TimmBackbone("vit_tiny_patch16_224", model_kwargs={"img_size": 32, "patch_size": 8})
    assert vit.feature_dim == 192 and vit(torch.rand(2, 3, 32, 32)).shape == (2, 192)
    with pytest.raises(
        ConfigurationError,
        match="transformer blocks .* have no window geometry: train such backbones with the external cost only",
    ):
        InternalCosts(["net.blocks.0"]).attach(vit)
    with pytest.raises(ConfigurationError, match="is not a timm model; did you mean"):
        TimmBackbone("vit_tiny_patch16_22")


def test_a_timm_backbones_feature_dim_is_the_size_of_what_it_gives() -> None:
    """MobileNetV3 keeps a head after its last stage (288 channels -> 1024 features): feature_dim is what comes out,
    which the projector's input_dim is checked against."""
    pytest.importorskip("timm")
    for name in ("mobilenetv3_small_050", "resnet18"):
        backbone = TimmBackbone(name)
        assert backbone(torch.randn(2, 3, 32, 32)).shape == (2, backbone.feature_dim), name


def test_a_keyword_the_timm_model_does_not_take_is_named():
    pytest.importorskip("timm")
    with pytest.raises(ConfigurationError, match="timm model 'resnet18' takes no argument 'bogus_key'") as raised:
        TimmBackbone("resnet18", model_kwargs={"drop_rate": 0.1, "bogus_key": 3})
    assert raised.value.parameter == "model_kwargs"


def test_internal_costs_on_resnet50_bottlenecks():
    backbone = TorchvisionBackbone("resnet50")
    internal = InternalCosts(["net.layer1.0", "net.layer2.0", "net.layer3.1"])
    internal.attach(backbone)
    # torchvision's Bottleneck strides in its 3x3 conv: the window is that conv's.
    assert [pair.geometry for pair in internal.pairs] == [
        WindowGeometry(3, 1, 1),
        WindowGeometry(3, 2, 1),
        WindowGeometry(3, 1, 1),
    ]
    with internal.record() as recording:
        backbone(torch.rand(2, 3, 64, 64))
    costs = [pair.cost.forward_statistics(recording.statistics[pair.cost_name]) for pair in internal.pairs]
    assert all(torch.isfinite(cost) and cost <= 0 for cost in costs)
    assert recording.statistics["internal/layer2.0"].high_dim == 512


def test_weights_a_model_does_not_have_are_one_line_before_any_download():
    """A typo used to be enum's KeyError, which the command turned into a 111-line "Union subtypes" traceback."""
    with pytest.raises(
        ConfigurationError, match=r"'IMAGENET1K_V2' is not a weight of resnet18; it has IMAGENET1K_V1, DEFAULT"
    ) as error:
        TorchvisionBackbone("resnet18", weights="IMAGENET1K_V2")
    assert error.value.parameter == "weights"


def test_the_cifar_stem_on_pretrained_weights_says_its_conv1_is_new(monkeypatch):
    """The pretrained conv1 is replaced by a random one: said, not silent (the download is faked: no network)."""
    import torchvision

    from hfmca_lightning.errors import HFMCAWarning

    built = {}

    def offline(name, weights=None):
        built["weights"] = weights
        return torchvision.models.resnet18()

    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.warns(HFMCAWarning, match=r"cifar_stem replaces the pretrained conv1 of resnet18 \(ResNet18_Weights"):
        backbone = TorchvisionBackbone("resnet18", weights="ResNet18_Weights.IMAGENET1K_V1", cifar_stem=True)
    assert built["weights"] == "ResNet18_Weights.IMAGENET1K_V1" and backbone.net.conv1.kernel_size == (3, 3)


def test_vision_transformers_of_one_input_size_are_checked_against_the_data():
    """A 224-px ViT on 32-px images failed with torch's assertion inside the first step; now the data check names both
    sizes before training. A timm ViT built for the data's size passes."""
    from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes
    from hfmca_lightning.methods.compatibility import check_image_size

    data = MultiViewDataModule(SyntheticShapes(num_classes=2, train_per_class=4))
    message = r"gives 32-px images, but the backbone {} is built for image_size=224"
    with pytest.raises(ConfigurationError, match=message.format("TorchvisionBackbone")):
        check_image_size(TorchvisionBackbone("vit_b_32"), data)
    assert not hasattr(TorchvisionBackbone("resnet18"), "image_size")  # convolutional: any size
    pytest.importorskip("timm")
    with pytest.raises(ConfigurationError, match=message.format("TimmBackbone")):
        check_image_size(TimmBackbone("vit_tiny_patch16_224"), data)
    check_image_size(TimmBackbone("vit_tiny_patch16_224", model_kwargs={"img_size": 32, "patch_size": 8}), data)


@pytest.mark.parametrize(("name", "size"), [("googlenet", 32), ("inception_v3", 75)])
def test_models_with_auxiliary_classifiers_give_their_features_in_training_mode(name, size):
    """GoogLeNet and Inception-v3 returned torchvision's GoogLeNetOutputs / InceptionOutputs of logits in training
    mode (the first step failed in the projector); their auxiliary classifiers are removed."""
    backbone = TorchvisionBackbone(name).train()
    assert not [m for m in backbone.modules() if isinstance(m, nn.Linear) and m.out_features == 1000]
    features = backbone(torch.rand(2, 3, size, size))
    assert isinstance(features, torch.Tensor) and features.shape == (2, backbone.feature_dim)


def tiny_simclr_data(image_size: int = 32):
    from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes

    source = SyntheticShapes(num_classes=2, train_per_class=4, test_per_class=2, image_size=image_size)
    return MultiViewDataModule(source, views=SimCLRViews(count=2), batch_size=4, num_workers=0)


def test_googlenet_trains():
    from hfmca_lightning.methods.baselines import SimCLR
    from tests.helpers import quiet_trainer

    module = SimCLR(TorchvisionBackbone("googlenet"), hidden_dim=16, output_dim=8)
    before = [parameter.detach().clone() for parameter in module.backbone.parameters()]
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu")
    trainer.fit(module, tiny_simclr_data())
    assert trainer.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, module.backbone.parameters(), strict=True))


def test_maxvit_is_built_for_224_px_and_other_sizes_are_refused_before_training():
    """MaxViT's window and grid partitions fix its input size; it set no image_size, so 32-px data passed the start-up
    check and the first step failed in a reshape."""
    from hfmca_lightning.methods.baselines import SimCLR
    from tests.helpers import quiet_trainer

    backbone = TorchvisionBackbone("maxvit_t")
    assert backbone.image_size == 224
    with torch.no_grad():
        assert backbone.eval()(torch.rand(1, 3, 224, 224)).shape == (1, backbone.feature_dim)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu")
    with pytest.raises(ConfigurationError, match="gives 32-px images, but the backbone .* image_size=224"):
        trainer.fit(SimCLR(backbone, hidden_dim=16, output_dim=8), tiny_simclr_data())
    assert trainer.global_step == 0


def test_timm_resnet_blocks_have_torchvisions_window_geometry_and_are_analysed():
    """timm registers a block's `downsample` after conv2, and composing it too doubled a strided block's stride
    (layer2.0: (7, 4, 3) for (7, 2, 3)), so internal costs and the spectrum callback failed at the first step."""
    pytest.importorskip("timm")
    from hfmca_lightning.callbacks import EigenspectrumCallback
    from hfmca_lightning.methods.baselines import SimCLR
    from hfmca_lightning.methods.inspection import residual_blocks
    from tests.helpers import quiet_trainer

    timm_net, torchvision_net = TimmBackbone("resnet18"), TorchvisionBackbone("resnet18")
    blocks = residual_blocks(timm_net)
    assert blocks == residual_blocks(torchvision_net) and len(blocks) == 8
    internal, reference = InternalCosts(blocks), InternalCosts(blocks)
    internal.attach(timm_net)
    reference.attach(torchvision_net)
    assert [pair.geometry for pair in internal.pairs] == [pair.geometry for pair in reference.pairs]
    assert internal.pairs[2].geometry == WindowGeometry(7, 2, 3)  # net.layer2.0, stride 2
    spectrum = EigenspectrumCallback(every_n_steps=1, min_groups=1)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, accelerator="cpu", callbacks=[spectrum])
    trainer.fit(SimCLR(TimmBackbone("resnet18"), hidden_dim=16, output_dim=8), tiny_simclr_data())
    assert trainer.global_step == 1
    assert set(spectrum.history) == {"external"} | {f"internal/{name.removeprefix('net.')}" for name in blocks}
