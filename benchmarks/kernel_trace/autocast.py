"""CUDA autocast for tensors that are CPU tensors to C++ (:mod:`.modelled_gpu`), as a ``TorchFunctionMode``.

The lists are CUDA autocast's (``aten/src/ATen/autocast_mode.cpp``: ``lower_precision_fp``, ``fp32``,
``fp32_set_opt_dtype``, ``promote``), at the level of the Python functions that reach those operations. Only
float32 tensors are cast down and only 16-bit ones up (float64 stays float64, as in CUDA autocast); casts of leaf
tensors that require gradients (parameters) are made once per autocast region and reused, as CUDA autocast caches
them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .counts import tensors

Tensor = torch.Tensor

LOWER_PRECISION = {
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.mm, Tensor.mm, torch.bmm,
    Tensor.bmm, torch.addmm, Tensor.addmm, torch.baddbmm, Tensor.baddbmm, torch.addbmm, torch.addmv, torch.addr,
    torch.mv, Tensor.mv, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot, torch.prelu, F.prelu,
    F.scaled_dot_product_attention, torch.linalg.vecdot,
}  # fmt: skip
FLOAT32 = {
    torch.acos, torch.asin, torch.cosh, torch.erfinv, torch.exp, torch.expm1, torch.log, torch.log10, torch.log2,
    torch.log1p, torch.reciprocal, torch.rsqrt, torch.sinh, torch.tan, torch.pow, Tensor.pow, Tensor.__pow__,
    Tensor.__rpow__, Tensor.exp, Tensor.log, Tensor.log1p, Tensor.rsqrt, Tensor.reciprocal, F.softplus, F.layer_norm,
    F.group_norm, torch.norm, Tensor.norm, F.cosine_similarity, torch.cdist, torch.dist, torch.renorm,
    torch.logsumexp, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, F.cosine_embedding_loss, F.margin_ranking_loss, F.soft_margin_loss,
    F.hinge_embedding_loss, F.poisson_nll_loss, F.multilabel_margin_loss, F.multi_margin_loss, F.triplet_margin_loss,
}  # fmt: skip
FLOAT32_OUTPUT = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, Tensor.softmax, Tensor.log_softmax, torch.cumsum,
    Tensor.cumsum, torch.cumprod, Tensor.cumprod, torch.prod, Tensor.prod, torch.sum, Tensor.sum,
    torch.linalg.vector_norm, torch.linalg.matrix_norm,
}  # fmt: skip
PROMOTE = {
    torch.cat, torch.stack, torch.addcmul, torch.addcdiv, torch.atan2, F.bilinear, torch.cross, torch.dot,
    torch.tensordot, torch.vdot, torch.index_put, torch.scatter_add, torch.index_copy,
}  # fmt: skip
_HALF = (torch.float16, torch.bfloat16)


class AutocastEmulation(TorchFunctionMode):
    """Casts as CUDA autocast makes them, while ``torch.is_autocast_enabled("cuda")``."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}

    def clear(self) -> None:
        self.cache.clear()

    def _cast(self, value: Any, dtype: torch.dtype, source: tuple[torch.dtype, ...]) -> Any:
        if not isinstance(value, Tensor) or value.dtype not in source or value.dtype == dtype:
            return value
        if value.is_leaf and value.requires_grad:
            cached = self.cache.get(id(value))
            if cached is not None and cached[0] is value:
                return cached[1]
            cast = value.to(dtype)
            self.cache[id(value)] = (value, cast)
            return cast
        return value.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cuda"):
            return func(*args, **kwargs)
        if func in LOWER_PRECISION:
            dtype = torch.get_autocast_dtype("cuda")
            args, kwargs = tree_map(lambda value: self._cast(value, dtype, (torch.float32,)), (args, kwargs))
        elif func in FLOAT32:
            args, kwargs = tree_map(lambda value: self._cast(value, torch.float32, _HALF), (args, kwargs))
        elif func in FLOAT32_OUTPUT and kwargs.get("dtype") is None:
            first = args[0] if args else None
            if isinstance(first, Tensor) and first.dtype in _HALF:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif func in PROMOTE:
            floats = [value for value in tensors(args) if value.is_floating_point()]
            if floats and any(value.dtype == torch.float32 for value in floats):
                args, kwargs = tree_map(lambda value: self._cast(value, torch.float32, _HALF), (args, kwargs))
        return func(*args, **kwargs)
