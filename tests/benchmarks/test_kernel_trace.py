"""The roofline tracer (benchmarks/kernel_trace): its FLOPs against hand counts, its bytes against the tensor sizes,
the branches the code takes on the modelled GPU, the attribution of backward work to its forward phase, host syncs,
and the calibration fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_trace.calibrate import fit  # noqa: E402
from kernel_trace.gpus import GPUS, Calibration, GPUSpec  # noqa: E402
from kernel_trace.predict import operation_cost, predict  # noqa: E402
from kernel_trace.recorder import Operation  # noqa: E402
from kernel_trace.trace import Trace, modules_by_phase, tracing  # noqa: E402

from hfmca_lightning.losses import WindowGeometry, feature_map_statistics  # noqa: E402

H100 = GPUS["h100-sxm"]


def recorded(name: str, trace: Trace) -> list[Operation]:
    return [operation for operation in trace.operations if operation.name == name]


def test_convolution_flops_and_bytes_are_the_hand_counts() -> None:
    batch, channels_in, channels_out, size, kernel = 8, 16, 32, 12, 3
    with tracing(H100) as live:
        images = torch.randn(batch, channels_in, size, size, device="cuda")
        weight = torch.randn(channels_out, channels_in, kernel, kernel, device="cuda")
        with live.record() as trace:
            output = F.conv2d(images, weight, padding=1)
    (convolution,) = recorded("convolution", trace)
    assert output.shape == (batch, channels_out, size, size)
    # one multiply and one add per weight per output position
    assert convolution.flops == 2 * batch * channels_out * size * size * channels_in * kernel * kernel
    assert convolution.read == 4 * (images.numel() + weight.numel())
    assert convolution.written == 4 * output.numel()
    assert convolution.on_gpu and convolution.kernels == 1


def test_matrix_product_flops_bytes_and_rate_follow_dtype_and_tf32_setting() -> None:
    m, k, n = 64, 96, 40
    with tracing(H100) as live:
        a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
        with live.record() as trace:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            a @ b
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            a @ b
            a.bfloat16() @ b.bfloat16()
            torch.backends.cuda.matmul.fp32_precision = "ieee"
    exact, tf32, half = recorded("mm", trace)
    assert exact.flops == tf32.flops == half.flops == 2 * m * k * n
    assert exact.read == 4 * (m * k + k * n) and exact.written == 4 * m * n
    assert half.read == 2 * (m * k + k * n) and half.written == 2 * m * n
    assert (exact.rate, tf32.rate, half.rate) == ("fp32", "tf32_tensor", "bf16_tensor")


def test_products_with_a_float32_result_are_counted_from_their_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    """``out_dtype`` overloads (bf16 factors, float32 result) and the scalars of the accumulating forms: FLOPs from the
    factors' shapes alone, whatever torch's rule signatures take beside them (rules that take the factors and nothing
    else, as some torch versions' do, stand in for torch's here)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten

    def factors_only(*factors: torch.Tensor, out_val: object = None) -> int:
        *_, a, b = factors
        return 2 * a.shape[:-2].numel() * a.shape[-2] * a.shape[-1] * b.shape[-1]

    for packet in (aten.mm, aten.addmm, aten.baddbmm):
        monkeypatch.setitem(flop_registry, packet, factors_only)
    m, k, n = 48, 80, 24
    with tracing(H100) as live:
        a, b = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in ((m, k), (k, n)))
        accumulator = torch.zeros(m, n, device="cuda")
        with live.record() as trace:
            product = torch.mm(a, b, out_dtype=torch.float32)
            torch.addmm(accumulator, a.float(), b.float(), beta=0.5, alpha=2.0)
            torch.baddbmm(accumulator[None], a[None].float(), b[None].float(), beta=0.5)
            accumulated = torch.addmm(accumulator, a, b, out_dtype=torch.float32)
    assert product.dtype == accumulated.dtype == torch.float32
    (mm,), (addmm, accumulating), (baddbmm,) = (
        recorded("mm", trace),
        recorded("addmm", trace),
        recorded("baddbmm", trace),
    )
    assert mm.flops == addmm.flops == baddbmm.flops == accumulating.flops == 2 * m * k * n
    assert mm.read == 2 * (m * k + k * n) and mm.written == 4 * m * n and mm.rate == "bf16_tensor"
    # a float32 accumulator first, bf16 factors: bf16 tensor cores (it was rated at the CUDA cores' float32 rate)
    assert (accumulating.rate, accumulating.dtype) == ("bf16_tensor", "bfloat16") and addmm.rate != "bf16_tensor"


def test_cholesky_flops_are_n_cubed_over_three_per_matrix() -> None:
    with tracing(H100) as live:
        matrices = torch.randn(5, 48, 48, device="cuda", dtype=torch.float64)
        with live.record() as trace:
            torch.linalg.cholesky_ex(matrices)
    (factorisation,) = recorded("linalg_cholesky_ex", trace)
    assert factorisation.flops == pytest.approx(5 * 48**3 / 3)
    assert factorisation.rate == "fp64"
    assert factorisation.read == 8 * 5 * 48 * 48  # reads A; writes L (and the 5 int32 infos)
    assert factorisation.written == 8 * 5 * 48 * 48 + 4 * 5


def test_expanded_factors_are_read_once_and_views_launch_nothing() -> None:
    with tracing(H100) as live:
        shared = torch.randn(32, 32, device="cuda")
        batch = torch.randn(10, 32, 32, device="cuda")
        with live.record() as trace:
            view = batch.transpose(1, 2)[:, :4]
            torch.bmm(shared.expand(10, 32, 32), batch)
    assert view.shape == (10, 4, 32)
    (product,) = trace.operations  # the transpose and the slice are views: no kernel
    assert product.name == "bmm"
    assert product.read == 4 * (32 * 32 + 10 * 32 * 32)


def test_the_code_takes_the_branches_of_the_modelled_gpu() -> None:
    """tf32x3 statistics split their factors only on tensor-core GPUs (compute capability >= 8.0), and pool windows
    with avg_pool2d on CUDA; a Volta-class GPU takes the exact float32 branch."""
    volta = GPUSpec("V100", (7, 0), 32, 0.9e12, 125e12, 15.7e12, 15.7e12, 7.8e12, 7.8e12, 16e9, 80, "test")
    geometry = WindowGeometry(3, 1, 1)
    names = {}
    for gpu in (H100, volta):
        with tracing(gpu) as live:
            low = torch.randn(4, 16, 8, 8, device="cuda", requires_grad=True)
            high = torch.randn(4, 32, 8, 8, device="cuda", requires_grad=True)
            with live.record() as trace:
                stats = feature_map_statistics(low, high, geometry, precision="tf32x3")
                (stats.low_outer_sum.sum() + stats.cross_sum.sum()).backward()
        names[gpu.name] = {operation.name for operation in trace.operations}
        assert all(operation.on_gpu for operation in trace.operations)
    # the split rounds each float32 factor to TF32 with integer shifts and masks of its bits
    assert {"__rshift__", "avg_pool2d"} <= names[H100.name]
    assert "__rshift__" not in names["V100"] and "avg_pool2d" in names["V100"]


def test_bf16_statistics_take_each_backward_product_along_k_in_one_kernel() -> None:
    """``precision="bf16"`` on a tensor-core GPU: the backward's products over the maps' rows are ``H G3^T`` and
    ``dH = H (G2 + G2^T) + M G3`` each as one product along K (``2 K2`` and ``3 K1 + 2 K2``), and ``Z (G1 + G1^T)`` as
    two (its two parts), not the eight products with float32 results in between they were."""
    batch, k1, k2, size, geometry = 8, 16, 32, 8, WindowGeometry(3, 1, 1)
    with tracing(H100) as live:
        low = torch.randn(batch, k1, size, size, device="cuda").bfloat16().requires_grad_()
        high = torch.randn(batch, k2, size, size, device="cuda").bfloat16().requires_grad_()
        with live.record() as trace:
            stats = feature_map_statistics(low, high, geometry, precision="bf16")
            (stats.low_outer_sum.sum() + stats.high_outer_sum.sum() + stats.cross_sum.sum()).backward()
    rows = batch * size * size
    products = [
        op for op in trace.operations if op.backward and op.name in ("mm", "addmm", "bmm", "baddbmm") and op.flops
    ]
    along_k = sorted(round(op.flops / (2 * rows)) for op in products)  # K times the output's columns
    assert along_k == sorted([2 * k2 * k1, k1 * k1, k1 * k1, (3 * k1 + 2 * k2) * k2]), along_k
    assert all(op.rate == "bf16_tensor" for op in products), [(op.name, op.rate, op.dtype) for op in products]


def test_gradient_checks_take_the_multi_tensor_kernel_of_the_gpu() -> None:
    """torch takes its multi-tensor kernels for plain GPU tensors: the gradient check of a 76-tensor model is one
    ``_foreach_norm`` launch on the modelled GPU, as on the real one, not one norm kernel per gradient."""
    from hfmca_lightning.methods.deferred_checks import nonfinite_gradients

    with tracing(H100) as live:
        parameters = [torch.nn.Parameter(torch.randn(5, device="cuda")) for _ in range(76)]
        for parameter in parameters:
            parameter.grad = torch.randn(5, device="cuda")
        with live.record() as trace:
            nonfinite_gradients(torch.optim.SGD(parameters, lr=0.1))
    assert [op.kernels for op in recorded("_foreach_norm", trace)] == [1]
    assert len(recorded("linalg_vector_norm", trace)) == 1  # the largest of the per-tensor norms


def test_an_unfused_optimizer_takes_the_multi_tensor_kernels_of_the_gpu() -> None:
    """SGD with momentum, neither fused nor told foreach: one multi-tensor kernel per step of its update on the
    modelled GPU, as on the real one, not one kernel per parameter."""
    with tracing(H100) as live:
        parameters = [torch.nn.Parameter(torch.randn(5, device="cuda")) for _ in range(76)]
        optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
        for parameter in parameters:
            parameter.grad = torch.randn(5, device="cuda")
        optimizer.step()  # the first step makes the momentum buffers
        with live.record() as trace:
            optimizer.step()
    names = {operation.name for operation in trace.operations}
    assert names and all(name.startswith("_foreach_") for name in names), names
    assert sum(operation.kernels for operation in trace.operations) <= 3


def test_the_cost_librarys_cached_tensors_do_not_cross_a_trace() -> None:
    """The window constants and counts are cached per shape and device: each trace makes its own (a fake tensor of an
    earlier trace cannot enter another's), so the same statistics traced twice record the same kernels."""
    geometry = WindowGeometry(3, 2, 1)
    names = []
    for _ in range(2):
        with tracing(H100) as live, live.record() as trace:
            low, high = torch.rand(2, 4, 9, 9, device="cuda"), torch.rand(2, 6, 5, 5, device="cuda")
            feature_map_statistics(low, high, geometry)
        names.append([operation.name for operation in trace.operations])
    assert "avg_pool2d" in names[0] and names[1] == names[0]


def test_backward_work_is_attributed_to_its_forward_phase_and_source() -> None:
    from hfmca_lightning.losses import HFMCACost
    from hfmca_lightning.methods import HFMCAModule, InternalCosts
    from hfmca_lightning.models import GridExternalHead, SmallConvNet

    with tracing(H100) as live:
        backbone = SmallConvNet(width=8, num_stages=2)
        module = HFMCAModule(
            backbone,
            external_head=GridExternalHead(16, 2, 2, 12),
            external_cost=HFMCACost(reg=0.1, name="external"),
            internal_costs=InternalCosts(backbone.internal_layers),
        )
        module = module.to("cuda").train()
        live.phases.modules.update(modules_by_phase(module, {"backbone": "backbone", "external_head": "external"}))
        views = torch.randn(4, 4, 3, 16, 16, device="cuda")
        with live.record() as trace:
            module.objective(module.collect(views), check=False).total.backward()
    phases = {operation.phase for operation in trace.operations}
    assert {"backbone", "external", "cost path"} <= phases
    assert any(phase.startswith("internal/") for phase in phases)
    backward_convolutions = [op for op in trace.operations if op.name == "convolution_backward"]
    by_model = {op.source.split(":")[0]: op.phase for op in backward_convolutions}
    assert by_model == {
        "hfmca_lightning/models/backbones.py": "backbone",
        "hfmca_lightning/models/heads.py": "external",
    }
    assert all(op.backward and op.source.endswith("(backward)") for op in backward_convolutions)
    internal_backward = [op for op in trace.operations if op.backward and op.phase.startswith("internal/")]
    assert any("hfmca_lightning/losses/" in op.source for op in internal_backward)
    assert not [op for op in trace.operations if op.phase == "backward (untraced)"]


def test_host_reads_are_host_syncs_and_asynchronous_copies_are_not() -> None:
    with tracing(H100) as live:
        value = torch.randn(3, device="cuda")
        pinned = torch.empty(3, pin_memory=True)
        with live.record() as trace:
            value.sum().item()
            pinned.copy_(value, non_blocking=True)
            value.cpu()
    assert [what for what, _ in trace.host_syncs] == [
        "aten._local_scalar_dense (a device value read on the host)",
        "aten._to_copy to the host",
    ]
    copies = [operation for operation in trace.operations if operation.transfer == "device->host"]
    assert len(copies) == 2


def test_copies_to_the_device_without_non_blocking_are_host_syncs() -> None:
    """CUDA copies a host tensor without ``non_blocking`` and then waits for the whole stream (``memcpy_and_sync``):
    ``torch.tensor(value, device=...)``, ``.to(device)`` and ``copy_`` are host syncs; the non-blocking forms and
    values made on the device are not."""
    with tracing(H100) as live:
        on_device = torch.zeros(3, device="cuda")
        with live.record() as trace:
            torch.tensor(2.0, device="cuda")
            torch.ones(3).to("cuda")
            on_device.copy_(torch.ones(3))
            torch.ones(3).pin_memory().to("cuda", non_blocking=True)
            on_device.copy_(torch.ones(3).pin_memory(), non_blocking=True)
            torch.full((), 2.0, device="cuda")
            torch.ops.aten.copy.default(on_device, torch.ones(3), True)  # the functional form (compiled code)
            torch.ops.aten.copy.default(on_device, torch.ones(3))
            torch.ops.aten.copy.default(torch.empty(3).pin_memory(), on_device, True)
    assert [what.split(" to the device")[0] for what, _ in trace.host_syncs] == [
        "aten._to_copy",
        "aten._to_copy",
        "aten.copy_",
        "aten.copy",
    ]


def test_work_cuda_does_inside_an_operation_is_counted() -> None:
    """What CUDA's implementations launch inside one ATen operation: the cast of a reduction to a wider dtype, the
    copy of an out-of-place ``addmm``'s accumulator (none in place), batch norm's statistics pass in training and its
    backward's reduction on channels-last maps."""
    n = 1 << 16
    with tracing(H100) as live:
        x = torch.randn(64, n // 64, device="cuda")
        a, b = (torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        accumulator = torch.zeros(256, 256, device="cuda")
        maps = torch.randn(8, 16, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
        maps.requires_grad_()
        norm = torch.nn.BatchNorm2d(16).to("cuda")
        with live.record() as trace:
            x.sum(dim=0, dtype=torch.float64)
            torch.addmm(accumulator, a, b, out_dtype=torch.float32)
            torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
            norm(maps).square().sum().backward()  # a gradient of the map's size
    (total,) = recorded("sum", trace)[:1]
    assert (total.kernels, total.read, total.written) == (2, 4 * n + 8 * n, 8 * n + 8 * (n // 64))
    copied, in_place = recorded("addmm", trace)
    factors, result = 2 * 2 * 256 * 256, 4 * 256 * 256
    assert (copied.kernels, copied.read, copied.written) == (2, factors + 2 * result, 2 * result)
    assert (in_place.kernels, in_place.read, in_place.written) == (1, factors + result, result)
    (forward,), (backward,) = recorded("native_batch_norm", trace), recorded("native_batch_norm_backward", trace)
    map_bytes = 4 * maps.numel()
    assert forward.kernels == 2 and forward.read >= 2 * map_bytes
    assert backward.kernels == 2 and backward.read >= 4 * map_bytes


def test_in_place_updates_write_what_they_update_and_metadata_launches_nothing() -> None:
    """A fused optimizer step returns nothing but writes the weights and momenta; ``as_strided_`` (which
    ``adaptive_avg_pool2d`` calls on channels-last maps) only changes metadata; a tensor given twice is read once; a
    convolution's backward launches one kernel per gradient asked for."""
    with tracing(H100) as live:
        weights = [torch.nn.Parameter(torch.randn(1000, device="cuda")) for _ in range(3)]
        for weight in weights:
            weight.grad = torch.randn_like(weight)
        optimizer = torch.optim.SGD(weights, lr=0.1, momentum=0.9, fused=True)
        optimizer.step()  # the momentum buffers exist from here
        z = torch.randn(4, 32, 16, device="cuda")
        images = torch.randn(2, 3, 8, 8, device="cuda")
        conv = torch.nn.Conv2d(3, 4, 3).to("cuda")
        with live.record() as trace:
            optimizer.step()
            torch.randn(2, 3, 4, 4, device="cuda").as_strided_((2, 3, 16), (48, 16, 1))
            torch.bmm(z.mT, z)
            conv(images).sum().backward()  # the images need no gradient: the weight's alone
    (update,) = [op for op in trace.operations if op.name.startswith("_fused_sgd")]
    assert update.written == 2 * 3 * 4 * 1000  # weights and momenta
    assert not recorded("as_strided_", trace)
    (gram,) = recorded("bmm", trace)
    assert gram.read == 4 * z.numel()
    (gradients,) = recorded("convolution_backward", trace)
    assert gradients.kernels == 1


def test_a_training_steps_own_work_is_not_the_optimizers() -> None:
    """Lightning runs ``training_step`` inside ``optimizer.step``: its logging and checks are a phase of their own,
    not the optimizer's update (which the backbone step of the targets counts)."""
    from kernel_trace.recorder import Phases

    def phase() -> str:  # as the recorder asks, two frames below the operation's caller
        return Phases().current()[0]

    def operation() -> str:
        return phase()

    def training_step() -> str:
        return operation()

    def step(closure):  # noqa: ANN001, ANN202  # in a file under torch/optim, as an optimizer's step
        return closure()

    step.__code__ = step.__code__.replace(co_filename="/site-packages/torch/optim/sgd.py")
    assert step(training_step) == "logging and checks"
    assert step(operation) == "optimizer"


def test_health_statistics_of_device_features_wait_for_nothing() -> None:
    from hfmca_lightning.analysis.health import HealthStatistics

    with tracing(H100) as live:
        embeddings = torch.randn(64, 9, 32, device="cuda")
        with live.record() as trace:
            HealthStatistics.of(embeddings)
    assert trace.host_syncs == []


def test_prediction_is_the_larger_of_compute_and_memory_plus_the_floor() -> None:
    calibration = Calibration(efficiency=0.5, launch_floor=5e-6, fitted_on="test")
    compute_bound = Operation("mm", "p", "s", False, 1, 1e12, 1_000, 1_000, "bfloat16", "bf16_tensor", True)
    memory_bound = Operation("add", "p", "s", False, 2, 1e6, 10**9, 10**9, "float32", "fp32", True)
    assert operation_cost(compute_bound, H100, calibration) == pytest.approx(5e-6 + 1e12 / (0.5 * H100.bf16_tensor))
    assert operation_cost(memory_bound, H100, calibration) == pytest.approx(2 * 5e-6 + 2e9 / (0.5 * H100.bandwidth))
    trace = Trace(H100, [compute_bound, memory_bound])
    assert predict(trace, calibration).totals.kernels == 3


def test_the_fit_recovers_constants_that_made_the_rows() -> None:
    efficiency, floor = 0.4, 12e-6
    rows = {
        f"row {i}": (work, kernels, kernels * floor + work / efficiency)
        for i, (work, kernels) in enumerate([(4e-3, 200), (5e-3, 400), (12e-3, 1300), (3e-3, 900)])
    }
    fitted_efficiency, fitted_floor = fit(rows)
    assert fitted_efficiency == pytest.approx(efficiency, rel=1e-9)
    assert fitted_floor == pytest.approx(floor, rel=1e-9)


def test_the_fit_holds_the_efficiency_at_the_peak_rates() -> None:
    """Rows faster than the peak rates allow (an efficiency of 1.2) fit the peak rates and the floor alone."""
    rows = {
        f"row {i}": (work, kernels, kernels * 10e-6 + work / 1.2)
        for i, (work, kernels) in enumerate([(4e-3, 200), (5e-3, 400), (12e-3, 1300)])
    }
    efficiency, floor = fit(rows)
    assert efficiency == 1.0 and 0 < floor < 10e-6  # the work at the peak rates takes longer: a shorter floor


def test_the_fit_refuses_rows_that_cannot_give_two_constants() -> None:
    with pytest.raises(ValueError, match="at least two measured step rows; got 1"):
        fit({"only": (1e-3, 100, 2e-3)})
    # rows whose kernels and work are in one proportion cannot tell a floor from the work: the work alone
    efficiency, floor = fit({"a": (1e-3, 100, 4e-3), "b": (2e-3, 200, 8e-3)})
    assert (efficiency, floor) == (pytest.approx(0.25), 0.0)
