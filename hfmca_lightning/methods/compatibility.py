"""Start-up checks that a backbone fits the data it is given, before any batch is drawn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "ArchitectureMismatch",
    "check_batch_format",
    "check_feature_sizes",
    "check_image_size",
    "load_checked_state_dict",
]


def check_image_size(backbone: nn.Module, datamodule: Any) -> None:
    """A backbone built for one image size (an ``image_size`` attribute, as :class:`~hfmca_lightning.models.SpectrumCNN`
    has) or for other than RGB images (``in_channels``) and a data source of another are one clear error: otherwise
    the maps grow with the images (a 224-px source through the 32-px spectrum CNN ran out of memory), the geometry no
    longer ends in one position, or the first convolution fails on the first batch."""
    expected = getattr(backbone, "image_size", None)
    source = getattr(datamodule, "source", None)
    given = getattr(source, "image_size", None)
    smallest, views = getattr(backbone, "min_image_size", None), getattr(datamodule, "views", None)
    if isinstance(smallest, int) and isinstance(given, int):
        sizes = [given]
        if views is not None and hasattr(views, "groups"):  # MultiCrop's
            sizes = [size for _, size, _ in views.groups(given)]
        if min(sizes) < smallest:
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
    if not isinstance(expected, int) or not isinstance(given, int) or expected == given:
        return
    raise ConfigurationError(
        f"the data source {type(source).__name__} gives {given}-px images, but the backbone "
        f"{type(backbone).__name__} is built for image_size={expected}: set the source's image_size to {expected} "
        f"(data.init_args.source.init_args.image_size) or build the backbone for {given} px",
        parameter="image_size",
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


def check_feature_sizes(backbone: nn.Module, projector: nn.Module | None, external_head: nn.Module | None) -> None:
    """The feature sizes the parts state agree: the backbone's ``feature_dim`` is the projector's ``input_dim``, and
    what reaches the external head (the projector's ``output_dim``, else the backbone's features) its
    ``feature_dim``; otherwise the first training step fails inside a matrix product."""
    size, giver = getattr(backbone, "feature_dim", None), "the backbone gives"
    for part, key, takes in ((projector, "projector", "input_dim"), (external_head, "external_head", "feature_dim")):
        wanted = getattr(part, takes, None) if part is not None else None
        if isinstance(size, int) and isinstance(wanted, int) and size != wanted:
            raise ConfigurationError(
                f"{giver} {size} features, but model.init_args.{key} takes {takes}={wanted}: set "
                f"model.init_args.{key}.init_args.{takes} to {size} (or change the part before it)"
            )
        if part is not None and key == "projector":
            size, giver = getattr(part, "output_dim", None), "the projector gives"


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
    meanwhile put back). ``strict=False`` is torch's (missing and unexpected keys allowed, shapes not)."""
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
    result = None if mismatched else nn.Module.load_state_dict(module, state_dict, strict=False, assign=assign)
    missing = sorted(result.missing_keys) if result is not None else []
    unexpected = sorted(result.unexpected_keys) if result is not None else []
    if missing or unexpected:
        nn.Module.load_state_dict(module, kept, strict=False)  # as it was
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
