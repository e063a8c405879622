"""Baselines that diverge stop with one line and keep their good checkpoints (hfmca_lightning.methods.update_guard),
as ``hfmca fit`` runs them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, checkpoint_tensors, run_hfmca, tiny_overrides

TINY_BACKBONE = {
    "class_path": "hfmca_lightning.models.SpectrumCNN",
    "init_args": {"channels": 6, "hidden_dim": 12, "noise_channels": 2},
}
# a diverging learning rate: the first update leaves weights of ~1e29, the next forward pass overflows
DIVERGING = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1e30}}


@pytest.mark.extended
@pytest.mark.integration
@pytest.mark.parametrize(
    ("config", "method"),
    [
        ("baselines/simclr_cifar10.yaml", {"hidden_dim": 12, "output_dim": 6}),
        ("baselines/byol_cifar10.yaml", {"hidden_dim": 12, "output_dim": 6}),
    ],
    ids=["SimCLR", "BYOL"],
)
def test_a_diverging_baseline_stops_in_one_line_and_every_checkpoint_on_disk_is_finite(
    config: str, method: dict, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    every_step = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {  # and Lightning's save when the run raises, which must not write the failed step's state
            "dirpath": str(checkpoints), "save_last": True, "every_n_train_steps": 1, "save_top_k": 1,
            "save_on_exception": True,
        },
    }  # fmt: skip
    overrides = tiny_overrides(
        tmp_path,
        model={"init_args": {"backbone": TINY_BACKBONE, **method, "optimizer": DIVERGING}},
        **{"trainer.callbacks": [every_step], "trainer.limit_val_batches": 0, "trainer.max_epochs": 3},
    )
    done = run_hfmca(tmp_path, "fit", "--config", str(REPO / "configs" / config), "--config", str(overrides))
    errors = [line for line in done.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert done.returncode == 1, done.stdout[-3000:]
    assert len(errors) == 1 and "Traceback" not in done.stdout, done.stdout[-3000:]
    stopped = re.search(
        r"training stopped at step (\d+), in epoch \d+ \(epoch=\d+ in checkpoint names\): \w+'s loss or gradients",
        errors[0],
    )
    assert stopped is not None, errors[0]
    files = sorted(checkpoints.glob("*.ckpt"))
    assert files, "no checkpoint was written before the failure"
    for path in files:
        tensors = {  # weights, buffers, optimiser state (ModelCheckpoint's kth_value is inf by design)
            key: value
            for key, value in checkpoint_tensors(path).items()
            if key.startswith(("/state_dict", "/optimizer_states")) and value.is_floating_point()
        }
        assert tensors and all(torch.isfinite(value).all() for value in tensors.values()), path.name
    # the last good checkpoint is the step before the failed one, and nothing was written after it
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == int(stopped.group(1))
    assert max(torch.load(path, weights_only=True)["global_step"] for path in files) == last["global_step"]


def test_the_guard_skips_a_non_finite_update_and_passes_large_finite_float16_gradients() -> None:
    """A float16 gradient of a million values of 100 has an overflowing 2-norm but is finite: its update is made. A
    NaN in the gradient skips the update (weights as they were) and the next read raises."""
    from hfmca_lightning.methods.update_guard import NonFiniteStepError, NonFiniteUpdateGuard

    weights = torch.nn.Parameter(torch.zeros(1_000_000, dtype=torch.float16))
    optimizer = torch.optim.SGD([weights], lr=1e-3)
    guard = NonFiniteUpdateGuard("Method")

    def step(gradient: torch.Tensor) -> None:
        weights.grad = gradient
        guard.add_loss(torch.tensor(1.0))
        guard.before_update(optimizer, step=0, epoch=0)
        optimizer.step()
        guard.after_update()

    step(torch.full_like(weights, 100.0))
    guard.raise_if_a_step_failed()
    assert bool((weights.float() - (-0.1)).abs().max() < 1e-3)  # the update was made (float16 rounding aside)
    before = weights.detach().clone()
    poisoned = torch.full_like(weights, 1.0)
    poisoned[7] = float("nan")
    step(poisoned)
    assert torch.equal(weights.detach(), before)
    with pytest.raises(
        NonFiniteStepError,
        match=r"training stopped at step 0, in epoch 1 \(epoch=0 in checkpoint names\): Method's loss or gradients",
    ):
        guard.raise_if_a_step_failed()
