"""The host-read recorder sees every way a value reaches the host, on the CPU as a GPU would show it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from hfmca_lightning.diagnostics import HostReads, OperationCounts, host_buffer

VALUES = torch.arange(6.0)  # sum 15


@pytest.mark.parametrize(
    ("read", "expected"),
    [
        (lambda t: t[t > 1], "aten.index.Tensor (boolean mask: nonzero)"),
        (lambda t: t.clone().__setitem__(t > 3, 0.0), "aten.index_put_.default (boolean mask: nonzero)"),
        (lambda t: t.tolist(), "Tensor.tolist"),
        (lambda t: t.numpy(), "Tensor.numpy"),
        (lambda t: t.cpu(), "Tensor.cpu"),
        (lambda t: np.asarray(t), "Tensor.__array__"),
        (lambda t: t[2].item(), "aten._local_scalar_dense.default"),
        (lambda t: bool(t[2] > 0), "aten._local_scalar_dense.default"),
        (lambda t: float(t.sum()), "aten._local_scalar_dense.default"),
        (lambda t: torch.where(t > 1), "aten.nonzero.default"),
        (lambda t: t.nonzero(), "aten.nonzero.default"),
        (lambda t: torch.masked_select(t, t > 1), "aten.masked_select.default"),
        (lambda t: torch.unique(t), "aten._unique2.default"),
        (lambda t: torch.equal(t, t), "aten.equal.default"),
        (lambda t: t.repeat_interleave(t.long()), "aten.repeat_interleave.Tensor (repeats from a tensor)"),
    ],
    ids=[
        "boolean-mask indexing",
        "boolean-mask assignment",
        "tolist",
        "numpy",
        "cpu",
        "numpy.asarray",
        "item",
        "bool",
        "float",
        "where(condition)",
        "nonzero",
        "masked_select",
        "unique",
        "equal",
        "repeat_interleave",
    ],
)
def test_each_kind_of_host_read_is_counted_once(read, expected):
    with HostReads() as recorder:
        read(VALUES)
    assert recorder.reads == [expected]


def test_numpy_sees_the_recorded_array_method_as_torch_s_own():
    """numpy 2 calls ``__array__`` with ``copy=`` first and again without it when that fails: the recorder counts
    the one call that converts, and numpy warns as it does without the recorder (not twice, no new warning)."""

    def warnings_of(convert):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = convert()
        return result, sorted(str(w.message) for w in caught)

    expected, expected_warnings = warnings_of(lambda: np.array(VALUES, dtype=np.float32))
    with HostReads() as recorder:
        converted, recorded_warnings = warnings_of(lambda: np.array(VALUES, dtype=np.float32))
    assert recorder.reads == ["Tensor.__array__"]
    assert recorded_warnings == expected_warnings
    np.testing.assert_array_equal(converted, expected)
    assert converted.dtype == np.float32


def test_device_work_and_dtype_casts_are_not_host_reads():
    with HostReads() as recorder:
        x = VALUES.to(torch.float64) * 2
        torch.where(x > 1, x, torch.zeros_like(x)).sum().to(VALUES)
        x.masked_fill(x > 3, 0.0)
        x.to(VALUES.device)  # a CPU tensor to the CPU: no transfer
        x.repeat_interleave(2)  # repeats a Python number: the size is known
        VALUES.long().repeat_interleave(VALUES.long(), output_size=15)  # the output's size given
    assert recorder.reads == []


def test_host_buffers_filled_by_an_asynchronous_copy_are_not_counted():
    buffer = host_buffer(torch.zeros(3))
    with HostReads() as recorder:
        buffer.tolist()
        buffer[0].item()
        VALUES.tolist()
    assert recorder.reads == ["Tensor.tolist"]


def test_recorders_nest_and_restore_the_tensor_methods():
    plain = torch.Tensor.tolist
    with HostReads() as outer:
        VALUES.tolist()
        with HostReads() as inner:
            VALUES.cpu()
    assert outer.reads == ["Tensor.tolist", "Tensor.cpu"] and inner.reads == ["Tensor.cpu"]
    assert torch.Tensor.tolist is plain


def test_the_backward_pass_is_recorded():
    """A read inside a custom backward pass is counted (dispatch modes travel with the backward pass)."""

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            grad.sum().item()
            return grad * 2

    x = VALUES.clone().requires_grad_()
    with HostReads() as recorder:
        ReadsInBackward.apply(x).sum().backward()
    assert recorder.reads == ["aten._local_scalar_dense.default"]


def test_operation_counts_count_the_given_operations():
    with OperationCounts(torch.ops.aten.mm) as counts:
        torch.ones(2, 2) @ torch.ones(2, 2)
        torch.ones(2) + 1
    assert counts.count == 1
