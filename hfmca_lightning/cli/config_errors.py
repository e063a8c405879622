"""One-line reports of configuration mistakes, naming the config key (``model.init_args.backbone.init_args.width``).

jsonargparse reports a bad value deep inside ``class_path`` / ``init_args`` nesting as an indented tree of
union alternatives, and a constructor that rejects its arguments as the same tree around the original
exception. These helpers reduce both to the key, the problem and, for an unknown key, the valid ones.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import traceback
from collections.abc import Iterator
from typing import Any

__all__ = ["describe_parser_error", "describe_instantiation_error"]

_PARSER_KEY = re.compile(r'^-?\s*Parser key "([^"]+)":\s*(.*)$')
_CLASS_PATH = re.compile(r"^-?\s*Problem with given class_path '([^']+)':$")
_UNKNOWN_OPTION = re.compile(r"^Option '([^']+)' is not accepted$")
_NOT_IMPORTABLE = re.compile(r"^(?:module '[\w.]+' has no attribute '\w+'|No module named '[\w.]+')$")
_UNRECOGNISED = re.compile(r"^(?:unrecognized arguments: --|Subcommand '\w+' does not accept option ')([\w.\[\]-]+)")
_CALLABLE = re.compile(r"^-?\s*Type .+ expects a function or a callable class: (.*)$")
_CALLABLE_CLASS = re.compile(r"Got value: Namespace\(class_path='([^']+)'")
_GOT_NAMESPACE = re.compile(r"\.? Got value: Namespace\(.*$")
_EXPECTED_TYPE = re.compile(r"^-?\s*Expected an? <class '([\w.]+)'>")
_GIVEN_VALUE = re.compile(r"(?:Given|Got) value: (.*)$")
_GIVEN_STRING = re.compile(r"^Given value: ([\w.]+)$")
_NO_CLASS_PATH = re.compile(r"^Dict must include a class_path")
# jsonargparse first tries a string for a class-typed key as a config file; the line after says why it is no class
_NOT_A_PATH = re.compile(r"^-\s*Expected a path but [\w.]+ either not accessible or invalid$")
_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value",
    "- Expected a <class 'NoneType'>",
)
_MAX_LISTED = 12


def describe_parser_error(message: str) -> str:
    """One line from a jsonargparse parse error: ``<key>: <problem>`` (unknown keys: the close and valid ones)."""
    unrecognised = _UNRECOGNISED.match(message.strip())
    if unrecognised:
        key = unrecognised.group(1)
        parent, _, name = key.rpartition(".")
        return _unknown_key(parent, name, _parameters_of("lightning.pytorch.Trainer") if parent == "trainer" else [])
    path: list[str] = []
    class_path: str | None = None
    leaf = message.strip().splitlines()[-1].strip() if message.strip() else message
    lines = message.splitlines()
    for index, raw in enumerate(lines):
        line = raw.strip()
        if not line or line.startswith(_NOISE) or line.removeprefix("- ").startswith(_NOISE) or _NOT_A_PATH.match(line):
            continue
        if match := _CALLABLE.match(line):
            indent = len(raw) - len(raw.lstrip())
            nested: list[str] = []
            for inner in lines[index + 1 :]:
                if inner.strip() and len(inner) - len(inner.lstrip()) <= indent:
                    break
                nested.append(inner.strip())
            given = [found.group(1) for inner in lines[index + 1 :] if (found := _GIVEN_STRING.match(inner.strip()))]
            return _describe_callable(".".join(path), match.group(1), nested, given[0] if given else None)
        if match := _PARSER_KEY.match(line):
            path.append(match.group(1))
            class_path = None
            if match.group(2):
                leaf = match.group(2)
                break
            continue
        if match := _CLASS_PATH.match(line):
            class_path = match.group(1)
            path.append("init_args")
            continue
        leaf = line.removeprefix("- ")
        break
    if class_path and path[-1:] == ["init_args"] and _NOT_IMPORTABLE.match(leaf):
        return f"{'.'.join(path[:-1])}: class_path {class_path} names no class ({leaf})"
    key = ".".join(path)
    if match := _UNKNOWN_OPTION.match(leaf):
        return _unknown_key(key, match.group(1), _parameters_of(class_path) if class_path else [], class_path)
    return f"{key}: {leaf}" if key else leaf


def _describe_callable(key: str, problem: str, nested: list[str], given: str | None = None) -> str:
    """``<key>.init_args.<name>: <problem>`` for a key typed as a callable given by ``class_path`` / ``init_args``
    (an optimizer, a learning-rate schedule; its first parameter, the parameters or the optimizer, is not
    configured); ``given``: the class path given as a plain string."""
    found = _CALLABLE_CLASS.search("\n".join([problem, *nested]))
    class_path = found.group(1) if found else None
    problem = _GOT_NAMESPACE.sub("", problem.strip())
    if match := _PARSER_KEY.match(problem):
        return f"{key}.init_args.{match.group(1)}: {_readable_value_error([match.group(2), *nested])}"
    if match := _UNKNOWN_OPTION.match(problem):
        valid = _parameters_of(class_path)[1:] if class_path else []
        return _unknown_key(f"{key}.init_args", match.group(1), valid, class_path)
    if _NOT_IMPORTABLE.match(problem):
        return f"{key}: class_path {given + ' ' if given else ''}names no class ({problem})"
    if _NO_CLASS_PATH.match(problem):
        return f"{key}: init_args given without a class_path; set {key}.class_path (or `--{key} <class>`) first"
    return f"{key}: {problem}"


def _readable_value_error(lines: list[str]) -> str:
    """``expected a float, got 'abc'`` from jsonargparse's report of a value of the wrong type (a union's included);
    otherwise its first line."""
    expected: list[str] = []
    value: str | None = None
    first: str | None = None
    for raw in lines:
        line = _GOT_NAMESPACE.sub("", raw.strip())
        if not line or _NOT_A_PATH.match(line):
            continue
        if match := _EXPECTED_TYPE.match(line):
            if match.group(1) != "NoneType" and match.group(1) not in expected:
                expected.append(match.group(1))
        if match := _GIVEN_VALUE.search(line):
            value = match.group(1)
        if first is None and not line.startswith(_NOISE):
            first = line.removeprefix("- ")
    if expected:
        types = " or ".join(f"{'an' if name[0] in 'aeiou' else 'a'} {name}" for name in expected)
        return f"expected {types}" + (f", got {value!r}" if value is not None else "")
    return first or "invalid value"


def _unknown_key(parent: str, name: str, valid: list[str], class_path: str | None = None) -> str:
    where = f" of {class_path.rsplit('.', 1)[-1]}" if class_path else ""
    prefix = f"{parent}." if parent else ""
    text = f"unknown key {prefix}{name}{where}"
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        text += f"; did you mean {prefix}{close[0]}?"
    elif valid:
        text += "."
    if valid:
        listed = ", ".join(valid[:_MAX_LISTED]) + (", ..." if len(valid) > _MAX_LISTED else "")
        text += f" Valid keys here: {listed}"
    return text + " (`hfmca fit --help` lists all)."


def _parameters_of(class_path: str) -> list[str]:
    """Constructor parameters of ``class_path``, following ``**kwargs`` into base classes."""
    try:
        cls = _import(class_path)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", [cls]):
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names += [
            p.name
            for p in parameters
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in names
        ]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def describe_instantiation_error(error: BaseException, config: Any) -> str | None:
    """``<key>: <message>`` for a ``ValueError`` that a configured class raised in its constructor, the bare message
    for any other ``ValueError``, None for other errors (and for jsonargparse's report of a union's alternatives).

    jsonargparse chains its reports to the original exception (``__cause__``); the class is the innermost
    ``__init__`` on that exception's traceback whose class appears in ``config`` (the parsed subcommand
    config); a :class:`~hfmca_lightning.errors.ConfigurationError` with a ``parameter`` adds the argument.
    """
    inner = error
    while inner.__cause__ is not None:
        inner = inner.__cause__
    if not isinstance(inner, ValueError) or str(inner).startswith(_NOISE[0]):
        return None
    nodes = list(_class_nodes(config.as_dict() if hasattr(config, "as_dict") else config, ""))
    key = _raising_node(inner, nodes)
    parameter = getattr(inner, "parameter", None)
    if key is None:
        return str(inner)
    return f"{key}{'.init_args.' + parameter if parameter else ''}: {inner}"


def _class_nodes(node: Any, key: str) -> Iterator[tuple[str, type]]:
    """``(dotted key, class)`` of every ``class_path`` entry in a config, outermost first."""
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            try:
                yield key, _import(node["class_path"])
            except (ImportError, AttributeError, ValueError):
                pass
            node = {"init_args": node.get("init_args") or {}}
        for name, child in node.items():
            yield from _class_nodes(child, f"{key}.{name}" if key else name)
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from _class_nodes(child, f"{key}[{index}]")


def _raising_node(error: BaseException, nodes: list[tuple[str, type]]) -> str | None:
    """The config key of the innermost configured class whose ``__init__`` is on ``error``'s traceback."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    for frame in reversed(frames):
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if owner is None:
            continue
        for key, cls in nodes:
            if type(owner) is cls:
                return key
    return None
