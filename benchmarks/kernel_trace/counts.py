"""What one ATen operation costs a GPU: kernels, FLOPs, bytes read and written, and the rate its arithmetic runs at.

FLOPs: :data:`torch.utils.flop_counter.flop_registry` where it has a rule (matrix products, convolutions and their
backward, attention); the linear algebra counted here (Cholesky ``n^3 / 3`` per matrix, triangular solves ``n^2 m``,
and so on); one FLOP per output element for elementwise work and per input element for reductions. Bytes: every
tensor argument read once and every result written once, each as the elements its strides reach (an expanded matrix
is read once, not once per batch entry); in-place operations read and write their first argument, except those that
only write it (``copy_``, ``fill_``, ``zero_``, random fills), and those that return nothing (fused optimizers,
multi-tensor updates) write every argument their schema marks as written; one tensor given twice (``Z^T Z`` as
``bmm(z.mT, z)``) is read once; arguments that only give a shape (the input of ``avg_pool2d_backward``, of
``zeros_like``) are not read. Views, metadata and allocations launch nothing.

Work that CUDA's implementation of an operation does inside it, as kernels of its own (:func:`hidden_work`): a
reduction to a wider dtype than its input's first casts the input (``sum(x, dtype=float64)`` of float32 ``x``); an
out-of-place ``addmm`` / ``baddbmm`` with a full accumulator first copies it into the result; batch norm in training
takes a statistics pass before its elementwise pass (the input read twice), and its backward reads both its inputs
twice (on channels-last maps in a reduction before its elementwise pass); a convolution's backward launches a kernel
per gradient it is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Operations that launch no kernel: allocations, metadata, views that the schema does not mark as views.
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._unsafe_view.default,
    aten._reshape_alias.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
    aten.resize_.default,
    aten.record_stream.default,
    aten.is_pinned.default,
    aten._pin_memory.default,
    aten.is_same_size.default,
    aten.is_nonzero.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
}
WRITE_ONLY = {
    "copy_",
    "fill_",
    "zero_",
    "normal_",
    "uniform_",
    "random_",
    "bernoulli_",
    "exponential_",
    "_foreach_copy_",
}
# Arguments whose values an operation never reads, only their shape: (operation, position).
SHAPE_ONLY = {
    ("avg_pool2d_backward", 1), ("avg_pool3d_backward", 1), ("new_zeros", 0), ("new_ones", 0), ("new_full", 0),
    ("zeros_like", 0), ("ones_like", 0), ("full_like", 0), ("empty_like", 0),
}  # fmt: skip
MATRIX_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addmv", "mv", "dot", "vdot", "addr", "_int_mm"}
CONVOLUTIONS = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution"}
# Operations that launch more than one kernel (cuSOLVER's factorisation and check; the multi-tensor kernels of fused
# optimizers per ~110 tensors below, a convolution's backward per gradient in kernels()).
EXTRA_KERNELS = {"linalg_cholesky_ex": 1, "_linalg_eigh": 3, "linalg_lu_factor_ex": 1}
MULTI_TENSOR_CHUNK = 110
# Allocations the list above does not name (in-place views, metadata only, carry torch's inplace_view tag).
NO_KERNEL_NAMES = {"empty_permuted"}
# Products that add to an accumulator given first (addmm(C, A, B)): they compute in their factors' dtype, which an
# ``out_dtype`` overload (bf16 factors, a float32 accumulator) does not share with the accumulator.
ACCUMULATING_PRODUCTS = {"addmm", "baddbmm", "addmv", "addr", "addbmm"}
REDUCTIONS = {"sum", "mean", "prod", "nansum"}


def tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    flat, _ = tree_flatten(list(values))
    return [value for value in flat if isinstance(value, torch.Tensor)]


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor's strides reach (broadcast dimensions once)."""
    if tensor.numel() == 0:
        return 0
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def transposed_layouts(func: torch._ops.OpOverload, args: tuple[Any, ...], out: Any) -> list[torch.Tensor]:
    """The activations cuDNN transposes for a convolution on NCHW tensors: its tensor-core kernels take NHWC
    (channels-last), so 16-bit NCHW inputs and outputs are copied to NHWC and back ("Tensor Layouts In Memory",
    NVIDIA Deep Learning Performance guide, https://docs.nvidia.com/deeplearning/performance/dl-performance-convolutional/).
    Empty for channels-last tensors, 32-bit ones and everything that is not a convolution."""
    name = func._schema.name.split("::")[-1]
    if name not in ("convolution", "convolution_backward"):
        return []
    activations = [args[0]] if name == "convolution" else [args[0], args[1]]
    first_result = out[0] if isinstance(out, (tuple, list)) else out  # the backward's input gradient, if asked for
    activations += [first_result] if isinstance(first_result, torch.Tensor) else []
    return [
        tensor
        for tensor in activations
        if tensor.dim() == 4
        and tensor.dtype in (torch.bfloat16, torch.float16)
        and not tensor.is_contiguous(memory_format=torch.channels_last)
    ]


def kernels(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Kernel launches of one operation (0: a view, an allocation, metadata), :func:`hidden_work` not included."""
    name = func._schema.name.split("::")[-1]
    if func in NO_KERNEL or func.is_view or name in NO_KERNEL_NAMES or torch.Tag.inplace_view in func.tags:
        return 0  # views, allocations, in-place views (as_strided_, squeeze_, ...: metadata only)
    if func._schema.name.startswith(("prim::", "profiler::")):
        return 0
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        listed = max((len(arg) for arg in args if isinstance(arg, (list, tuple))), default=1)
        return max(1, math.ceil(listed / MULTI_TENSOR_CHUNK))
    if name == "convolution_backward":  # one cuDNN kernel per gradient asked for (the bias's apart)
        mask = args[10] if len(args) > 10 else (True, True, True)
        return max(1, int(bool(mask[0])) + int(bool(mask[1])))
    return 1 + EXTRA_KERNELS.get(name, 0)


def _distinct(found: list[torch.Tensor]) -> list[torch.Tensor]:
    """``found`` without a second tensor that reaches the same elements (``z.mT`` beside ``z``): read once."""
    seen, distinct = set(), []
    for tensor in found:
        try:
            storage = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            distinct.append(tensor)
            continue
        pairs = zip(tensor.shape, tensor.stride())
        reach = tuple(sorted((size, stride) for size, stride in pairs if size > 1 and stride))  # a multiset
        key = (storage, tensor.storage_offset(), reach, tensor.dtype)
        if key not in seen:
            seen.add(key)
            distinct.append(tensor)
    return distinct


def moved_bytes(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> tuple[int, int]:
    """``(read, written)`` bytes of one operation, :func:`hidden_work` not included."""
    name = func._schema.name.split("::")[-1]
    inputs = tensors(args) + tensors(value for key, value in kwargs.items() if key != "out")
    outputs = tensors([out])
    if out is None:  # fused optimizers, multi-tensor updates: what the schema says they write
        arguments = func._schema.arguments
        for index, value in enumerate(args[: len(arguments)]):
            alias, argument = arguments[index].alias_info, arguments[index].name
            unscaled = argument == "grads" and kwargs.get("grad_scale") is None  # written when unscaled only
            if alias is not None and alias.is_write and not unscaled:
                outputs += tensors([value])
    unread = [args[index] for operation, index in SHAPE_ONLY if operation == name and index < len(args)]
    if name in WRITE_ONLY:
        unread += tensors(args[:1])
    if name == "convolution_backward" and len(args) > 10 and not args[10][0]:
        unread += tensors(args[2:3])  # the weight: only the input's gradient reads it
    inputs = [tensor for tensor in inputs if not any(tensor is other for other in unread)]
    read = sum(span_bytes(tensor) for tensor in _distinct(inputs))
    written = sum(span_bytes(tensor) for tensor in _distinct(outputs))
    return read, written


def hidden_work(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> tuple[int, int, int]:
    """``(kernels, read, written)`` that CUDA's implementation of the operation adds to :func:`kernels` and
    :func:`moved_bytes` (module docstring)."""
    name = func._schema.name.split("::")[-1]
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None:
        return 0, 0, 0
    if name in REDUCTIONS and kwargs.get("dtype") is not None:
        wider = kwargs["dtype"]
        if wider != first.dtype and not (first.dtype in (torch.bfloat16, torch.float16) and wider == torch.float32):
            widened = span_bytes(first) // first.element_size() * wider.itemsize
            return 1, widened, widened  # the cast writes it, the reduction reads it (instead of the input)
    if name in ("addmm", "baddbmm") and kwargs.get("out") is not first and kwargs.get("beta", 1) != 0:
        results = tensors([out])
        if results and first.shape == results[0].shape and all(first.stride()):  # a full accumulator, copied
            return 1, span_bytes(first), span_bytes(results[0])
    if name == "native_batch_norm" and len(args) > 5 and args[5]:  # training: the statistics pass
        return 1, span_bytes(first), 0
    if name == "native_batch_norm_backward" and len(args) > 1:
        passes = int(args[1].dim() == 4 and args[1].is_contiguous(memory_format=torch.channels_last))
        return passes, span_bytes(first) + span_bytes(args[1]), 0
    return 0, 0, 0


def _matrix_dims(tensor: torch.Tensor) -> tuple[int, int, int]:
    """``(batch, rows, columns)`` of a (batched) matrix."""
    rows, columns = tensor.shape[-2], tensor.shape[-1]
    return math.prod(tensor.shape[:-2]), rows, columns


def flops(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """FLOPs of one operation (multiply and add counted apart)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        if func._schema.name.split("::")[-1] in MATRIX_PRODUCTS:
            # the rules read the factors' shapes alone; the scalars and ``out_dtype`` of an overload (mm.dtype, ...)
            # do not fit every torch's rule signature
            args, kwargs = tuple(tensors(args)), {}
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    name = func._schema.name.split("::")[-1]
    first = next(iter(tensors(args)), None)
    if first is None:
        return 0.0
    if name in ("mv", "addmv"):
        matrix = args[1] if name == "addmv" else args[0]
        return 2.0 * matrix.shape[0] * matrix.shape[1]
    if name in ("dot", "vdot"):
        return 2.0 * first.shape[0]
    if name == "linalg_cholesky_ex":
        batch, n, _ = _matrix_dims(first)
        return batch * n**3 / 3.0
    if name in ("linalg_solve_triangular", "triangular_solve"):
        right = args[1] if name == "linalg_solve_triangular" else args[0]
        batch, n, m = _matrix_dims(right)
        return batch * float(n) * n * m
    if name == "cholesky_solve":
        batch, n, m = _matrix_dims(first)
        return batch * 2.0 * n * n * m
    if name == "cholesky_inverse":
        batch, n, _ = _matrix_dims(first)
        return batch * float(n) ** 3
    if name in ("linalg_lu_factor_ex", "_linalg_slogdet", "_linalg_det", "linalg_lu"):
        batch, n, _ = _matrix_dims(first)
        return batch * 2.0 * n**3 / 3.0
    if name == "_linalg_eigh":
        batch, n, _ = _matrix_dims(first)
        return batch * 9.0 * n**3
    if name in ("linalg_inv_ex",):
        batch, n, _ = _matrix_dims(first)
        return batch * 2.0 * float(n) ** 3
    results = tensors([out])
    if func.is_view or not results:
        return 0.0
    if name.startswith(
        ("sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "any")
    ):
        return float(first.numel())
    return float(sum(result.numel() for result in results))


def rate_class(func: torch._ops.OpOverload, args: tuple[Any, ...], dtype: torch.dtype | None) -> str:
    """Which peak rate an operation's arithmetic runs at: tensor-core products by their factors' dtype (float32
    products on TF32 tensor cores where torch allows it at the time of the call), CUDA cores otherwise."""
    name = func._schema.name.split("::")[-1]
    if dtype == torch.float64:
        return "fp64_tensor" if name in MATRIX_PRODUCTS or name in CONVOLUTIONS else "fp64"
    if name in MATRIX_PRODUCTS and dtype in (torch.bfloat16, torch.float16):
        return "bf16_tensor"
    if name in CONVOLUTIONS and dtype in (torch.bfloat16, torch.float16):
        return "bf16_tensor"
    if name in MATRIX_PRODUCTS and dtype == torch.float32 and _matmul_tf32():
        return "tf32_tensor"
    if name in CONVOLUTIONS and dtype == torch.float32 and _conv_tf32():
        return "tf32_tensor"
    return "fp32"


def _matmul_tf32() -> bool:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


def _conv_tf32() -> bool:
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision") and conv.fp32_precision not in ("none", ""):
        return conv.fp32_precision == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def compute_dtype(func: torch._ops.OpOverload, args: tuple[Any, ...], out: Any) -> torch.dtype | None:
    """The dtype an operation computes in: its first floating tensor argument's (a product's factors', not its
    accumulator's), else its first result's."""
    if func._schema.name.split("::")[-1] in ACCUMULATING_PRODUCTS:
        args = args[1:]
    found = tensors(args) + tensors([out])
    floating = next((tensor for tensor in found if tensor.is_floating_point()), None)
    return floating.dtype if floating is not None else found[0].dtype if found else None
