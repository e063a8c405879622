"""The stable public names of docs/conventions.md §7 exist with the documented signatures, the public API of the
losses, analysis, data and callbacks packages is documented in one docstring template, and every qualified reference
in the package's docstrings names something that exists."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from hfmca_lightning.analysis import eigenspectrum
from hfmca_lightning.cli import main
from hfmca_lightning.data import MultiViewDataModule
from hfmca_lightning.losses import HFMCACost, hfmca_cost


def test_spec_signatures():
    cost = inspect.signature(hfmca_cost)
    assert cost.parameters["reg"].kind is inspect.Parameter.KEYWORD_ONLY and cost.parameters["reg"].default == 0.1
    assert cost.parameters["sync_dist"].default is False
    module = inspect.signature(HFMCACost)
    assert [module.parameters[name].default for name in ("reg", "beta", "sync_dist")] == [0.1, 0.0, False]
    spectrum = inspect.signature(eigenspectrum)
    assert (
        spectrum.parameters["reg"].kind is inspect.Parameter.KEYWORD_ONLY and spectrum.parameters["reg"].default == 0.1
    )
    assert "source" in inspect.signature(MultiViewDataModule).parameters


def test_console_script_points_at_cli_main():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["hfmca"] == "hfmca_lightning.cli:main"


def test_help_mentions_the_analysis_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "hfmca analyze --help" in out and "fit" in out


DOCSTRING_PACKAGES = ("losses", "analysis", "data", "callbacks")


def public_callables() -> list[tuple[str, object]]:
    """Every function and class in the ``__all__`` of the packages whose docstrings follow the API template
    (constants and type aliases are skipped)."""
    found = []
    for package in DOCSTRING_PACKAGES:
        module = importlib.import_module(f"hfmca_lightning.{package}")
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                found.append((f"{package}.{name}", value))
    return found


def section(doc: str, title: str) -> str | None:
    """The indented body of a Google-style section (``Args:``, ``Returns:``, ...), or None if there is none."""
    match = re.search(rf"^{title}:[ \t]*\n((?:[ \t]+.*\n?|[ \t]*\n)*)", doc, re.M)
    return match.group(1) if match else None


def documented_arguments(doc: str) -> set[str]:
    """The names of the entries ``name: ...`` or ``name (type): ...`` of a docstring's ``Args:`` section."""
    return set(re.findall(r"^ {4}(\w+)(?: \([^)]*\))?:", section(doc, "Args") or "", re.M))


def named_parameters(function: object) -> list[str]:
    """The parameters a docstring names: all but ``self``, ``*args`` and ``**kwargs``."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    return [p.name for p in parameters if p.name != "self" and p.kind not in variadic]


@pytest.mark.parametrize(("name", "value"), public_callables(), ids=[name for name, _ in public_callables()])
def test_public_docstrings_follow_the_template(name: str, value: object):
    assert value.__doc__, f"{name} has no docstring"
    doc = inspect.cleandoc(value.__doc__)
    if inspect.isclass(value):
        init = value.__init__
        parameters = named_parameters(init) if inspect.isfunction(init) else []
    else:
        parameters = named_parameters(value)
        returned = inspect.signature(value).return_annotation  # type: ignore[arg-type]
        if returned not in (None, "None"):
            assert section(doc, "Returns") is not None, f"{name} returns {returned} but has no Returns: section"
    if parameters:
        assert section(doc, "Args") is not None, f"{name} takes {parameters} but has no Args: section"
        missing = [parameter for parameter in parameters if parameter not in documented_arguments(doc)]
        assert missing == [], f"{name}: Args: does not name {missing}"


CONFIGURABLE_PACKAGES = ("data", "losses", "callbacks", "methods", "methods.baselines", "models", "loggers")


def configurable_classes() -> list[tuple[str, type]]:
    """Every class of the package that a config names by ``class_path`` (the ``__all__`` of the packages above)."""
    found = []
    for package in CONFIGURABLE_PACKAGES:
        module = importlib.import_module(f"hfmca_lightning.{package}")
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and value.__module__.startswith("hfmca_lightning"):
                found.append((f"{package}.{name}", value))
    return found


@pytest.mark.parametrize(("name", "value"), configurable_classes(), ids=[name for name, _ in configurable_classes()])
def test_every_option_a_config_can_set_has_its_own_help_line(name: str, value: type) -> None:
    """``hfmca fit --help`` and ``--data.views.help SimCLRViews`` print each option's line from its class's ``Args:``
    entry as jsonargparse reads it (docstring_parser): an option without an entry of its own (``a, b: ...`` groups
    included) prints no description."""
    docstring_parser = pytest.importorskip("docstring_parser")
    parameters = named_parameters(value.__init__) if inspect.isfunction(value.__init__) else []  # object's: none
    described = {param.arg_name: param.description for param in docstring_parser.parse(value.__doc__ or "").params}
    missing = [parameter for parameter in parameters if not described.get(parameter)]
    assert missing == [], f"{name}: no help line for {missing}"


def test_a_view_specs_help_describes_each_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--data", "hfmca_lightning.data.MultiViewDataModule", "--data.views.help", "SameClassViews"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--views.count COUNT images per group." in out
    assert "--views.blur BLUR, --views.blur+ BLUR as :class:`SimCLRViews`. (type:" in out


@pytest.mark.parametrize(
    "command", ["fit", "validate", "test", "analyze", "compare", "linear", "knn", "export", "dashboard"]
)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/getting-started.md: every subcommand has --help; fit's lists every option with its type and default."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0 and re.match(rf"usage: \S+ (\[options\] )?{command} ", out), out[:200]
    if command == "fit":
        assert "--trainer.max_epochs MAX_EPOCHS" in out and "(type: Optional[int], default: null)" in out


REFERENCE = re.compile(r":(?:func|class|meth|mod|attr|data|exc):`~?(hfmca_lightning(?:\.\w+)+)`")


def _resolves(target: str) -> bool:
    """Whether a dotted name is a module of the package or an attribute path under one."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def test_every_qualified_reference_in_the_package_names_something_that_exists():
    """``:func:`hfmca_lightning...``` and its kind in any docstring or comment resolve to a module, class, function,
    method or attribute of today's package (a renamed or moved target leaves a stale reference)."""
    import pkgutil

    import hfmca_lightning

    broken = []
    for module_info in pkgutil.walk_packages(hfmca_lightning.__path__, "hfmca_lightning."):
        module = importlib.import_module(module_info.name)
        for target in sorted(set(REFERENCE.findall(inspect.getsource(module)))):
            if not _resolves(target):
                broken.append(f"{module_info.name}: {target}")
    assert broken == []
