"""Where the time of the internal costs goes: the training step with and without them, and inside it the
statistics (forward and backward, by block input shape) and the cost factorisations, in one run.

    python benchmarks/internal_cost_breakdown.py                 # ResNet-18, 8 images x 9 views, CPU
    python benchmarks/internal_cost_breakdown.py --channels-last --steps 12   # HFMCAModule(channels_last=True)
    python benchmarks/internal_cost_breakdown.py --device cuda --batch-size 64

The two steps (backbone alone; external + internal costs on every BasicBlock, as in benchmarks/throughput.py)
are timed in interleaved rounds (medians). The parts are read from one profiled internal step: the CPU time
of the statistics' autograd nodes (`_PerImageStatistics`, `_CentredRowStatistics`, `_ChannelsLastStatistics`
and their backward nodes) and of the labelled `hfmca_costs` range (every cost of the step, batched), each as a
fraction of the backbone step. On CUDA the profile's CPU times are launch times, so the parts are printed only
on CPUs. Last, the arithmetic of both
steps (matrix products and convolutions, forward and backward, counted by torch's `FlopCounterMode`; the
float64 factorisations are not counted) and the rate each part runs at: the internal costs' share of the
arithmetic is the ratio they would reach at the backbone's rate.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from step_timing import add_malloc_option, format_rows, measure_rows, set_malloc  # noqa: E402
from throughput import build, training_step  # noqa: E402

STATISTICS_NODES = ("PerImageStatistics", "CentredRowStatistics", "ChannelsLastStatistics", "Bfloat16Statistics")


def profiled_parts(step: Callable[[], None]) -> dict[str, float]:
    """Seconds of one profiled step in each part: statistics forward / backward by input shape, factorisations."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        step()
    parts: dict[str, float] = defaultdict(float)
    for event in profiler.key_averages(group_by_input_shape=True):
        seconds = event.cpu_time_total / 1e6
        if event.key in STATISTICS_NODES:
            shape = event.input_shapes[0][1:] if event.input_shapes and event.input_shapes[0] else ["?"]
            parts[f"statistics forward, input {tuple(shape)}"] += seconds
        elif event.key in tuple(f"{node}Backward" for node in STATISTICS_NODES):
            parts["statistics backward (all blocks)"] += seconds
        elif event.key == "hfmca_costs":
            parts["cost factorisations and gradients (every cost)"] += seconds
    return dict(parts)


def _taking_tensors(formula: Callable[..., int]) -> Callable[..., int]:
    """A registered flop formula (which takes the tensors and reads their shapes) marked so that
    ``FlopCounterMode`` does not wrap it a second time."""

    def counted(*args: object, **kwargs: object) -> int:
        return formula(*args, **kwargs)

    counted._get_raw = True  # type: ignore[attr-defined]
    return counted


def matrix_product_flops(step: Callable[[], None]) -> float:
    """Floating-point operations of one call of ``step`` in matrix products and convolutions, as torch's
    ``FlopCounterMode`` counts them, with the in-place products (``addmm_``, ``baddbmm_``) it leaves out by default."""
    aten = torch.ops.aten
    in_place = {
        aten.addmm_: _taking_tensors(flop_registry[aten.addmm]),
        aten.baddbmm_: _taking_tensors(flop_registry[aten.baddbmm]),
    }
    with FlopCounterMode(display=False, custom_mapping=in_place) as counter:
        step()
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", choices=["resnet18", "resnet50", "small"], default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--views", type=int, default=9, choices=[4, 9, 16])
    parser.add_argument("--steps", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--channels-last", action="store_true", help="both steps with HFMCAModule(channels_last=True)")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = set_malloc(args)
    device = torch.device(args.device)
    views = torch.randn(args.batch_size, args.views, 3, 32, 32, device=device)
    layout = {"channels_last": args.channels_last}
    internal = partial(
        training_step, build(args.backbone, args.views, True, **layout).to(device).train(), views, True, nullcontext()
    )
    rows = [
        (
            "step: backbone fwd/bwd alone",
            partial(
                training_step,
                build(args.backbone, args.views, False, **layout).to(device).train(),
                views,
                False,
                nullcontext(),
            ),
        ),
        ("step: HFMCA external + internal", internal),
    ]
    measured = measure_rows(rows, args.steps, device)
    print(
        f"device: {device}; backbone {args.backbone}; {args.batch_size} images x {args.views} views; {malloc}"
        + ("; channels-last" if args.channels_last else "")
    )
    print("\n".join(format_rows(measured, args.batch_size * args.views)))
    if device.type != "cpu" or measured[0].seconds is None or measured[1].seconds is None:
        return
    backbone, internal_seconds = measured[0].seconds, measured[1].seconds
    print("parts of one profiled internal step (CPU time, fraction of the backbone step):")
    for label, seconds in profiled_parts(internal()).items():
        print(f"  {label:58s} {seconds * 1000:9.1f} ms   {seconds / backbone:6.3f}")
    backbone_flops, internal_flops = (matrix_product_flops(factory()) for _, factory in rows)
    extra_flops, extra_seconds = internal_flops - backbone_flops, internal_seconds - backbone
    print("arithmetic of one step (matrix products and convolutions, forward + backward; factorisations not counted):")
    print(
        f"  backbone step                         {backbone_flops / 1e9:7.1f} GFLOP   "
        f"{backbone_flops / backbone / 1e9:6.1f} GFLOP/s"
    )
    rate = (
        f"{extra_flops / extra_seconds / 1e9:6.1f} GFLOP/s"
        if extra_seconds > 0
        else "rate n/a (the step was not slower than the backbone step)"
    )
    print(
        f"  added by the internal costs           {extra_flops / 1e9:7.1f} GFLOP   {rate}  "
        f"(x {1 + extra_flops / backbone_flops:.2f} the backbone's arithmetic; the step measured x "
        f"{internal_seconds / backbone:.2f})"
    )


if __name__ == "__main__":
    main()
