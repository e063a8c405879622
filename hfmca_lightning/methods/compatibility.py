"""Start-up checks that a module fits the data and the trainer it is given, before any batch is drawn."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
    StrategyRegistry,
)
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "ArchitectureMismatch",
    "check_batch_format",
    "check_batch_norm_batch_size",
    "check_crop_grids",
    "check_feature_sizes",
    "check_image_size",
    "check_strategy",
    "load_checked_state_dict",
    "strategy_problem",
]

SHARDED_STRATEGIES = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)


def check_image_size(backbone: nn.Module, datamodule: Any) -> None:
    """A backbone built for one image size (an ``image_size`` attribute, as :class:`~hfmca_lightning.models.SpectrumCNN`
    and fixed-size ViTs have) or for other than RGB images (``in_channels``) and data of another are one clear error:
    otherwise the maps grow with the images (a 224-px source through the 32-px spectrum CNN ran out of memory), the
    geometry no longer ends in one position, or the first convolution fails on the first batch. Every view size is
    compared (a ``MultiCrop``'s global and local crops), not the source's size alone."""
    expected = getattr(backbone, "image_size", None)
    source = getattr(datamodule, "source", None)
    given = getattr(source, "image_size", None)
    views = getattr(datamodule, "views", None)
    sizes = _view_sizes(views, given) if isinstance(given, int) else []
    smallest = getattr(backbone, "min_image_size", None)
    if isinstance(smallest, int) and sizes and min(sizes) < smallest:
        raise ConfigurationError(
            f"the backbone {type(backbone).__name__} needs views of at least {smallest} px (its stages halve the "
            f"map), but the data gives {min(sizes)}-px views: use fewer stages or larger views",
            parameter="image_size",
        )
    channels = getattr(backbone, "in_channels", None)
    if isinstance(channels, int) and source is not None and channels != 3:  # every source gives RGB images
        raise ConfigurationError(
            f"the backbone {type(backbone).__name__} takes {channels}-channel images, but the data source "
            f"{type(source).__name__} gives RGB (3 channels): set the backbone's in_channels to 3",
            parameter="in_channels",
        )
    if not isinstance(expected, int) or all(size == expected for size in sizes):
        return
    if sizes == [given]:  # views of the source's size
        raise ConfigurationError(
            f"the data source {type(source).__name__} gives {given}-px images, but the backbone "
            f"{type(backbone).__name__} is built for image_size={expected}: set the source's image_size to {expected} "
            f"(data.init_args.source.init_args.image_size) or build the backbone for {given} px",
            parameter="image_size",
        )
    listed = ", ".join(f"{size} px" for size in sizes)
    raise ConfigurationError(
        f"the data's {type(views).__name__} views are {listed} (from the {given}-px images of "
        f"{type(source).__name__}), but the backbone {type(backbone).__name__} is built for image_size={expected} "
        f"and takes no other size: set every view group to {expected} px (data.init_args.views.init_args.global_size "
        "and local_size), or use a backbone that takes any size (a CNN; a timm ViT with model_kwargs "
        "dynamic_img_size: true)",
        parameter="image_size",
    )


def _view_sizes(views: Any, image_size: int) -> list[int]:
    """The side of each group of views the data gives from ``image_size``-px images: every group of a ``MultiCrop``
    (``groups``, global first), else the source's size."""
    if views is not None and hasattr(views, "groups"):  # MultiCrop's
        return [size for _, size, _ in views.groups(image_size)]
    return [image_size]


def strategy_problem(strategy: type[Strategy], start_method: str = "popen", command: bool = False) -> str | None:
    """Why runs cannot use a ``strategy`` class started by ``start_method`` (DDP's), or None: strategies that shard the
    model (FSDP, DeepSpeed, model parallel) write and read their checkpoints with their own code, past this project's
    atomic writes, loading without unpickling and architecture check (docs/trust.md); in the ``hfmca`` command
    (``command``), DDP started by spawning or forking (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) hands the trained
    weights back through a file of plain weights, which the command's checkpoint reader refuses after training."""
    if issubclass(strategy, SHARDED_STRATEGIES):
        return f"{strategy.__name__} shards the model, and its checkpoints bypass the checks of files from others"
    if command and issubclass(strategy, DDPStrategy) and start_method != "popen":
        return f"DDP started by {start_method} hands the trained weights back in a file the command refuses to read"
    return None


def check_strategy(module: object, strategy: Strategy | str, command: bool = False) -> None:
    """:func:`strategy_problem` of ``strategy`` (an instance, or a name of Lightning's registry) as one clear error
    before training (docs/speed.md)."""
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            return  # an unknown name is Lightning's to refuse
        entry = StrategyRegistry[strategy]  # (StrategyRegistry.get would build one)
        kind, start = entry["strategy"], entry["init_params"].get("start_method", "popen")
    else:
        kind, start = type(strategy), getattr(strategy, "_start_method", "popen")
    problem = strategy_problem(kind, start, command)
    if problem is not None:
        raise ConfigurationError(
            f"{type(module).__name__} trains on one device or under DDP; {problem}: set trainer.strategy to auto or "
            "ddp",
            parameter="strategy",
        )


def check_batch_format(module: object, datamodule: Any) -> None:
    """This project's modules take ``stacked`` batches; a data module set to another layout (for code written for
    lightly or solo-learn) is one clear error before training."""
    batch_format = getattr(datamodule, "batch_format", "stacked")
    if batch_format != "stacked":
        raise ConfigurationError(
            f"{type(module).__name__} takes stacked batches (views, targets), but the data's batch_format is "
            f"{batch_format!r} (for modules written for lightly, solo-learn or stable-pretraining): set data "
            "batch_format: stacked",
            parameter="batch_format",
        )


def check_crop_grids(module: object, datamodule: Any, instead: str = "") -> None:
    """Crop grids (``SimCLRViews(grids=g)``) make batches ``(views, targets, grids)``, which only VICRegL reads: a
    module that takes ``(views, targets)`` refuses them before training instead of an unpacking error at the first
    step; ``instead``: the other way out the message offers."""
    grids = getattr(getattr(datamodule, "views", None), "grids", 0)
    if grids:
        raise ConfigurationError(
            f"data.init_args.views draws crop grids (grids={grids}), which only VICRegL reads; "
            f"{type(module).__name__} takes (views, targets) batches: remove grids from the views{instead}",
            parameter="grids",
        )


def check_batch_norm_batch_size(module: nn.Module, datamodule: Any, layers: list[str]) -> None:
    """Training batches of one sample per process refused before training where BatchNorm ``layers`` (module names,
    the one to name first) normalise over the samples alone and need two (otherwise torch's "Expected more than 1
    value per channel" at the first step). Under DDP ``batch_size`` is per process."""
    batch_size = getattr(datamodule, "batch_size", None)
    if not layers or not isinstance(batch_size, int) or batch_size >= 2:
        return
    raise ConfigurationError(
        f"{type(module).__name__} trains on batches of {batch_size} sample per process, but its BatchNorm layer "
        f"{layers[0]} normalises over the samples and needs at least 2 (under DDP the batch is per process): set "
        "data.init_args.batch_size to 2 or more",
        parameter="batch_size",
    )


def check_feature_sizes(backbone: nn.Module, projector: nn.Module | None, external_head: nn.Module | None) -> None:
    """The feature sizes the parts state agree: the backbone's ``feature_dim`` is what the projector takes, and what
    reaches the external head (the projector's output, else the backbone's features) its ``feature_dim``; otherwise
    the first training step fails inside a matrix product. A projector states its sizes as ``input_dim`` /
    ``output_dim`` (the project's heads), ``in_features`` / ``out_features`` (a ``torch.nn.Linear``), or through the
    first / last ``Linear`` of an ``nn.Sequential`` (with only size-keeping layers before / after it)."""
    size, giver = getattr(backbone, "feature_dim", None), "the backbone gives"
    for part, key in ((projector, "projector"), (external_head, "external_head")):
        if part is None:
            continue
        wanted = _taken_size(part) if key == "projector" else _stated(part, "feature_dim")
        if isinstance(size, int) and wanted is not None and size != wanted.size:
            if wanted.nested:
                raise ConfigurationError(
                    f"{giver} {size} features, but model.init_args.{key} ({type(part).__name__}) takes {wanted.size} "
                    f"(the {wanted.attribute} of its first Linear): make that Linear take {size} features (or "
                    "change the part before it)"
                )
            raise ConfigurationError(
                f"{giver} {size} features, but model.init_args.{key} takes {wanted.attribute}={wanted.size}: set "
                f"model.init_args.{key}.init_args.{wanted.attribute} to {size} (or change the part before it)"
            )
        if key == "projector":
            given = _given_size(part)
            size, giver = (given.size if given is not None else None), "the projector gives"


# Layers that give features of the size they take ((N, D) -> (N, D)): a Sequential's first / last Linear sets its sizes
# only with these before / after it.
_SIZE_KEEPING = (
    nn.Identity, nn.Dropout, nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm, nn.ReLU, nn.GELU, nn.SiLU, nn.LeakyReLU,
    nn.Tanh, nn.Sigmoid, nn.ELU, nn.Softplus, nn.Mish, nn.Hardswish, nn.PReLU,
)  # fmt: skip


class _StatedSize(NamedTuple):
    """A feature size a part states: the value, the attribute that holds it, and whether a layer inside holds it."""

    size: int
    attribute: str
    nested: bool = False


def _stated(part: nn.Module, attribute: str) -> _StatedSize | None:
    """The size ``part`` states as an int ``attribute``, else ``None`` (also for a lazily sized Linear's 0)."""
    value = getattr(part, attribute, None)
    return (
        _StatedSize(value, attribute) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )


def _taken_size(part: nn.Module) -> _StatedSize | None:
    """The feature size ``part`` takes and the setting that says so (``input_dim``, ``in_features``), or ``None``."""
    return _end_size(part, "input_dim", "in_features", first=True)


def _given_size(part: nn.Module) -> _StatedSize | None:
    """The feature size ``part`` gives and the setting that says so (``output_dim``, ``out_features``), or ``None``."""
    return _end_size(part, "output_dim", "out_features", first=False)


def _end_size(part: nn.Module, stated: str, linear: str, first: bool) -> _StatedSize | None:
    """The size at ``part``'s input (``first``) or output: its ``stated`` attribute, a Linear's ``linear`` one, or that
    of a Sequential's first / last Linear; ``None`` where nothing says it (a custom layer before it, say)."""
    found = _stated(part, stated)
    if found is not None:
        return found
    if isinstance(part, nn.Linear):
        return _stated(part, linear)
    if isinstance(part, nn.Sequential):
        children = list(part.children())
        for child in children if first else reversed(children):
            if isinstance(child, (nn.Linear, nn.Sequential)):
                found = _end_size(child, stated, linear, first)
                return found._replace(nested=True) if found is not None else None
            if not isinstance(child, _SIZE_KEEPING):
                return None
    return None


class ArchitectureMismatch(ConfigurationError):
    """A checkpoint of another architecture than the configured model; ``details`` says what differs."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


def load_checked_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``nn.Module.load_state_dict`` of ``module`` that, when ``strict``, raises one clear error
    (:class:`ArchitectureMismatch`) for the state of another architecture instead of torch's list of keys, and
    leaves the module as it was: shapes compared before anything is loaded (lazily sized parameters and buffers
    adapt), missing and unexpected keys as torch finds them after the modules' own load hooks (what torch loaded
    meanwhile put back: parameters, buffers and the modules' extra state, such as a SpectrumCNN's layout).
    ``strict=False`` is torch's (missing and unexpected keys allowed, shapes not)."""
    if not strict:
        return nn.Module.load_state_dict(module, state_dict, strict=False, assign=assign)
    current = module.state_dict()
    mismatched = [
        f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(current[key].shape)}"
        for key, value in state_dict.items()
        if isinstance(value, Tensor) and isinstance(current.get(key), Tensor) and _sized(current[key])
        and value.shape != current[key].shape
    ]  # fmt: skip
    kept = {
        key: value.detach().clone() for key, value in current.items() if isinstance(value, Tensor) and _sized(value)
    }
    kept.update(  # modules' extra state (get_extra_state), which a load may have changed (a SpectrumCNN's layout)
        {key: copy.deepcopy(value) for key, value in current.items() if _is_extra_state(key) and key not in kept}
    )
    with warnings.catch_warnings(record=True) as said:  # the load hooks' warnings stand only if the load does
        warnings.simplefilter("always")
        result = None if mismatched else nn.Module.load_state_dict(module, state_dict, strict=False, assign=assign)
    missing = sorted(result.missing_keys) if result is not None else []
    unexpected = sorted(result.unexpected_keys) if result is not None else []
    if missing or unexpected:
        with warnings.catch_warnings():  # set_extra_state's note on taking back the module's own state
            warnings.simplefilter("ignore")
            nn.Module.load_state_dict(module, kept, strict=False)  # as it was
    elif not mismatched:
        for warning in said:  # a SpectrumCNN switched to the checkpoint's layout, say
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if missing or unexpected or mismatched:
        details = []
        if missing:
            details.append(f"{len(missing)} parameters missing from the checkpoint (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} parameters the model does not have (e.g. {unexpected[0]})")
        if mismatched:
            details.append(f"{len(mismatched)} shape mismatches (e.g. {mismatched[0]})")
        raise ArchitectureMismatch(
            f"the checkpoint was trained with a different architecture than {type(module).__name__} as "
            f"configured: {'; '.join(details)}. Resume with the config the checkpoint was trained with "
            "(saved as config.yaml in the run folder).",
            "; ".join(details),
        )
    return result


def _sized(tensor: Tensor) -> bool:
    """Whether a parameter or buffer has its size (lazily sized ones take the checkpoint's)."""
    return not is_lazy(tensor) and tensor.numel() > 0


def _is_extra_state(key: str) -> bool:
    """Whether a ``state_dict`` key holds a module's extra state (``get_extra_state``), not a parameter or buffer."""
    return key.rsplit(".", 1)[-1] == "_extra_state"
