"""``python benchmarks/gpu_check`` (``make gpu-check``): see the package's docstring."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

from gpu_check.cli import main  # noqa: E402

sys.exit(main())
