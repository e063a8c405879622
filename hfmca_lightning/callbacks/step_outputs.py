"""What a module's step returned, by name: the embeddings and labels the evaluation and health callbacks read
(docs/conventions.md §6).

Two conventions are understood without settings:

* this project's modules: ``features`` and ``targets``; a training step's ``features`` are ``(B * L, D)`` with each
  sample's ``L`` views together (or ``(B, L, D)``);
* stable-pretraining's forward functions: ``embedding`` and ``label``; a training step's ``embedding`` is the views'
  embeddings concatenated view after view, ``(L * B, D)``, as ``torch.cat([backbone(view["image"]) for view in
  views])`` gives.

A callback's ``embedding_key`` / ``label_key`` name other keys; training embeddings under another key are read
samples first unless the callback's ``views_first`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from hfmca_lightning.errors import ConfigurationError

__all__ = [
    "EMBEDDING_KEYS",
    "LABEL_KEYS",
    "evaluation_rows",
    "step_embeddings",
    "step_tensor",
    "unknown_embedding_key",
]

EMBEDDING_KEYS = ("features", "embedding")
LABEL_KEYS = ("targets", "label")
VIEWS_FIRST = frozenset({"embedding"})  # keys whose training rows are the views concatenated, view after view


def step_tensor(outputs: Any, key: str | None, understood: tuple[str, ...]) -> tuple[str, Tensor] | None:
    """``(key, tensor)`` of a step's output under ``key``, or (``key`` None) under the first of ``understood`` it
    holds; None where it holds none."""
    if not isinstance(outputs, Mapping):
        return None
    for name in (key,) if key is not None else understood:
        value = outputs.get(name)
        if isinstance(value, Tensor):
            return name, value
    return None


def step_embeddings(outputs: Any, key: str | None, samples: int, views_first: bool | None = None) -> Tensor | None:
    """A training step's embeddings as ``(B, L, D)`` (``samples`` = B), detached; 2-D rows are read views first or
    samples first as ``views_first`` says (None: by the key, module docstring). None where the output holds none or
    their rows are not a multiple of ``B``."""
    found = step_tensor(outputs, key, EMBEDDING_KEYS)
    if found is None:
        return None
    name, embeddings = found
    embeddings = embeddings.detach()
    if embeddings.dim() == 3:
        return embeddings
    if embeddings.dim() != 2 or embeddings.shape[0] % samples:
        return None
    if views_first is None:
        views_first = name in VIEWS_FIRST
    if views_first:
        return embeddings.reshape(-1, samples, embeddings.shape[-1]).transpose(0, 1)
    return embeddings.reshape(samples, -1, embeddings.shape[-1])


def unknown_embedding_key(reader: str, key: str, outputs: Any, otherwise: str) -> ConfigurationError:
    """The error of a callback whose ``embedding_key`` names no ``(B * L, D)`` embeddings of the training step's
    output; ``otherwise``: what the callback does when the key is left out."""
    got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
    return ConfigurationError(
        f"{reader}: embedding_key {key!r} names no (B * L, D) embeddings of the training step's output ({got}); "
        f"name another key, or leave it out to {otherwise}",
        parameter="embedding_key",
    )


def evaluation_rows(
    outputs: Any, embedding_key: str | None, label_key: str | None, reader: str, module: object
) -> tuple[Tensor, Tensor]:
    """``(embeddings (N, D), labels (N,))`` of an evaluation step's output, detached.

    Raises:
        ConfigurationError: naming ``reader`` and the keys it looked for, when the output lacks either.
    """
    embeddings = step_tensor(outputs, embedding_key, EMBEDDING_KEYS)
    labels = step_tensor(outputs, label_key, LABEL_KEYS)
    if embeddings is None or labels is None:
        wanted = " / ".join(repr(k) for k in ((embedding_key,) if embedding_key is not None else EMBEDDING_KEYS))
        wanted_labels = " / ".join(repr(k) for k in ((label_key,) if label_key is not None else LABEL_KEYS))
        got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ConfigurationError(
            f"{reader} needs {type(module).__name__}'s validation_step to return a dict with the embeddings (N, D) "
            f"under {wanted} and the labels (N,) under {wanted_labels}; it returned {got} (name other keys with "
            f"{reader}'s embedding_key / label_key)"
        )
    return embeddings[1].detach(), labels[1].detach()
