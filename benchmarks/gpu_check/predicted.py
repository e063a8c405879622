"""The roofline's predictions of the step rows, to print beside the measured ones (``benchmarks/roofline.py --rows``,
in a subprocess: the tracer patches ``torch.cuda`` while it runs, which no measurement may see)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kernel_trace.gpus import gpu_key

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["gpu_key", "predicted_rows"]


def predicted_rows(gpu: str, sizes: dict[str, object], timeout: float = 300.0) -> dict[str, float]:
    """Predicted milliseconds per step of each step row on ``gpu`` at ``sizes`` (backbone, batch_size, views,
    image_size)."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "rows.json"
        arguments = [f"--{key.replace('_', '-')}={value}" for key, value in sizes.items()]
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "roofline.py"), "--rows", "--gpu", gpu, *arguments,
             "--json", str(output)],
            cwd=ROOT, check=True, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        return {label: float(ms) for label, ms in json.loads(output.read_text()).items()}
