"""Window geometry of a CNN block: which input positions each output position is computed from.

An internal cost (paper §4, appendix "Details of decomposition with CNNs"; docs/conventions.md §3) pairs every output
position ``q`` of a block with the window of input positions it sees. For a chain of conv / pool layers
that window is a square ``(kernel, stride, padding)``, composed layer by layer with

    k = k1 + (k2 - 1) s1,    s = s1 s2,    p = p1 + p2 s1.

:func:`window_geometry` derives it from a module's layers. A custom module can declare its own geometry
with a ``window_geometry`` attribute (a :class:`WindowGeometry`, or a method returning one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["WindowGeometry", "window_geometry", "input_geometry"]


@dataclass(frozen=True)
class WindowGeometry:
    """Square window ``kernel x kernel``, moved by ``stride``, over an input zero-padded by ``padding``.

    Args:
        kernel: side of the window, ``>= 1``.
        stride: step between windows, ``>= 1``.
        padding: zeros added on every side of the input, ``>= 0``.

    Raises:
        ValueError: when a value is out of its range.
    """

    kernel: int = 1
    stride: int = 1
    padding: int = 0

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.stride < 1 or self.padding < 0:
            raise ValueError(f"window geometry needs kernel >= 1, stride >= 1, padding >= 0; got {self}")

    @classmethod
    def identity(cls) -> WindowGeometry:
        """The geometry of a pointwise layer (BN, activation, 1x1 stride-1 conv).

        Returns:
            ``WindowGeometry(1, 1, 0)``.
        """
        return cls(1, 1, 0)

    def then(self, later: WindowGeometry) -> WindowGeometry:
        """Geometry of this layer followed by ``later`` (the composition rule of the module docstring).

        Args:
            later: the geometry of the layer that takes this one's output.

        Returns:
            The geometry from this layer's input to ``later``'s output.
        """
        return WindowGeometry(
            kernel=self.kernel + (later.kernel - 1) * self.stride,
            stride=self.stride * later.stride,
            padding=self.padding + later.padding * self.stride,
        )

    def output_size(self, input_size: Sequence[int]) -> tuple[int, int]:
        """The size of the window grid over an input (floor, as conv and pooling do).

        Args:
            input_size: ``(H, W)`` of the input.

        Returns:
            ``(H', W')``.

        Raises:
            ValueError: when ``input_size`` is not two sizes or no window fits the input.
        """
        size = [(int(n) + 2 * self.padding - self.kernel) // self.stride + 1 for n in input_size]
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"window geometry {self} does not fit an input of size {tuple(input_size)}")
        return size[0], size[1]


def _square(value: int | Sequence[int], what: str, layer: nn.Module) -> int:
    if isinstance(value, int):
        return value
    values = tuple(value)
    if len(set(values)) != 1:
        raise ValueError(
            f"cannot derive a square window: {type(layer).__name__} has {what}={values}; "
            "internal costs need square kernels, strides and paddings"
        )
    return int(values[0])


def _check_dense(layer: nn.Module) -> None:
    if _square(getattr(layer, "dilation", 1), "dilation", layer) != 1:
        raise ValueError(
            f"{layer} is dilated: its window is not a dense square, so it has no (kernel, stride, padding) "
            "window geometry; hook a module without dilation"
        )


def _conv_geometry(conv: nn.Conv2d) -> WindowGeometry:
    kernel = _square(conv.kernel_size, "kernel_size", conv)
    _check_dense(conv)
    stride = _square(conv.stride, "stride", conv)
    if conv.padding == "valid":
        padding = 0
    elif conv.padding == "same":
        padding = (kernel - 1) // 2
    else:
        assert not isinstance(conv.padding, str)  # 'valid' and 'same', the only strings, are handled above
        padding = _square(conv.padding, "padding", conv)
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"internal-cost windows assume zero padding outside the map; {conv} pads with '{conv.padding_mode}'"
        )
    return WindowGeometry(kernel, stride, padding)


def _pool_geometry(pool: nn.MaxPool2d | nn.AvgPool2d) -> WindowGeometry:
    if pool.ceil_mode:
        raise ValueError(f"{pool} uses ceil_mode=True, whose windows are not a fixed geometry; use ceil_mode=False")
    kernel = _square(pool.kernel_size, "kernel_size", pool)
    stride = _square(pool.stride if pool.stride is not None else kernel, "stride", pool)
    _check_dense(pool)
    return WindowGeometry(kernel, stride, _square(pool.padding, "padding", pool))


def _pad_geometry(pad: nn.ZeroPad2d) -> WindowGeometry:
    sides = tuple(pad.padding)
    if len(set(sides)) != 1:
        raise ValueError(f"cannot derive a square window: {pad} pads the sides unequally ({sides})")
    return WindowGeometry(1, 1, int(sides[0]))


_POINTWISE = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
)
# timm's stochastic depth and DropBlock scale each position alone (a random mask, no neighbours): pointwise too
_POINTWISE_CLASS_NAMES = ("DropPath", "DropBlock2d")
# ResNet blocks named as methods.inspection.residual_blocks names them (torchvision's and timm's classes)
_RESIDUAL_BLOCK_CLASS_NAMES = ("BasicBlock", "Bottleneck")


def window_geometry(module: nn.Module) -> WindowGeometry:
    """Derive the window geometry of ``module`` from its conv / pool / padding layers.

    Rules, in order: a ``window_geometry`` attribute wins; conv, pooling and zero-padding layers have
    their own geometry; pointwise layers (norms, activations, dropout, timm's ``DropPath`` / ``DropBlock2d``) are
    the identity; a ResNet ``BasicBlock`` / ``Bottleneck`` (any class of that name: torchvision's and timm's) uses its
    main path, its children in registration order without ``downsample`` (the 1x1 shortcut lies inside that window;
    composed after the main path it multiplied the stride of a strided block by its own: timm registers it last);
    any other container composes its children in registration order, which is right for
    ``nn.Sequential`` and for blocks whose forward is a single chain.

    Args:
        module: the block, e.g. a backbone stage.

    Returns:
        The window geometry from the block's input to its output.

    Raises:
        ValueError: for layers whose window is not a fixed square (adaptive pooling, upsampling, ...),
            naming the layer; declare ``window_geometry`` on such modules instead.
        TypeError: when a ``window_geometry`` attribute is not a :class:`WindowGeometry` (nor gives one).
    """
    declared = getattr(module, "window_geometry", None)
    if declared is not None:
        geometry = declared() if callable(declared) else declared
        if not isinstance(geometry, WindowGeometry):
            raise TypeError(f"{type(module).__name__}.window_geometry must be a WindowGeometry, got {geometry!r}")
        return geometry
    if isinstance(module, nn.Conv2d):
        return _conv_geometry(module)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        return _pool_geometry(module)
    if isinstance(module, nn.ZeroPad2d):
        return _pad_geometry(module)
    if isinstance(module, _POINTWISE) or type(module).__name__ in _POINTWISE_CLASS_NAMES:
        return WindowGeometry.identity()
    if type(module).__name__ in _RESIDUAL_BLOCK_CLASS_NAMES:  # main path: conv1 .. conv3 (timm: and its `aa` pool)
        return _compose([child for name, child in module.named_children() if name != "downsample"])
    children = list(module.children())
    if not children:
        raise ValueError(
            f"cannot derive the window geometry of {type(module).__name__} ({module}): it is neither a "
            "conv/pool/zero-pad layer nor pointwise. Give it a `window_geometry` attribute "
            "(hfmca_lightning.losses.WindowGeometry) or hook a module around it."
        )
    return _compose(children)


def _compose(layers: Sequence[nn.Module]) -> WindowGeometry:
    geometry = WindowGeometry.identity()
    for layer in layers:
        geometry = geometry.then(window_geometry(layer))
    return geometry


def input_geometry(root: nn.Module, name: str) -> WindowGeometry:
    """Geometry from ``root``'s input image to the input map of its submodule ``name``: which image pixels each
    position of that map sees. Composes every module registered before each component of ``name`` (children
    are assumed to run in registration order, as for :func:`window_geometry`).

    Position ``j`` of the map is centred on image pixel ``j * stride - padding + (kernel - 1) / 2`` (figures
    place heatmaps with it: a spectrum CNN's maps carry the padding ring of ``L0``).

    Args:
        root: the network, e.g. a backbone.
        name: the dotted name of a submodule of ``root`` (as in ``root.named_modules()``).

    Returns:
        The geometry from ``root``'s input image to the input map of ``name``.

    Raises:
        ValueError: when a module before ``name`` has no fixed window geometry, or ``name`` is not a submodule.
    """
    geometry, module = WindowGeometry.identity(), root
    for part in name.split("."):
        children = dict(module.named_children())
        if part not in children:
            raise ValueError(f"{type(module).__name__} has no child module {part!r} (looking for {name!r})")
        for child_name, child in children.items():
            if child_name == part:
                break
            geometry = geometry.then(window_geometry(child))
        module = children[part]
    return geometry
