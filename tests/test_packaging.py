"""pyproject.toml declares every distribution the package imports: those a module imports when it loads as
dependencies, those imported only where a feature needs them (in a function, or in a ``try`` that handles their
absence) as dependencies or a user extra; with lower bounds only."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hfmca_lightning"

# Import names whose distribution is named otherwise; any other is its own distribution's name.
DISTRIBUTIONS = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "sklearn": "scikit-learn",
    "cv2": "opencv-python",
    "wandb_workspaces": "wandb-workspaces",
}
TOOL_EXTRAS = ("dev", "docs")  # what the project's own tooling needs, not a feature of the package
MISSING_MODULE_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def normalised(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(import_name: str) -> str:
    return normalised(DISTRIBUTIONS.get(import_name, import_name))


def handles_missing_module(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in MISSING_MODULE_ERRORS for name in names)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(node: ast.AST, at_load: bool = True) -> Iterator[tuple[str, bool]]:
    """``(top-level name, imported when the module loads)`` of every absolute import under ``node``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        at_load = False
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for statement in node.orelse:
            yield from imports(statement, at_load)
        return
    elif isinstance(node, ast.Try) and any(handles_missing_module(handler) for handler in node.handlers):
        for statement in node.body:
            yield from imports(statement, False)
        for part in [*node.handlers, *node.orelse, *node.finalbody]:
            yield from imports(part, at_load)
        return
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name.partition(".")[0], at_load
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        yield node.module.partition(".")[0], at_load
    for child in ast.iter_child_nodes(node):
        yield from imports(child, at_load)


def third_party_imports() -> dict[str, dict[str, bool]]:
    """``{import name: {module file: imported when it loads}}`` over every module of the package."""
    found: dict[str, dict[str, bool]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, at_load in imports(ast.parse(path.read_text(), str(path))):
            if name in sys.stdlib_module_names or name == "hfmca_lightning":
                continue
            files = found.setdefault(name, {})
            files[str(path.relative_to(REPO))] = files.get(str(path.relative_to(REPO)), False) or at_load
    return found


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return normalised(match.group(1))


@pytest.fixture(scope="module")
def project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_imported_distribution_is_declared(project):
    required = {requirement_name(requirement) for requirement in project["dependencies"]}
    optional = {
        requirement_name(requirement)
        for extra, requirements in project["optional-dependencies"].items()
        if extra not in TOOL_EXTRAS
        for requirement in requirements
    }
    found = third_party_imports()
    assert {"torch", "lightning", "PIL", "yaml", "tqdm", "timm"} <= set(found)  # the scan sees the package
    undeclared = []
    for name, files in sorted(found.items()):
        loading = sorted(file for file, at_load in files.items() if at_load)
        if loading and distribution(name) not in required:
            undeclared.append(f"{distribution(name)} (imported when {loading[0]} loads): not in dependencies")
        elif distribution(name) not in required | optional:
            undeclared.append(f"{distribution(name)} (imported in {sorted(files)[0]}): in no dependency or extra")
    assert undeclared == []


def test_the_import_names_map_to_the_installed_distributions():
    """The table of import names is checked against the metadata of whatever is installed."""
    installed = importlib.metadata.packages_distributions()
    for name in third_party_imports():
        if name in installed:
            assert distribution(name) in {normalised(found) for found in installed[name]}, name


def test_requirements_have_lower_bounds_only(project):
    requirements = [
        *project["dependencies"],
        *(
            requirement
            for requirements in project["optional-dependencies"].values()
            for requirement in requirements
            if requirement_name(requirement) != normalised(project["name"])
        ),
    ]
    for requirement in requirements:
        constraints = re.findall(r"(<=|>=|==|~=|!=|<|>)", requirement.split(";")[0])
        assert constraints == [">="], requirement


def test_the_oldest_python_it_names_is_the_one_its_checks_use(project):
    """docs/getting-started.md: "Python 3.10 or newer". The oldest Python the package admits is the one ruff lints
    for and mypy checks the standard library's API against (`make lint typecheck`, in CI), and, where a Python 3.10
    is on the PATH, every module of the package parses under it."""
    tomllib = pytest.importorskip("tomllib")
    tools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    assert project["requires-python"] == ">=3.10"
    assert (tools["ruff"]["target-version"], tools["mypy"]["python_version"]) == ("py310", "3.10")
    assert "Python 3.10 or newer" in (REPO / "docs" / "getting-started.md").read_text()
    python310 = shutil.which("python3.10")
    if python310 is None:
        return
    parse_all = (
        "import ast, pathlib, sys; [ast.parse(p.read_text(), str(p)) for p in pathlib.Path(sys.argv[1]).rglob('*.py')]"
    )
    done = subprocess.run(
        [python310, "-c", parse_all, str(PACKAGE)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYENV_VERSION": "3.10"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
