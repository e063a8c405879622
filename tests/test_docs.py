"""The documentation says what the code does: its tested examples run, every command and shipped config has its
page, and the API reference covers every public class."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import yaml

from tests.helpers import REPO

PAGES = sorted((REPO / "docs").rglob("*.md"))
TESTED_BLOCK = re.compile(r"<!-- tested -->\n```python\n(.*?)```", re.S)
COMMANDS = ("fit", "analyze", "compare", "linear", "knn", "export", "dashboard")
PUBLIC_PACKAGES = ("losses", "analysis", "evaluation", "models", "data", "methods", "callbacks")


def marked_examples() -> list[tuple[str, str]]:
    blocks = []
    for path in [REPO / "README.md", *PAGES]:
        for index, code in enumerate(TESTED_BLOCK.findall(path.read_text())):
            blocks.append((f"{path.relative_to(REPO)}#{index}", code))
    return blocks


@pytest.mark.parametrize(("where", "code"), marked_examples(), ids=[where for where, _ in marked_examples()])
def test_the_marked_examples_run(where: str, code: str, capsys):
    exec(compile(code, where, "exec"), {})


def test_there_are_tested_examples():
    assert len(marked_examples()) >= 3


def test_every_command_and_shipped_config_has_its_page():
    site = "\n".join(path.read_text() for path in PAGES)
    for command in COMMANDS:
        assert f"hfmca {command}" in site, command
    training = (REPO / "docs" / "training.md").read_text()
    missing = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "configs").glob("*.yaml"))
        if f"`{path.name}`" not in training
    ]
    assert missing == []
    baselines = (REPO / "docs" / "baselines.md").read_text()
    for path in sorted((REPO / "configs" / "baselines").glob("*.yaml")):
        method = path.name.split("_")[0]
        assert method in baselines.lower(), path.name


def test_the_site_lists_every_page_it_has():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def files(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [name for value in entry.values() for name in files(value)]
        return [name for item in entry for name in files(item)]

    listed = set(files(nav))
    assert {str(path.relative_to(REPO / "docs")) for path in PAGES} == listed


def documented_names() -> set[str]:
    """Names the API pages render: each ``::: module`` directive's ``members`` list, or every public name of the
    module when it has none."""
    names: set[str] = set()
    for page in sorted((REPO / "docs" / "api").glob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.M):
            module = importlib.import_module(match.group(1))
            members = re.search(r"members: \[(.*?)\]", match.group(2))
            if members:
                names |= {name.strip() for name in members.group(1).split(",")}
            else:
                public = getattr(module, "__all__", None) or [name for name in vars(module) if not name.startswith("_")]
                names |= set(public)
    return names


def test_the_api_reference_covers_every_public_class():
    documented = documented_names()
    missing = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(f"hfmca_lightning.{package}")
        for name in module.__all__:
            if inspect.isclass(getattr(module, name)) and name not in documented:
                missing.append(f"{package}.{name}")
    baselines = importlib.import_module("hfmca_lightning.methods.baselines")
    missing += [f"baselines.{name}" for name in baselines.__all__ if name not in documented]
    assert missing == []


def test_headings_stand_on_their_own_lines():
    """A paragraph re-wrapped into the heading after it hides the section (``... text.## Mixed precision``)."""
    glued = []
    for page in [*PAGES, REPO / "README.md"]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        glued += [f"{page.name}: {line}" for line in prose.splitlines() if re.search(r"[^\s#]#{1,6} \w", line)]
    assert glued == []


def documented_trainer_commands() -> list[str]:
    """Every ``hfmca fit / validate / test`` line of the README's and the docs' shell blocks (line continuations
    joined, comments and the launcher before ``hfmca`` dropped), once each."""
    found: dict[str, None] = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.search(r"(?:^|[\s/)])hfmca\)? ((?:fit|validate|test)\b.*)", line.split(" #")[0].strip())
                if command:
                    found[" ".join(command.group(1).split())] = None
    return list(found)


def test_there_are_documented_trainer_commands():
    assert len(documented_trainer_commands()) >= 10


@pytest.mark.parametrize("command", documented_trainer_commands())
def test_every_documented_trainer_command_parses(command: str, monkeypatch, capsys):
    """As a user types it (from the repository root): its config files, keys and values parse (``--print_config``:
    nothing is built or read), so a renamed key or config never stays in the docs."""
    import shlex

    from hfmca_lightning.cli import main

    monkeypatch.chdir(REPO)
    arguments = shlex.split(command)
    with pytest.raises(SystemExit) as exit_info:
        main(arguments if "--help" in arguments else [*arguments, "--print_config"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert out.strip(), command
