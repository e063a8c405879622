"""Checkpoints and the configs stored in them come from others: every command that reads one loads tensors and plain
data only, and imports only classes of the trusted packages, or stops in one line before anything runs."""

from __future__ import annotations

import builtins
import os
from argparse import ArgumentError
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import DEMO, finish_hfmca, start_hfmca


class _WritesMarker:
    """Unpickled, calls ``open(marker, "w")``: a payload that leaves a file behind when it runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return builtins.open, (str(self.marker), "w")


def lightning_checkpoint(path: Path, extra: dict | None = None, config: str | None = None) -> Path:
    """A file with the keys of a Lightning checkpoint (what ``hfmca fit`` writes), optionally a stored config."""
    checkpoint = {"state_dict": {}, "pytorch-lightning_version": "2.6.0", "epoch": 0, "global_step": 0}
    if config is not None:
        checkpoint["callbacks"] = {"StoredConfig": {"config": config}}
    torch.save({**checkpoint, **(extra or {})}, path)
    return path


def commands_reading(checkpoint: Path, out: Path) -> dict[str, list[str]]:
    """Every ``hfmca`` command that takes a checkpoint, given ``checkpoint``."""
    ckpt = str(checkpoint)
    return {
        "fit": ["fit", "--config", str(DEMO), "--ckpt_path", ckpt],
        "validate": ["validate", "--config", str(DEMO), "--ckpt_path", ckpt],
        "test": ["test", "--config", str(DEMO), "--ckpt_path", ckpt],
        "export": ["export", "--ckpt_path", ckpt, "--out", str(out / "export")],
        "analyze": ["analyze", "--ckpt_path", ckpt, "--out", str(out / "analysis")],
        "compare": ["compare", "--ckpt_a", ckpt, "--ckpt_b", ckpt, "--out", str(out / "compare")],
        "linear": ["linear", "--ckpt_path", ckpt, "--out", str(out / "linear"), "--device", "cpu"],
        "knn": ["knn", "--ckpt_path", ckpt, "--out", str(out / "knn"), "--device", "cpu"],
    }


def run_all(commands: dict[str, list[str]], cwd: Path) -> dict[str, tuple[int, list[str]]]:
    """Each command's exit status and the lines of its output, the commands started together."""
    started = {name: start_hfmca(cwd, *args, log_name=f"{name}.log") for name, args in commands.items()}
    results = {}
    for name, process in started.items():
        done = finish_hfmca(process, cwd, timeout=120, log_name=f"{name}.log")
        results[name] = (done.returncode, [line for line in done.stdout.splitlines() if line.strip()])
    return results


@pytest.mark.extended
def test_a_pickled_checkpoint_is_refused_by_every_command_and_its_payload_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    checkpoint = lightning_checkpoint(tmp_path / "evil.ckpt", {"hyper_parameters": _WritesMarker(marker)})
    assert not marker.exists()
    results = run_all(commands_reading(checkpoint, tmp_path), tmp_path)
    for name, (status, lines) in results.items():
        assert status == 2, (name, lines)
        assert lines == [lines[-1]] and lines[-1].startswith(f"hfmca: error: {checkpoint} is refused"), (name, lines)
        assert "pickled Python objects (io.open)" in lines[-1] and "could run any code" in lines[-1], (name, lines)
    assert not marker.exists()


@pytest.mark.extended
def test_a_stored_config_naming_a_class_outside_the_trusted_packages_is_refused_before_its_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class's module records its import in a file: it is never imported."""
    modules, marker = tmp_path / "modules", tmp_path / "imported"
    (modules / "recording_module").mkdir(parents=True)
    (modules / "recording_module" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\nclass Model:\n    pass\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")]))
    config = yaml.safe_load(DEMO.read_text())
    config["model"] = {"class_path": "recording_module.Model"}
    checkpoint = lightning_checkpoint(tmp_path / "stored.ckpt", config=yaml.safe_dump(config))
    shorthand = dict(config, model="recording_module.Model")  # jsonargparse's class_path shorthand
    short_checkpoint = lightning_checkpoint(tmp_path / "short.ckpt", config=yaml.safe_dump(shorthand))
    as_json = dict(config, model='{"class_path": "recording_module.Model"}')  # a string jsonargparse parses
    json_checkpoint = lightning_checkpoint(tmp_path / "json.ckpt", config=yaml.safe_dump(as_json))
    function = dict(config, model="recording_module.build")  # a callable's dotted name
    function_checkpoint = lightning_checkpoint(tmp_path / "function.ckpt", config=yaml.safe_dump(function))
    # a spec jsonargparse reads from a YAML string: a Mock (its `wraps` takes any value, which jsonargparse builds)
    # wrapping a shell command that would leave a file behind
    shell = config_with_views(yaml_string_payload(tmp_path / "shell-ran"))
    shell_checkpoint = lightning_checkpoint(tmp_path / "shell.ckpt", config=yaml.safe_dump(shell))
    plugins = dict(yaml.safe_load(DEMO.read_text()), trainer={"plugins": {"class_path": "torch.nn.Identity"}})
    plugin_checkpoint = lightning_checkpoint(tmp_path / "plugins.ckpt", config=yaml.safe_dump(plugins))
    commands = {
        name: args
        for name, args in commands_reading(checkpoint, tmp_path).items()
        if name not in ("fit", "validate", "test")  # these take the user's --config, not the stored one
    }
    commands["export (shorthand)"] = ["export", "--ckpt_path", str(short_checkpoint), "--out", str(tmp_path / "e2")]
    commands["analyze (plugins)"] = ["analyze", "--ckpt_path", str(plugin_checkpoint), "--out", str(tmp_path / "a2")]
    commands["knn (JSON string)"] = ["knn", "--ckpt_path", str(json_checkpoint), "--out", str(tmp_path / "k2")]
    commands["linear (function)"] = ["linear", "--ckpt_path", str(function_checkpoint), "--out", str(tmp_path / "l2")]
    commands["export (YAML string)"] = ["export", "--ckpt_path", str(shell_checkpoint), "--out", str(tmp_path / "e3")]
    results = run_all(commands, tmp_path)
    for name, (status, lines) in results.items():
        assert status == 2, (name, lines)
        assert lines == [lines[-1]] and "the config stored in the checkpoint is refused" in lines[-1], (name, lines)
        assert "pass it as your own with --config" in lines[-1], (name, lines)
    assert "model.class_path names 'recording_module.Model'" in results["export"][1][-1]
    assert "model names 'recording_module.Model', code outside" in results["export (shorthand)"][1][-1]
    assert "trainer.plugins names" in results["analyze (plugins)"][1][-1]
    assert "model.class_path names 'recording_module.Model'" in results["knn (JSON string)"][1][-1]
    assert "model names 'recording_module.build', code outside" in results["linear (function)"][1][-1]
    assert "data.init_args.views.class_path names 'unittest.mock.Mock'" in results["export (YAML string)"][1][-1]
    assert not marker.exists() and not (tmp_path / "shell-ran").exists()


def config_with_views(views: object) -> dict:
    config = yaml.safe_load(DEMO.read_text())
    config["data"]["init_args"]["views"] = views
    return config


def yaml_string_payload(marker: Path) -> str:
    return (
        "class_path: unittest.mock.Mock\ninit_args:\n  wraps:\n    class_path: subprocess.Popen\n"
        f"    init_args: {{args: 'touch {marker}', shell: true}}\n"
    )


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("class_path: recording_module.Model", "views.class_path names 'recording_module.Model'"),
        ("'unittest.mock.Mock'", "views names 'unittest.mock.Mock', code outside"),  # YAML unquotes it
        ("!!str unittest.mock.Mock", "views names 'unittest.mock.Mock', code outside"),
        ("views.yaml", "views.class_path names 'unittest.mock.Mock'"),  # a config file jsonargparse would read
        ("{absolute}", "views.class_path names 'unittest.mock.Mock'"),
        ("{nested}", "views.views.class_path names 'unittest.mock.Mock'"),  # relative to the file naming it
        ("{loop}", "views[1].class_path names 'unittest.mock.Mock'"),  # a file naming itself, then the payload
        ("/proc/self/status", "names '/proc/self/status', a device, pipe or system file"),  # /proc/kmsg would hang
        ("fifo", "names 'fifo', a device, pipe or system file"),
        (
            {"class_path": "hfmca_lightning.data.TransformViews", "init_args": {"transform": "'os.system'"}},
            "'os.system'",
        ),
    ],
    ids=[
        "YAML string",
        "quoted",
        "tagged",
        "relative file",
        "absolute file",
        "file in a file's folder",
        "file naming itself",
        "system file",
        "pipe",
        "nested quoted callable",
    ],
)
def test_every_form_jsonargparse_reads_a_class_from_is_checked(
    value: object, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jsonargparse reads a string given for a class or callable as YAML or as a config file's path: the check reads
    it the same way, before anything is imported."""
    from hfmca_lightning.cli.runs import run_config
    from hfmca_lightning.errors import ConfigurationError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "views.yaml").write_text(yaml_string_payload(tmp_path / "shell-ran"))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "outer.yaml").write_text("views: inner.yaml\n")
    (tmp_path / "folder" / "inner.yaml").write_text(yaml_string_payload(tmp_path / "shell-ran"))
    (tmp_path / "loop.yaml").write_text(f"[{tmp_path / 'loop.yaml'}, {tmp_path / 'views.yaml'}]\n")
    files = {
        "{absolute}": str(tmp_path / "views.yaml"),
        "{nested}": str(tmp_path / "folder" / "outer.yaml"),
        "{loop}": str(tmp_path / "loop.yaml"),
    }
    value = files.get(value, value) if isinstance(value, str) else value
    checkpoint = {"callbacks": {"StoredConfig": {"config": yaml.safe_dump(config_with_views(value))}}}
    with pytest.raises(ConfigurationError, match="the config stored in the checkpoint is refused") as refused:
        run_config(tmp_path / "stored.ckpt", checkpoint)
    assert named in str(refused.value)


def test_a_stored_config_is_built_importing_only_the_trusted_packages(tmp_path: Path) -> None:
    """The second guard, behind the check of the YAML: while a stored config is built, jsonargparse imports nothing a
    value names outside the trusted packages (here the check is passed by), and its settings are as before after."""
    from jsonargparse import _common

    from hfmca_lightning.cli.runs import trusted_imports_only
    from hfmca_lightning.cli.trainer_cli import HFMCACLI

    marker = tmp_path / "shell-ran"
    config = config_with_views(yaml_string_payload(marker))
    config["trainer"].update(logger=False, callbacks=[], enable_progress_bar=False)
    before = dict(_common.parsing_settings)
    with pytest.raises(ArgumentError, match="Importing 'unittest.mock.Mock' is not allowed"), trusted_imports_only():
        HFMCACLI(args=config, run=False)
    assert not marker.exists()
    assert _common.parsing_settings == before
    # a trusted stored config builds under it
    demo = yaml.safe_load(DEMO.read_text())
    demo["trainer"].update(logger=False, callbacks=[], enable_progress_bar=False)
    with trusted_imports_only():
        assert type(HFMCACLI(args=demo, run=False).model).__name__ == "HFMCAModule"


def test_the_configs_hfmca_fit_stores_are_trusted() -> None:
    """Every shipped config, as a stored config, passes the check (its classes come from the trusted packages)."""
    from hfmca_lightning.cli.runs import untrusted_config_problem

    for path in sorted(DEMO.parent.rglob("*.yaml")):
        assert untrusted_config_problem(yaml.safe_load(path.read_text())) is None, path.name


def test_a_stored_config_the_parser_refuses_is_one_line_naming_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where only the second guard refuses (the check of the YAML passed by), the command's error names the checkpoint,
    what would have been imported and the way out, as the first guard's does."""
    from hfmca_lightning.cli import runs
    from hfmca_lightning.errors import ConfigurationError

    marker = tmp_path / "shell-ran"
    checkpoint = lightning_checkpoint(
        tmp_path / "stored.ckpt", config=yaml.safe_dump(config_with_views(yaml_string_payload(marker)))
    )
    monkeypatch.setattr(runs, "untrusted_config_problem", lambda config: None)
    with pytest.raises(ConfigurationError) as refused:
        runs.load_run(checkpoint)
    message = str(refused.value)
    assert message.startswith(
        f"{checkpoint}: the config stored in the checkpoint is refused: it names 'unittest.mock.Mock'"
    )
    assert "pass it as your own with --config" in message and "\n" not in message
    assert not marker.exists()


def test_a_checkpoints_hyper_parameters_are_not_merged_into_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's CLI merges a ``--ckpt_path`` checkpoint's hyper-parameters over the config, importing the classes
    they name: ``hfmca validate`` takes the command's config only, and the named module is never imported."""
    from hfmca_lightning.cli import main
    from tests.helpers import tiny_overrides

    modules, marker = tmp_path / "modules", tmp_path / "imported"
    (modules / "recording_hparams").mkdir(parents=True)
    (modules / "recording_hparams" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\nclass Net:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(modules))
    hyper = {"_class_path": "recording_hparams.Net", "backbone": {"class_path": "recording_hparams.Net"}}
    checkpoint = lightning_checkpoint(tmp_path / "foreign.ckpt", {"hyper_parameters": hyper})
    with pytest.raises(SystemExit) as stopped:  # one line: the file holds no weights of the demo's model
        main(
            [
                "validate",
                "--config",
                str(DEMO),
                "--config",
                str(tiny_overrides(tmp_path)),
                "--ckpt_path",
                str(checkpoint),
            ]
        )
    assert stopped.value.code == 2 and not marker.exists()


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("torch.ops.load_library", "which loads code"),  # a data set's `loader`: each image file dlopen'ed
        ("torch.hub.load", "which loads code"),
        ("torchvision.io.read_file", "a function, not a class"),
        ("torch.float32", "a dtype, not a class"),
    ],
)
def test_a_stored_config_may_name_classes_only_and_none_that_load_code(tmp_path: Path, name: str, why: str) -> None:
    """The trusted packages hold routines that load native code or run what they are given: a stored config naming one
    (as a value or a class_path) is refused in one line; their classes pass."""
    from hfmca_lightning.cli.runs import run_config
    from hfmca_lightning.errors import ConfigurationError

    folder = {"class_path": "torchvision.datasets.DatasetFolder", "init_args": {"root": "data", "loader": name}}
    for source in (folder, {"class_path": name}):
        config = yaml.safe_load(DEMO.read_text())
        config["data"]["init_args"]["source"] = {
            "class_path": "hfmca_lightning.data.DatasetSource",
            "init_args": {"train": source},
        }
        checkpoint = {"callbacks": {"StoredConfig": {"config": yaml.safe_dump(config)}}}
        with pytest.raises(ConfigurationError, match="the config stored in the checkpoint is refused") as refused:
            run_config(tmp_path / "stored.ckpt", checkpoint)
        assert f"names '{name}', {why}" in str(refused.value)
    folder["init_args"]["loader"] = "torchvision.datasets.folder.default_loader"  # the default a full dump holds
    config = yaml.safe_load(DEMO.read_text())
    config["data"]["init_args"]["source"] = {
        "class_path": "hfmca_lightning.data.DatasetSource",
        "init_args": {"train": folder},
    }
    assert run_config(tmp_path / "stored.ckpt", {"callbacks": {"StoredConfig": {"config": yaml.safe_dump(config)}}})
