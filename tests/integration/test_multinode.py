"""Multi-node DDP is Lightning's: two processes launched as two nodes of one process each (NODE_RANK 0 and 1,
MASTER_ADDR / MASTER_PORT on loopback, gloo) train a few steps and end with the weights of one process that
saw the doubled batch; and ``hfmca fit`` run as docs/resume.md says, the same command on each node, writes one run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    DEMO,
    DISTRIBUTED_ENVIRONMENT,
    HFMCA,
    PER_RANK_BATCH,
    bn_free_module,
    ddp_data,
    ddp_trainer,
    tiny_overrides,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

NODE = """
import sys
import torch
from lightning.pytorch import Trainer
from tests.helpers import PER_RANK_BATCH, ReleaseProcessGroup, bn_free_module, ddp_data

module = bn_free_module()
trainer = Trainer(
    accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_epochs=1, limit_train_batches=int(sys.argv[2]),
    limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[ReleaseProcessGroup()],  # else gloo's threads may abort the exit
)
trainer.fit(module, ddp_data(PER_RANK_BATCH))
if trainer.global_rank == 0:
    torch.save(module.state_dict(), sys.argv[1])
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_as_two_nodes(command: list[str], cwd: Path) -> list[str]:
    """``command`` run twice at once as the two nodes of one job (NODE_RANK 0 and 1, the rendezvous on loopback), as
    a launcher starts it on each machine; both must end with status 0. Their outputs."""
    port = str(free_port())
    base = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENVIRONMENT}
    nodes = [
        subprocess.Popen(
            command,
            env={
                **base,
                "PYTHONPATH": str(REPO),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "NODE_RANK": str(rank),
            },
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    return outputs


def test_two_nodes_of_one_process_equal_one_process_with_the_doubled_batch(tmp_path):
    single = bn_free_module()
    ddp_trainer(1, max_epochs=1, limit_train_batches=STEPS, limit_val_batches=0).fit(
        single, ddp_data(2 * PER_RANK_BATCH)
    )

    outputs = run_as_two_nodes([sys.executable, "-c", NODE, str(tmp_path / "node0.pt"), str(STEPS)], tmp_path)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1], outputs[1][-2000:]

    two_nodes = torch.load(tmp_path / "node0.pt", weights_only=True)
    untrained = bn_free_module().state_dict()
    assert any(not torch.equal(value, untrained[key]) for key, value in single.state_dict().items()), "nothing trained"
    for key, value in single.state_dict().items():
        # as tests/integration/test_ddp.py: float32 gradient sums split over two processes, over 3 SGD steps
        torch.testing.assert_close(two_nodes[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.extended
def test_hfmca_fit_as_the_same_command_on_two_nodes_writes_one_run(tmp_path):
    """docs/resume.md's "Several machines": every node runs the same ``hfmca fit`` with ``--trainer.num_nodes`` and the
    rendezvous in its environment, the run folder shared (a cluster's file system): both end with status 0, the
    second as the run's second member, and the run's checkpoints are one run's (32 images, 8 per process and step:
    2 steps)."""
    overrides = tiny_overrides(tmp_path / "run")
    command = [str(HFMCA), "fit", "--config", str(DEMO), "--config", str(overrides), "--trainer.num_nodes", "2",
               "--trainer.devices", "1", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]  # fmt: skip
    outputs = run_as_two_nodes(command, tmp_path)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1], outputs[1][-2000:]
    checkpoints = sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=2.ckpt", "last.ckpt"], checkpoints
