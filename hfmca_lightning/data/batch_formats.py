"""Training batches in the layouts other SSL code expects (docs/baselines.md): every drawer makes a :class:`ViewBatch`
(groups of equal-size views, global crops first) that :func:`format_batch` lays out as

* ``stacked`` (this project's modules): ``(views (B, L, C, H, W), targets)``; several groups (also at one size): a list
  of ``(B, n_g, C, H_g, W_g)``; view grids: ``(views, targets, grids (B, L, g, g, 2))``; one view ``(B, C, H, W)``;
* ``lightly``: ``([view_0 (B, C, H, W), ..., view_{L-1}], targets, names)``, view grids after the views (VICRegL);
* ``solo`` (solo-learn): ``(indexes (B,), [view_0, ..., view_{L-1}], targets)``;
* ``dict`` (stable-pretraining): ``{"views": [{"image", "label", "sample_idx"}, ...], "label", "sample_idx"}``, view
  grids as each view's ``"grid"``; ``dict_named`` (its DINO): ``"views"`` a dict ``{"global_0": ..., "local_0": ...}``;
  one view and the evaluation batches: ``{"image", "label", "sample_idx"}``.

Each dict batch is a new plain ``dict`` (writing into it changes nothing of the next); ``label`` is ``UNLABELLED`` (-1)
for images without a class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from torch import Tensor

__all__ = ["BATCH_FORMATS", "DICT_FORMATS", "BatchFormat", "ViewBatch", "first_views", "format_batch", "sample_dict"]

BatchFormat = Literal["stacked", "lightly", "solo", "dict", "dict_named"]
BATCH_FORMATS: tuple[BatchFormat, ...] = get_args(BatchFormat)
DICT_FORMATS = ("dict", "dict_named")


@dataclass
class ViewBatch:
    """The views of ``B`` samples before they are laid out (:func:`format_batch`).

    Args:
        groups: ``(B, n_g, C, H_g, W_g)`` per group of equal-size views, global crops first.
        targets: ``(B,)`` int64 class indices (``UNLABELLED`` for images without a class).
        indices: ``(B,)`` int64 indices of the samples in the training split.
        names: the samples' indices as strings, made on the host before any transfer.
        grids: ``(B, L, g, g, 2)`` source positions of a grid over each view (VICRegL), or None.
    """

    groups: list[Tensor]
    targets: Tensor
    indices: Tensor
    names: list[str] = field(default_factory=list)
    grids: Tensor | None = None

    @property
    def num_views(self) -> int:
        return sum(group.shape[1] for group in self.groups)

    def views(self) -> list[Tensor]:
        """Every view of the samples, one batch per view: ``L`` tensors ``(B, C, H, W)``, global crops first."""
        return [group[:, view] for group in self.groups for view in range(group.shape[1])]


def format_batch(
    batch: ViewBatch, batch_format: BatchFormat, single: bool = False, global_views: int | None = None
) -> Any:
    """``batch`` laid out in ``batch_format`` (module docstring); ``single``: one view per sample, without a view axis;
    ``global_views``: how many leading views are global crops (``dict_named``; default: the first group's).

    Raises:
        ValueError: when ``batch_format`` is not one of :data:`BATCH_FORMATS`.

    Example::

        batch = ViewBatch([torch.randn(8, 2, 3, 32, 32)], torch.zeros(8, dtype=torch.int64), torch.arange(8))
        views, targets = format_batch(batch, "stacked")  # views (8, 2, 3, 32, 32)
        indexes, views, targets = format_batch(batch, "solo")  # views: two (8, 3, 32, 32)
        format_batch(batch, "dict_named")["views"]["global_1"]["image"]  # (8, 3, 32, 32)
    """
    if single and batch_format in DICT_FORMATS:
        return sample_dict(batch.groups[0][:, 0], batch.targets, batch.indices)
    if batch_format == "stacked":
        if single:
            return batch.groups[0][:, 0], batch.targets
        views: Tensor | list[Tensor] = batch.groups[0] if len(batch.groups) == 1 else list(batch.groups)
        return (views, batch.targets) if batch.grids is None else (views, batch.targets, batch.grids)
    views_list = batch.views()
    if batch_format == "lightly":
        if batch.grids is not None:
            views_list += list(batch.grids.unbind(dim=1))
        return views_list, batch.targets, list(batch.names)
    if batch_format == "solo":
        return batch.indices, views_list, batch.targets
    if batch_format not in DICT_FORMATS:
        raise ValueError(f"batch_format must be one of {BATCH_FORMATS}; got {batch_format!r}")
    per_view = [sample_dict(view, batch.targets, batch.indices) for view in views_list]
    if batch.grids is not None:
        for view, grid in zip(per_view, batch.grids.unbind(dim=1)):
            view["grid"] = grid
    if batch_format == "dict_named":
        count = batch.groups[0].shape[1] if global_views is None else global_views
        names = [f"global_{v}" for v in range(count)] + [f"local_{v}" for v in range(len(views_list) - count)]
        return {"views": dict(zip(names, per_view)), "label": batch.targets, "sample_idx": batch.indices}
    return {"views": per_view, "label": batch.targets, "sample_idx": batch.indices}


def sample_dict(images: Tensor, labels: Tensor, indices: Tensor) -> dict[str, Tensor]:
    """One view of ``B`` samples as a dict: ``{"image": (B, C, H, W), "label": (B,), "sample_idx": (B,)}``."""
    return {"image": images, "label": labels, "sample_idx": indices}


def first_views(batch: Any, batch_format: BatchFormat = "stacked") -> tuple[Tensor, Tensor]:
    """``(images (B, C, H, W), targets (B,))``: each sample's first view of a training batch in ``batch_format``."""
    if batch_format in DICT_FORMATS:
        views = batch.get("views")  # None: a single view
        first = batch if views is None else (next(iter(views.values())) if isinstance(views, dict) else views[0])
        return first["image"], batch["label"]
    views, targets = (batch[1], batch[2]) if batch_format == "solo" else (batch[0], batch[1])
    if isinstance(views, (list, tuple)):
        views = views[0]
    return (views[:, 0] if views.dim() == 5 else views), targets
