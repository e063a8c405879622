"""Where the commands write, as a user meets it (``hfmca`` as a subprocess): an ``--out`` that cannot be written or
already holds files is refused in one line with exit status 2 before any work (``--overwrite`` lets a command replace
its files); a full disk or a file size limit mid-way is one line naming the file, exit status 1, and leaves the
previous export, report or checkpoint exactly as it was."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hfmca_lightning.cli import main
from hfmca_lightning.cli.paths import check_config_files, read_config_file
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import DEMO, DEMO_TINY_MODEL, fit, run_hfmca, tiny_overrides

# A backbone of ~80 KB of weights: large enough that a limit below it leaves room for the command's own log.
WIDER_MODEL = copy.deepcopy(DEMO_TINY_MODEL)
WIDER_MODEL["init_args"]["backbone"]["init_args"]["width"] = 32  # 64 features
WIDER_MODEL["init_args"]["projector"]["init_args"]["input_dim"] = 64
ANALYZE_OPTIONS = ("--num_batches", "1", "--num_images", "2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained")
    fit(folder, model=WIDER_MODEL)
    return folder / "checkpoints" / "last.ckpt"


def command(name: str, checkpoint: Path, out: Path, *extra: str) -> list[str]:
    options = ANALYZE_OPTIONS if name == "analyze" else ("--device", "cpu")
    return [name, "--ckpt_path", str(checkpoint), "--out", str(out), *options, *extra]


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("hfmca: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stdout, result.stdout[-3000:]
    return lines[0]


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size, read_only=False) -> folder``: a real small file system mounted under ``tmp_path`` (skips where
    this process may not mount one: it needs root, or CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root and the mount command")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.extended
@pytest.mark.integration  # subprocess runs
@pytest.mark.parametrize("name", ["export", "analyze"])
def test_a_non_empty_out_is_refused_without_overwrite_and_replaced_with_it(checkpoint, tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused = run_hfmca(tmp_path, *command(name, checkpoint, out), log_name="refused.log", timeout=120)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert f"--out {out} already holds notes.txt; pass --overwrite to replace them" in one_error_line(refused)
    assert contents(out) == {"notes.txt": b"mine"}

    replaced = run_hfmca(tmp_path, *command(name, checkpoint, out, "--overwrite"), log_name="replaced.log")
    assert replaced.returncode == 0, replaced.stdout[-3000:]
    assert (out / "notes.txt").read_text() == "mine"  # files of others are left alone
    assert (out / ("backbone.json" if name == "export" else "index.html")).is_file()


@pytest.mark.integration  # subprocess runs
@pytest.mark.parametrize("name", ["export", pytest.param("analyze", marks=pytest.mark.extended)])
@pytest.mark.parametrize("where", ["under a file", "read-only folder", "read-only file system"])
def test_an_out_that_cannot_be_written_is_one_line_before_any_work(checkpoint, tmp_path, tmpfs, name, where):
    if where == "under a file":
        (tmp_path / "results").write_text("a file, not a folder")
        out = tmp_path / "results" / "export"
        expected = f"--out {out}: cannot create the folder: {out}: Not a directory (ENOTDIR); a part of the path is a "
    elif where == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder whatever its mode (the read-only file system case covers root)")
        out = tmp_path / "results"
        out.mkdir(mode=0o500)
        expected = f"--out {out}: cannot write there: {out}/"
    else:
        out = tmpfs("64k", read_only=True)
        expected = f"--out {out}: cannot write there: {out}/"
    result = run_hfmca(tmp_path, *command(name, checkpoint, out), timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert expected in one_error_line(result)
    assert "statistics of" not in result.stdout  # refused before any work


def exported(out: Path) -> dict[str, bytes]:
    """The export in ``out``, checked to be whole: the JSON's SHA-256 of each file it lists matches that file."""
    files = contents(out)
    description = json.loads(files["backbone.json"])
    assert description["sha256"] == {name: sha256(files[name]) for name in description["sha256"]}
    assert "backbone.pt" in description["sha256"]
    return files


@pytest.mark.integration  # subprocess runs
@pytest.mark.parametrize("limit", [pytest.param("file size limit", marks=pytest.mark.extended), "full file system"])
def test_a_full_disk_mid_export_is_one_line_and_keeps_the_previous_export(checkpoint, tmp_path, tmpfs, limit):
    out = tmpfs("256k") / "export" if limit == "full file system" else tmp_path / "export"
    main(command("export", checkpoint, out))
    before = exported(out)
    size_limit = None
    if limit == "full file system":
        filler = out.parent / "filler"
        free = os.statvfs(out).f_bavail * os.statvfs(out).f_frsize
        filler.write_bytes(b"\0" * (free - len(before["backbone.pt"]) // 2))  # half the weights fit
        code = "ENOSPC"
    else:
        size_limit = len(before["backbone.pt"]) // 2
        code = "EFBIG"
    result = run_hfmca(tmp_path, *command("export", checkpoint, out, "--overwrite"), file_size_limit=size_limit)
    assert result.returncode == 1, result.stdout[-3000:]
    line = one_error_line(result)
    assert f"hfmca: error: {out / 'backbone.pt'}: " in line and f"({code}); " in line
    assert exported(out) == before  # the same bytes, the JSON consistent with the weights, no partial file


@pytest.mark.extended
@pytest.mark.integration  # a subprocess run
def test_a_file_size_limit_mid_analysis_is_one_line_and_keeps_the_previous_report(checkpoint, tmp_path):
    out = tmp_path / "analysis"
    main(command("analyze", checkpoint, out))
    before = contents(out)
    limit = max(len(data) for data in before.values()) // 2  # the largest file cannot be written again
    result = run_hfmca(tmp_path, *command("analyze", checkpoint, out, "--overwrite"), file_size_limit=limit)
    assert result.returncode == 1, result.stdout[-3000:]
    line = one_error_line(result)
    assert f"hfmca: error: {out}/" in line and "(EFBIG); the file is larger than this process may write" in line
    assert contents(out) == before


@pytest.mark.integration  # subprocess runs
def test_a_file_size_limit_mid_fit_is_one_line_and_keeps_the_last_checkpoint(checkpoint, tmp_path):
    """A resumed run whose next checkpoint cannot be written: one line, exit status 1, ``last.ckpt`` as it was."""
    (tmp_path / "checkpoints").mkdir()
    last = tmp_path / "checkpoints" / "last.ckpt"
    shutil.copyfile(checkpoint, last)  # the trained run, after its first epoch
    before = last.read_bytes()
    overrides = tiny_overrides(tmp_path, model=WIDER_MODEL, **{"trainer.max_epochs": 2})
    args = ["fit", "--config", str(DEMO), "--config", str(overrides), "--ckpt_path", "last"]
    result = run_hfmca(tmp_path, *args, file_size_limit=len(before) // 2)
    assert result.returncode == 1, result.stdout[-3000:]
    line = one_error_line(result)
    assert f"hfmca: error: {tmp_path / 'checkpoints'}/" in line and "(EFBIG); " in line
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["global_step"] == 4


def test_a_missing_config_file_is_one_line(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command("export", checkpoint, tmp_path / "out"), "--config", str(tmp_path / "run.yaml")])
    assert exit_info.value.code == 2
    assert f"hfmca: error: --config {tmp_path / 'run.yaml'}: no such file; check the path" in capsys.readouterr().err


BAD_CONFIGS = {
    "empty": (b"", "is empty, not a mapping of settings"),
    "a list": (b"- model\n", "is a list, not a mapping of settings"),
    "a tab": (b"trainer:\n\tmax_epochs: 1\n", "is not valid YAML at line 2, column 1: found character '\\t'"),
    "not text": (b"\xff\xfe", "is not a text file (UTF-8)"),
    "a key twice": (
        b"trainer:\n  max_epochs: 1\nmodel: {}\ntrainer:\n  max_epochs: 2\n",
        "is not valid YAML at line 4, column 1: the key 'trainer' is given twice in one mapping",
    ),
}


@pytest.mark.parametrize(("contents", "message"), BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
@pytest.mark.parametrize("name", ["fit", "knn", "dashboard"])
def test_a_config_file_that_is_no_yaml_mapping_is_one_line(tmp_path, capsys, contents, message, name):
    """``--config`` of ``fit`` (read by jsonargparse), of the evaluation commands (a checkpoint's run) and of
    ``dashboard``: one line naming the file and what is wrong with it, exit status 2, nothing trained or read."""
    config = tmp_path / "bad.yaml"
    config.write_bytes(contents)
    arguments = {
        "fit": ["fit", "--config", str(config)],
        "knn": ["knn", "--ckpt_path", str(tmp_path / "run.ckpt"), "--out", str(tmp_path), "--config", str(config)],
        "dashboard": ["dashboard", "--entity", "e", "--project", "p", "--config", str(config), "--dry-run"],
    }[name]
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.splitlines()[-1].startswith(f"hfmca: error: --config {config} {message}"), err
    assert "Traceback" not in err


def test_configs_jsonargparse_reads_are_not_refused(tmp_path: Path) -> None:
    """A JSON config with tab indentation (which YAML refuses) and an inline YAML string longer than a file name are
    read as jsonargparse reads them; a bad file given by -c is refused like one given by --config."""
    tabbed = tmp_path / "tabbed.json"
    tabbed.write_text('{\n\t"trainer": {\n\t\t"max_epochs": 1\n\t}\n}\n')
    assert read_config_file(tabbed) == {"trainer": {"max_epochs": 1}}
    inline = "{trainer: {max_epochs: 1, default_root_dir: " + "x" * 300 + "}}"
    check_config_files(["fit", "--config", str(tabbed), "--config", inline])
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigurationError, match="^-c .*empty.yaml is empty"):
        check_config_files(["fit", "-c", str(tmp_path / "empty.yaml")])
