"""The ImageNet-scale config as a user runs it: `hfmca fit --config configs/imagenet100_ss.yaml` on a tiny tree of
full-size JPEGs laid out as ImageNet (the 100 class folders of the shipped class list), ResNet-50 at 224 px,
one fast_dev_run step on the CPU; and the same with a timm ViT backbone (external cost only)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, run_hfmca, write_jpeg_tree

IMAGENET100 = REPO / "configs" / "imagenet100_ss.yaml"
CLASSES = [
    line
    for line in (REPO / "configs" / "imagenet100_classes.txt").read_text().splitlines()
    if line and not line.startswith("#")
]


@pytest.fixture(scope="module")
def imagenet_tree(tmp_path_factory):
    return write_jpeg_tree(tmp_path_factory.mktemp("imagenet") / "imagenet", CLASSES, per_class=1)


def fast_dev_run(tmp_path, tree, *extra: str):
    args = [
        "fit",
        "--config",
        str(IMAGENET100),
        "--data.init_args.source.init_args.root",
        str(tree),
        "--data.init_args.source.init_args.class_list",
        str(REPO / "configs" / "imagenet100_classes.txt"),
        "--trainer.fast_dev_run",
        "1",
        "--trainer.accelerator",
        "cpu",
        "--data.init_args.batch_size",
        "2",
        "--data.init_args.eval_batch_size",
        "4",
        "--data.init_args.num_workers",
        "1",
        *extra,
    ]
    return run_hfmca(tmp_path, *args, timeout=300)


@pytest.mark.extended
def test_imagenet100_config_trains_a_resnet50_step_on_224px_jpegs(tmp_path, imagenet_tree):
    assert len(CLASSES) == 100
    result = fast_dev_run(tmp_path, imagenet_tree)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "TorchvisionBackbone" in result.stdout and "23.5 M" in result.stdout  # ResNet-50 without its fc
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in result.stdout


@pytest.mark.slow  # the ResNet-50 step above covers the config's data path in CI (make test-extended)
def test_imagenet100_config_with_a_timm_vit_and_the_external_cost_only(tmp_path, imagenet_tree):
    pytest.importorskip("timm")
    result = fast_dev_run(
        tmp_path,
        imagenet_tree,
        "--model.init_args.backbone",
        "hfmca_lightning.models.TimmBackbone",
        "--model.init_args.backbone.init_args.name",
        "vit_tiny_patch16_224",
        "--model.init_args.projector.init_args.input_dim",
        "192",
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "TimmBackbone" in result.stdout and "`Trainer.fit` stopped: `max_steps=1` reached." in result.stdout
