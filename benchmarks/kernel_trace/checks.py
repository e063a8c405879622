"""What a step's checks read on the host when the step is healthy.

Fake tensors hold no values, so a check read on the host (``bool(torch.isfinite(total))``, ``failed.any().item()``)
has no answer of its own. :class:`HealthyChecks` (a ``TorchFunctionMode``) gives the results of ``isfinite`` and its
kin the value a healthy step gives them, through ``all`` / ``any`` / ``~`` / ``&`` / ``|`` and copies, so that the
traced code takes the path of a normal step; any other value read on the host is 0 (nothing failed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ATTRIBUTE = "_healthy_value"
_HEALTHY = {"isfinite": True, "isnan": False, "isinf": False, "isposinf": False, "isneginf": False}
_SAME = {
    "any", "all", "amax", "amin", "max", "min", "clone", "to", "view", "reshape", "squeeze", "unsqueeze", "expand",
    "detach", "__getitem__", "flatten", "contiguous", "cpu", "cuda", "float", "int", "long", "bool", "double",
}  # fmt: skip
_NEGATE = {"logical_not", "bitwise_not", "__invert__"}
_ALL = {"logical_and", "bitwise_and", "__and__", "__iand__", "__rand__"}
_ANY = {"logical_or", "bitwise_or", "__or__", "__ior__", "__ror__"}


def healthy_value(tensor: object) -> bool | None:
    """The value a healthy step gives ``tensor`` (a check), or None where no rule says."""
    return getattr(tensor, _ATTRIBUTE, None)


class HealthyChecks(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        value = _rule(name, args)
        if value is not None and isinstance(result, torch.Tensor):
            setattr(result, _ATTRIBUTE, value)
        return result


def _rule(name: str, args: tuple[Any, ...]) -> bool | None:
    if name in _HEALTHY:
        return _HEALTHY[name]
    known = [value for value in map(healthy_value, args) if value is not None]
    if not known:
        return None
    if name in _SAME:
        return known[0]
    if name in _NEGATE:
        return not known[0]
    if name in _ALL:
        return all(known)
    if name in _ANY:
        return any(known)
    return None
