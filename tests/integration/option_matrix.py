"""The options a user sets, crossed pairwise: a covering array (every pair of levels of every two options in a case
that trains, or, for a pair the project refuses, in a case of its own), each case a tiny ``hfmca fit`` of the demo
whose checkpoint then goes through ``analyze``, ``compare``, ``export`` and ``linear``, or a one-line refusal before
training. The data are two options: the view spec (what the views are) and the drawer (where they are drawn).

A new option is one entry of :data:`OPTIONS` (its levels and what each sets); a combination the project refuses is one
entry of :data:`REFUSED` (when, and the line it gets), which docs/training.md lists.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Overrides = dict[str, Any]  # dotted config keys -> values (tests.helpers.tiny_overrides)

_TINY_INTERNAL = {
    "class_path": "hfmca_lightning.methods.InternalCosts",
    "init_args": {"layers": ["features.0", "features.1"], "reg": 0.1},
}


def _callback(class_path: str, **init_args: Any) -> dict:
    return {"class_path": class_path, "init_args": init_args}


CALLBACKS = {
    "knn": _callback("hfmca_lightning.callbacks.KNNEvaluation", k=10),
    "probe": _callback("hfmca_lightning.callbacks.LinearProbe"),
    "spectra": _callback("hfmca_lightning.callbacks.EigenspectrumCallback", every_n_steps=1, top_k=3, min_groups=8),
    "heatmaps": _callback(
        "hfmca_lightning.callbacks.DensityRatioHeatmapCallback", num_images=2, statistics_images=8, every_n_epochs=1
    ),
}

# what the views are (the demo's: 4 SimCLR views) and where they are drawn (the demo's: torchvision in the workers)
VIEWS = {
    "simclr": None,
    "multicrop": {"class_path": "hfmca_lightning.data.MultiCrop", "init_args": {"global_crops": 2, "local_crops": 2}},
    "sameclass": {"class_path": "hfmca_lightning.data.SameClassViews", "init_args": {"count": 4}},
}
DRAWERS = {
    "torchvision": None,
    "batched": {"class_path": "hfmca_lightning.data.BatchedDrawer"},
    "device": {"class_path": "hfmca_lightning.data.BatchedDrawer", "init_args": {"on": "device"}},
    "resident": {"class_path": "hfmca_lightning.data.ResidentDrawer", "init_args": {"batches_per_call": 2}},
}

# option -> level -> what it sets: config keys, or the run's ``processes``, ``kill`` or ``callback``
OPTIONS: dict[str, dict[str, Overrides]] = {
    "accumulate": {"acc1": {}, "acc2": {"trainer.accumulate_grad_batches": 2}},
    "precision": {
        "fp32": {},
        "bf16": {"trainer.precision": "bf16-mixed"},
        "fp64": {"trainer.precision": "64-true"},
    },
    "views": {name: {} if spec is None else {"data.init_args.views": spec} for name, spec in VIEWS.items()},
    "drawer": {name: {} if drawer is None else {"data.init_args.drawer": drawer} for name, drawer in DRAWERS.items()},
    "compile": {"eager": {}, "compiled": {"model.init_args.compile_costs": "aot_eager"}},
    "internal": {"external": {}, "internal": {"model.init_args.internal_costs": _TINY_INTERNAL}},
    "beta": {
        "beta0": {},
        "beta.5": {
            "model.init_args.external_cost": {
                "class_path": "hfmca_lightning.losses.HFMCACost",
                "init_args": {"reg": 0.1, "beta": 0.5, "name": "external"},
            }
        },
    },
    "callback": {name: {"callback": callback} for name, callback in CALLBACKS.items()},
    "processes": {"1proc": {}, "ddp": {"processes": 2}},
    "kill": {"straight": {}, "killed": {"kill": True}},
}


@dataclass(frozen=True)
class Refusal:
    """A combination refused before training: ``when`` a case (or part of one: a level not yet chosen is missing)
    has it, the one line says ``message`` (a regex)."""

    when: Callable[[dict[str, str]], bool]
    message: str
    reason: str


REFUSED: list[Refusal] = [
    Refusal(
        lambda case: case.get("callback") == "heatmaps" and case.get("internal") == "external",
        r"DensityRatioHeatmapCallback draws the density ratios of internal cost pairs",
        "density-ratio heatmaps propagate the decompositions of internal pairs (paper Alg. 5); a run with the external "
        "cost only has none (`hfmca analyze` draws them for any checkpoint, through the backbone's stages)",
    ),
    Refusal(
        lambda case: case.get("drawer", "torchvision") != "torchvision" and case.get("views", "simclr") != "simclr",
        r"data\.init_args\.drawer: (BatchedDrawer|ResidentDrawer) draws SimCLRViews only; (MultiCrop|SameClassViews) "
        r"is drawn by TorchvisionDrawer",
        "`BatchedDrawer` and `ResidentDrawer` draw the SimCLR views of one image for a whole batch at once; multi-crop "
        "and same-class views are drawn image by image by `TorchvisionDrawer`",
    ),
]


def refusal(case: dict[str, str]) -> Refusal | None:
    return next((rule for rule in REFUSED if rule.when(case)), None)


def covering_array(options: dict[str, dict[str, Overrides]], seed: int = 0) -> list[dict[str, str]]:
    """Cases (option -> level) in which every pair of levels of every two options that can train together appears
    in a case that trains, and every refused pair in one case of its own (the other options at their first level:
    the refusal alone is checked): greedy (each case starts from a pair not yet covered and adds, option by option,
    the level that covers the most new pairs without making the case refused), deterministic for a seed."""
    names = list(options)
    levels = {name: list(options[name]) for name in names}
    pairs = [(a, x, b, y) for a, b in itertools.combinations(names, 2) for x in levels[a] for y in levels[b]]
    refused_pairs = [pair for pair in pairs if refusal({pair[0]: pair[1], pair[2]: pair[3]}) is not None]
    uncovered = set(pairs) - set(refused_pairs)
    rng = random.Random(seed)
    cases: list[dict[str, str]] = []
    while uncovered:
        a, x, b, y = min(uncovered)
        case = {a: x, b: y}
        rest = [name for name in names if name not in case]
        rng.shuffle(rest)
        for name in rest:
            allowed = [level for level in levels[name] if refusal({**case, name: level}) is None]
            assert allowed, f"no level of {name} trains with {case}"
            gains = {level: _gain(uncovered, case, name, level) for level in allowed}
            best = max(gains.values())
            case[name] = rng.choice([level for level in allowed if gains[level] == best])
        ordered = {name: case[name] for name in names}
        uncovered -= {(a, ordered[a], b, ordered[b]) for a, b in itertools.combinations(names, 2)}
        cases.append(ordered)
    for a, x, b, y in refused_pairs:
        cases.append({name: {a: x, b: y}.get(name, levels[name][0]) for name in names})
    return cases


def _gain(uncovered: set[tuple[str, str, str, str]], case: dict[str, str], name: str, level: str) -> int:
    """How many uncovered pairs ``name = level`` makes with the levels ``case`` has so far."""
    return sum(
        ((name, level, other, value) in uncovered) or ((other, value, name, level) in uncovered)
        for other, value in case.items()
    )


def case_id(case: dict[str, str]) -> str:
    return "-".join(case.values())


def case_settings(case: dict[str, str]) -> tuple[Overrides, dict[str, Any]]:
    """The config overrides of a case and its run settings (``processes``, ``kill``, the callback)."""
    overrides: Overrides = {}
    run: dict[str, Any] = {"processes": 1, "kill": False}
    for option, level in case.items():
        for key, value in OPTIONS[option][level].items():
            (run if key in ("processes", "kill", "callback") else overrides)[key] = value
    return overrides, run


CASES = covering_array(OPTIONS, seed=35)  # a seed whose cases include three in-process ones for make test that cover
# every level of the quick options (tests/integration/test_option_matrix.py's IN_MAKE_TEST)
