"""The package's modules import each other without cycles, and dependencies point one way between layers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hfmca_lightning"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (top-level and function-level imports alike).

    ``from a.b import c`` imports ``a.b.c`` when that is a module, else ``a.b``; importing a module also runs
    the ``__init__`` of every package above it, which counts as an import unless the importer is inside it.
    """
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                )
        edges = set()
        for target in targets:
            if target not in modules:
                continue
            edges.add(target)
            parts = target.split(".")
            for depth in range(1, len(parts)):
                parent = ".".join(parts[:depth])
                if not (name == parent or name.startswith(parent + ".")):
                    edges.add(parent)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_anywhere_in_the_package():
    graph = import_graph()
    assert (
        "hfmca_lightning.cli.runs" in graph["hfmca_lightning.cli.analyze"]
        and "hfmca_lightning.cli.trainer_cli" in graph["hfmca_lightning.cli.runs"]
    )
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def within(name: str, layers: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``layers`` or inside one (``hfmca_lightning.evaluation_data`` is not inside
    ``hfmca_lightning.evaluation``)."""
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def reaching(graph: dict[str, set[str]], layers: tuple[str, ...], upper: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of ``layers`` that import a module of ``upper``, with what they import."""
    found = {}
    for name, targets in graph.items():
        if within(name, layers) and (up := sorted(t for t in targets if within(t, upper))):
            found[name] = up
    return found


def test_the_pure_maths_layers_do_not_reach_up():
    """losses/, analysis/ and evaluation/ are tensors in, tensors out: no Lightning modules, callbacks, data, run-time
    helpers or commands; models/ are plain modules: no Lightning modules, callbacks, data or commands."""
    graph = import_graph()
    pure = ("hfmca_lightning.losses", "hfmca_lightning.analysis", "hfmca_lightning.evaluation")
    upper = (
        "hfmca_lightning.methods",
        "hfmca_lightning.callbacks",
        "hfmca_lightning.data",
        "hfmca_lightning.evaluation_data",  # the data module's evaluation images and batches: above the data
        "hfmca_lightning.cli",
        "hfmca_lightning.runtime",
    )
    assert reaching(graph, pure, upper) == {}
    assert reaching(graph, ("hfmca_lightning.models",), upper[:5]) == {}


def test_only_the_commands_import_the_commands():
    """cli/ (the ``hfmca`` subcommands) is the top layer: nothing else imports it; runtime/ imports no layer above
    it."""
    graph = import_graph()
    outside = {
        name: sorted(t for t in targets if t.startswith("hfmca_lightning.cli"))
        for name, targets in graph.items()
        if not name.startswith("hfmca_lightning.cli")
    }
    assert {name: targets for name, targets in outside.items() if targets} == {}
    assert (
        reaching(
            graph,
            ("hfmca_lightning.runtime",),
            (
                "hfmca_lightning.methods",
                "hfmca_lightning.callbacks",
                "hfmca_lightning.data",
                "hfmca_lightning.evaluation_data",
                "hfmca_lightning.cli",
            ),
        )
        == {}
    )


def test_the_data_layer_imports_no_layer_above_it():
    """data/ (sources, view specs, drawers, the DataModule) serves any method: it imports no Lightning module,
    callback, command, model or loss, nor the evaluation helpers built on it."""
    graph = import_graph()
    upper = (
        "hfmca_lightning.methods",
        "hfmca_lightning.callbacks",
        "hfmca_lightning.cli",
        "hfmca_lightning.models",
        "hfmca_lightning.losses",
        "hfmca_lightning.evaluation_data",
    )
    assert reaching(graph, ("hfmca_lightning.data",), upper) == {}
