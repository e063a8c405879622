"""The run's resolved config inside every checkpoint, so that ``hfmca analyze`` can rebuild model and data."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

__all__ = ["StoredConfig", "saved_config"]


def saved_config(checkpoint: dict[str, Any]) -> str | None:
    """The resolved YAML config that :class:`StoredConfig` put in ``checkpoint``, if any."""
    callbacks = checkpoint.get("callbacks")
    entry = callbacks.get(StoredConfig.__name__) if isinstance(callbacks, dict) else None
    config = entry.get("config") if isinstance(entry, dict) else None
    return config if isinstance(config, str) else None


class StoredConfig(Callback):
    """Writes ``config`` (the full resolved YAML of the run, set by the ``hfmca`` CLI) into every checkpoint. A resumed
    run stores its own config, not the one of the checkpoint it resumes (which is taken only where none was set)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config} if self.config is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.config is None:
            self.config = state_dict.get("config")
