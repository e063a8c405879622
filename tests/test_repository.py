"""The repository stands on its own: what its files cite is in it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVENTIONS = REPO / "docs" / "conventions.md"


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [
        REPO / name
        for name in names
        if name.endswith((".py", ".yaml", ".md", ".ipynb", ".toml")) and (REPO / name).is_file()
    ]


OUTSIDE = re.compile(r"\bSPEC\b|" + "shared" + "/")  # the project's brief lives outside the repository


def test_no_file_cites_documents_outside_the_repository():
    for path in tracked_text_files():
        assert not OUTSIDE.search(path.read_text()), (
            f"{path.relative_to(REPO)} cites a document that is not in the repository"
        )


def test_every_cited_convention_section_exists():
    sections = set(re.findall(r"^## (§\d+)", CONVENTIONS.read_text(), flags=re.M))
    assert sections == {f"§{n}" for n in range(1, 10)}
    cited = set()
    for path in tracked_text_files():
        cited |= set(re.findall(r"conventions\.md (§\d+)", path.read_text()))
        cited |= {f"§{n}" for n in re.findall(r"conventions\.md §\d+, §(\d+)", path.read_text())}
    assert cited and cited <= sections, cited - sections


def make_commands(target: str, *options: str) -> list[str]:
    """The commands ``make <target>`` runs (a dry run), the venv's install stamp taken as up to date unless asked."""
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")  # set when the suite itself runs under make
    env = {key: value for key, value in os.environ.items() if key not in outer}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *options, target],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return done.stdout.splitlines()


def test_the_make_targets_run_what_the_readme_says():
    up_to_date = ("-o", ".venv/.install-stamp")
    # make test: creates .venv, installs the package with its dev extra, runs the default suite (every test neither
    # slow nor extended)
    install = make_commands("test", "-W", "pyproject.toml")
    assert any("-m venv .venv" in line for line in install)
    assert any("pip install" in line and "-e '.[dev]'" in line for line in install)
    pytest_options = (REPO / "pyproject.toml").read_text()
    assert install[-1] == ".venv/bin/python -m pytest" and "-m 'not slow and not extended'" in pytest_options
    assert make_commands("test-fast", *up_to_date) == [
        '.venv/bin/python -m pytest -m "not slow and not extended and not integration"'
    ]
    assert make_commands("test-extended", *up_to_date) == ['.venv/bin/python -m pytest -m "extended and not slow"']
    assert make_commands("test-slow", *up_to_date) == [".venv/bin/python -m pytest -m slow"]
    assert make_commands("demo", *up_to_date) == [".venv/bin/hfmca fit --config configs/demo.yaml"]
    assert make_commands("notebooks", *up_to_date) == [".venv/bin/python tools/execute_notebooks.py"]
    # CI: "make lint typecheck docs are the other CI steps", then the README's test command and the extended runs
    steps = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert steps == ["make lint", "make typecheck", "make docs", "make test", "make test-extended"]
