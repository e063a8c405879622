"""One command that measures a GPU: ``make gpu-check`` (``python benchmarks/gpu_check``).

Writes ``docs/benchmarks/gpu-<device>.md``, section by section, in this order (a time budget cuts the last first):

1. ``tests``: the ``cuda`` tests (``python -m pytest -m cuda tests/cuda``, in a subprocess): passed / failed / skipped
   and the first failures (without CUDA all are skipped, which is reported, not a failure);
2. ``steps``: training steps at 64 images x 9 views in bf16 (ResNet-18, CIFAR-sized views; forward, backward and the
   fused-SGD update guarded by the step's checks): the backbone alone, the HFMCA external cost, external + internal
   costs on all 8 BasicBlocks, each plain and channels-last; and the external channels-last step with its views drawn
   on the device inside the step (``ResidentDrawer``, ``BatchedDrawer`` on the device) against the
   same step on views drawn beforehand. Per row: views/s, time relative to the fastest backbone row of the run, the
   memory the step allocates, host synchronisations per step (on CUDA counted by CUDA's sync debug mode, on the CPU
   the device values read on the host), kernels launched and the fraction of the step the GPU is busy, and beside
   each row the roofline's prediction for this GPU (``benchmarks/roofline.py --rows``, in a subprocess);
3. ``compiled``: the same with the backbone compiled, and with the cost path compiled (``compile_costs``, CUDA
   graphs on CUDA), with the graphs compiled, recompilations and CUDA-graph skips of each row;
4. ``precision``: bf16-vs-float32 agreement of every cost, and fast, tf32x3 and auto (bf16 autocast) vs float64
   internal statistics (costs and backbone gradients);
5. ``data``: every data path (CPU workers: torchvision per view, batched per batch; uint8 batches drawn on the
   device by the batched drawer; the training set on the device, one or 8 batches per call);
6. ``training``: epochs of HFMCA-SS(*) and of HFMCA-SS (internal costs on the 8 BasicBlocks) on a CIFAR-sized
   SyntheticShapes set (50k images) on the fastest data path, training and validation (kNN) seconds apart, and the
   training seconds of one 50,000-image epoch;
7. ``profile``: kernel tables of the external and internal steps (to the log only).

and the targets (bf16, 64 x 9 views of 32 px, channels-last), each marked met, not met or not measured.

Without CUDA it says so and exits with status 2: it never silently measures the CPU. ``--device cpu --tiny`` runs
every section at tiny sizes to test the script. Needs torch, torchvision, lightning, numpy and pytest; never
jsonargparse, wandb or lightly.
"""

from gpu_check.report import device_slug, write_report
from gpu_check.results import (
    BEFOREHAND,
    AgreementRow,
    CudaTests,
    GpuCheckResult,
    Target,
    TrainingRun,
    targets,
)
from gpu_check.sections import parse_pytest

__all__ = [
    "BEFOREHAND",
    "AgreementRow",
    "CudaTests",
    "GpuCheckResult",
    "Target",
    "TrainingRun",
    "device_slug",
    "parse_pytest",
    "targets",
    "write_report",
]
