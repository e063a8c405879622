"""The steps the roofline traces: a shipped config's whole training step (:func:`trace_config`), run by Lightning's
Trainer as ``hfmca fit`` runs it, and the training-step rows of ``make gpu-check`` (:func:`trace_rows`)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml
from torch.utils._python_dispatch import _disable_current_modes

from .gpus import GPUSpec
from .trace import Trace, modules_by_phase, tracing

# The phases of the named children of the package's LightningModules.
MODULE_PHASES = {
    "backbone": "backbone",
    "projector": "external",
    "external_head": "external",
    "external_cost": "external",
    "head": "head",
    "predictor": "head",
}
TRACED_STEP = 1  # the second step is traced: the first makes the optimizer's state and caches


def _steps_per_draw(config: dict[str, Any]) -> int:
    """How many steps one draw of the config's drawer serves (``batches_per_call``): the steps traced, so that a
    chunk's draw is counted once per its steps."""
    drawer = ((config.get("data") or {}).get("init_args") or {}).get("drawer") or {}
    return max(1, int((drawer.get("init_args") or {}).get("batches_per_call", 1)))


class _Traced(Exception):
    """Raised by the recording callback once the traced step is done, to end ``fit``."""


def _image_size(source: dict[str, Any]) -> int:
    """The image side a source config gives the network: its ``image_size`` argument, else the class's default."""
    init_args = source.get("init_args") or {}
    if "image_size" in init_args:
        return int(init_args["image_size"])
    module_name, _, class_name = source["class_path"].rpartition(".")
    source_class = getattr(importlib.import_module(module_name), class_name)
    parameter = inspect.signature(source_class).parameters.get("image_size")
    if parameter is not None and parameter.default is not inspect.Parameter.empty:
        return int(parameter.default)
    return int(source_class.image_size)


def traced_config(config: dict[str, Any], steps: int = TRACED_STEP + 1, spare: int = 1) -> dict[str, Any]:
    """``config`` as the tracer runs it: its model, optimizer, precision, callbacks' per-step work, views and drawer,
    on ``SyntheticShapes`` images of the source's size (nothing read or downloaded), on one CUDA device, for
    ``steps`` steps (with images for ``spare`` more: a drawer that draws ahead finds its next batches), with no
    logger, checkpoint, validation or workers."""
    traced = copy.deepcopy(config)
    trainer = traced.setdefault("trainer", {})
    callbacks = trainer.get("callbacks") or []
    kept = [
        callback
        for callback in (callbacks if isinstance(callbacks, list) else [callbacks])
        if not any(word in callback["class_path"] for word in ("Checkpoint", "LearningRateMonitor"))
    ]
    trainer.update(
        callbacks=kept,
        logger=False,
        accelerator="cuda",
        devices=1,
        strategy="auto",
        max_steps=steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    data = traced["data"]["init_args"]
    source = data["source"]
    image_size = _image_size(source)
    batch = int(data.get("batch_size", 64))
    data["source"] = {
        "class_path": "hfmca_lightning.data.SyntheticShapes",
        "init_args": {"num_classes": 10, "train_per_class": batch * (steps + spare) // 10 + 1, "test_per_class": 1,
                      "image_size": image_size},
    }  # fmt: skip
    data["num_workers"] = 0
    return traced


def trace_config(
    config_path: str | Path, gpu: GPUSpec, overrides: dict[str, Any] | None = None, drop_internal: bool = False
) -> Trace:
    """One whole training step of a config (forward, backward, optimizer step, the callbacks' per-step work, the data
    transfer and views drawn on the device) on the modelled ``gpu``, run by Lightning's Trainer as ``hfmca fit``
    runs it (:func:`traced_config`): the steps after the first, as many as one draw of the drawer serves
    (``ResidentDrawer(batches_per_call=8)``: 8, one draw among them; predictions are per step); ``overrides`` are
    merged into the config's ``model.init_args`` / ``trainer``."""
    from lightning.pytorch import Callback

    from hfmca_lightning.cli.trainer_cli import HFMCACLI
    from hfmca_lightning.data import SyntheticShapes

    config = yaml.safe_load(Path(config_path).read_text())
    for section, values in (overrides or {}).items():
        target = config.setdefault(section, {})
        (target.setdefault("init_args", {}) if "class_path" in target else target).update(values)
    # The heatmap callback draws once per epoch, not in a step (and reads its images on the host when fitting starts)
    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    trainer["callbacks"] = [c for c in callbacks if "Heatmap" not in str((c or {}).get("class_path", ""))]
    config["trainer"] = trainer
    if drop_internal:
        config["model"]["init_args"].pop("internal_costs", None)
    steps = _steps_per_draw(config)
    traced = traced_config(config, steps=1 + steps, spare=steps + 1)
    trace = Trace(gpu, steps=steps)
    source = SyntheticShapes(**traced["data"]["init_args"]["source"]["init_args"])  # real images, on the host

    with tracing(gpu) as live:

        class Recording(Callback):
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == 0:
                    live.start()
                elif batch_idx == steps:
                    live.stop(trace)
                    raise _Traced

        with _quiet(), tempfile.TemporaryDirectory() as run_folder:
            traced["trainer"]["default_root_dir"] = run_folder  # (the CLI writes its config.yaml there)
            cli = HFMCACLI(args=traced, run=False)
            live.phases.modules.update(modules_by_phase(cli.model, MODULE_PHASES))
            _draw_on_host(cli.datamodule, source)
            cli.trainer.callbacks.append(Recording())
            with contextlib.suppress(_Traced):
                cli.trainer.fit(cli.model, cli.datamodule)
    if not trace.operations:
        raise RuntimeError(f"{config_path}: the traced step ran no operation (did training stop early?)")
    return trace


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """Real tensors, and a ``torch.cuda`` that says there is no GPU (a data loader's work, which runs on the host)."""
    with _disable_current_modes(), mock.patch.object(torch.cuda, "is_available", lambda: False):
        yield


class _HostLoader:
    """A data loader whose batches are made on the host, outside the fake tensors: real CPU work that the step then
    copies to the modelled GPU (as a data loader's batches reach ``transfer_batch_to_device``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        with _on_host():
            iterator = iter(self.loader)
        while True:
            with _on_host():
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch


def _draw_on_host(datamodule: Any, source: Any) -> None:
    """Give ``datamodule`` the real ``source`` and do its host work on real tensors: the splits and the training
    batches (the data loader) outside the fake tensors, the data a drawer keeps on the device (``ResidentDrawer``)
    moved to the modelled GPU, and the views of device drawers drawn there, in the step."""
    setup, train_dataloader = datamodule.setup, datamodule.train_dataloader
    datamodule.source = source
    making_loader = [False]

    def host_setup(*args: Any, **kwargs: Any) -> Any:
        trainer, datamodule.trainer = datamodule.trainer, None
        try:
            with _disable_current_modes():
                setup(*args, **kwargs)
        finally:
            datamodule.trainer = trainer
        if not making_loader[0]:  # (the loader sets up again, on the host)
            datamodule.drawer.prepare(datamodule.training_split, torch.device("cuda"))

    def host_train_dataloader() -> Any:
        making_loader[0] = True
        try:
            with _on_host():
                return _HostLoader(train_dataloader())
        finally:
            making_loader[0] = False

    datamodule.setup, datamodule.train_dataloader = host_setup, host_train_dataloader


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's banners, model summary and progress bar, away from the table."""
    sink = io.StringIO()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


ROW_SETTINGS = {"plain": {}, "channels_last": {"channels_last": True}}
ROW_KINDS = {"backbone alone": (False, False), "external": (False, True), "external + internal": (True, True)}


def trace_rows(
    gpu: GPUSpec,
    build: Callable[..., Any],
    training_step: Callable[..., Callable[[], None]],
    backbone: str = "resnet18",
    batch_size: int = 64,
    views: int = 9,
    image_size: int = 32,
    build_options: dict[str, Any] | None = None,
    update: bool | None = None,
) -> dict[str, Trace]:
    """The training-step rows of ``make gpu-check`` (backbone alone, external, external + internal; plain and
    channels-last; bf16 autocast), each traced on its second step. ``build`` and ``training_step`` are those of the
    ``benchmarks/throughput.py`` of the code traced (so a checkout of an older commit traces its own rows);
    ``update``: pass ``update=`` to ``training_step`` (the optimizer step; ``None``: not passed)."""
    traces: dict[str, Trace] = {}
    autocast = _autocast()
    for kind, (internal, cost) in ROW_KINDS.items():
        for setting, options in ROW_SETTINGS.items():
            with tracing(gpu) as live:
                module = build(backbone, views, internal, **options, **(build_options or {})).to("cuda").train()
                live.phases.modules.update(modules_by_phase(module, MODULE_PHASES))
                batch = torch.randn(batch_size, views, 3, image_size, image_size, device="cuda")
                extra = {} if update is None else {"update": update}
                step = training_step(module, batch, cost, autocast, **extra)
                step()
                with live.record() as trace:
                    step()
            traces[f"{kind}: {setting}"] = trace
    return traces


def trace_rows_of_checkout(gpu: GPUSpec, **sizes: Any) -> dict[str, Trace]:
    """:func:`trace_rows` with the ``build`` and ``training_step`` of the ``benchmarks/throughput.py`` on the import
    path (``roofline.py --code`` puts a checkout's there): its own rows, with the optimizer update where its
    ``training_step`` has one (as its ``make gpu-check`` timed them); ``sizes`` as :func:`trace_rows` takes them."""
    import throughput

    update = True if "update" in inspect.signature(throughput.training_step).parameters else None
    return trace_rows(gpu, throughput.build, throughput.training_step, update=update, **sizes)


class _autocast:
    """``torch.autocast("cuda", bfloat16)``, made anew at each entry (the rows' steps enter it every step)."""

    def __enter__(self) -> None:
        self._context = torch.autocast("cuda", dtype=torch.bfloat16)
        self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)
