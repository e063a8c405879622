"""Every option works with every other or says why not: the pairwise covering array of
tests/integration/option_matrix.py (accumulation, precision, view spec (SimCLR, multi-crop, same-class), drawer
(torchvision, batched in the workers or on the device, the training set on the device), compiled costs, internal
costs, the adaptive filter, a callback, processes, a SIGKILL mid-epoch and resume), each case a tiny ``hfmca fit`` of
the demo with data-loader workers on whose checkpoint then goes through ``analyze``, ``compare``, ``export`` and
``linear``; or, for a refused combination, one line ``hfmca: error: ...`` before training.
``pytest -m '' -k <case id>`` picks a case (ids name the levels: ``acc2-bf16-simclr-resident-...``). Single-process
runs without a kill run in-process, runs with two processes or a kill as subprocesses; three cases are in
``make test``, the other 27 in ``make test-slow``."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from hfmca_lightning.cli import main
from tests.helpers import DEMO, finish_hfmca, run_hfmca, start_hfmca, tiny_overrides, wait_for
from tests.integration.option_matrix import CASES, REFUSED, case_id, case_settings, refusal

STEPS_PER_EPOCH = 4  # 32 images in batches of 8


def _overrides(folder: Path, case: dict[str, str]) -> tuple[Path, dict]:
    overrides, run = case_settings(case)
    checkpoints = {
        "class_path": "hfmca_lightning.callbacks.PreemptionCheckpoint",
        "init_args": {"dirpath": str(folder / "checkpoints"), "save_last": True, "every_n_train_steps": 2},
    }
    overrides["trainer.callbacks"] = [checkpoints, run["callback"]]
    overrides["trainer.max_epochs"] = 2
    overrides["data.init_args.num_workers"] = 1  # workers on (the resident drawer has none to start)
    if run["processes"] > 1:
        overrides.update({"trainer.strategy": "ddp", "trainer.devices": 2, "trainer.accelerator": "cpu"})
    return tiny_overrides(folder, **overrides), run


def _fit_in_process(folder: Path, config: Path, capsys) -> tuple[int, str]:
    try:
        main(["fit", "--config", str(DEMO), "--config", str(config)])
    except SystemExit as exit_:
        return int(exit_.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


def _fit_subprocess(folder: Path, config: Path, run: dict) -> tuple[int, str]:
    args = ["fit", "--config", str(DEMO), "--config", str(config)]
    if not run["kill"]:
        result = run_hfmca(folder, *args, timeout=300)
        return result.returncode, result.stdout
    last = folder / "checkpoints" / "last.ckpt"
    process = start_hfmca(folder, *args, log_name="killed.log")
    try:
        wait_for(last.is_file, process, timeout=240)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except AssertionError:
        if process.poll() is None:
            raise
        return process.returncode, (folder / "killed.log").read_text()  # ended before any checkpoint: refused
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    step = torch.load(last, weights_only=True)["global_step"]
    assert 0 < step < 2 * STEPS_PER_EPOCH, f"the kill came after the run had finished (step {step})"
    resumed = start_hfmca(folder, *args, "--ckpt_path", "last", log_name="resumed.log")
    result = finish_hfmca(resumed, folder, timeout=300, log_name="resumed.log")
    return result.returncode, result.stdout


def _commands_on(folder: Path, checkpoint: Path) -> None:
    """The checkpoint through every command that reads one (in-process)."""
    out = folder / "analysis"
    main(["analyze", "--ckpt_path", str(checkpoint), "--out", str(out), "--num_images", "2", "--num_batches", "2"])
    pairs = json.loads((out / "spectra.json").read_text())["pairs"]
    assert "external" in pairs and all(pair["eigenvalues"] for pair in pairs.values())
    compared = folder / "compare"
    main(["compare", "--ckpt_a", str(checkpoint), "--ckpt_b", str(checkpoint), "--out", str(compared)])
    assert (compared / "cross_spectra.json").is_file()
    exported = folder / "export"
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(exported), "--device", "cpu"])
    assert (exported / "backbone.pt").is_file()
    main(["linear", "--ckpt_path", str(checkpoint), "--epochs", "1", "--device", "cpu", "--out", str(folder / "eval")])
    assert list((folder / "eval").glob("*")), "linear evaluation wrote nothing"


# The in-process cases in make test: between them every level of accumulation, the view spec, the drawer (bar the
# device ones), compiled costs, internal costs, beta and the callback but spectra; the other 27 in make test-slow.
IN_MAKE_TEST = {
    "acc1-bf16-simclr-batched-eager-internal-beta0-knn-1proc-straight",
    "acc2-fp64-multicrop-torchvision-compiled-external-beta.5-probe-1proc-straight",
    "acc1-bf16-sameclass-torchvision-eager-internal-beta.5-heatmaps-1proc-straight",
}


def _marks(case: dict[str, str]) -> list:
    return [] if case_id(case) in IN_MAKE_TEST else [pytest.mark.slow]


@pytest.mark.parametrize("case", [pytest.param(case, id=case_id(case), marks=_marks(case)) for case in CASES])
def test_each_combination_trains_and_its_checkpoint_goes_through_every_command_or_is_refused(
    case: dict[str, str], tmp_path: Path, capsys
) -> None:
    config, run = _overrides(tmp_path, case)
    in_process = run["processes"] == 1 and not run["kill"]
    status, output = _fit_in_process(tmp_path, config, capsys) if in_process else _fit_subprocess(tmp_path, config, run)
    refused = refusal(case)
    if refused is not None:
        errors = [line for line in output.splitlines() if line.startswith("hfmca: error: ")]
        assert status == 2 and len(errors) == 1, output[-3000:]
        assert re.search(refused.message, errors[0]), errors[0]
        assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # refused before training
        return
    assert status == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["global_step"] == 2 * STEPS_PER_EPOCH // int(case["accumulate"].removeprefix("acc")) // (
        2 if case["processes"] == "ddp" else 1
    )
    assert all(bool(torch.isfinite(value).all()) for value in state["state_dict"].values() if value.is_floating_point())
    _commands_on(tmp_path, checkpoint)


def test_the_matrix_covers_every_pair_of_levels_and_the_docs_list_every_refusal():
    import itertools

    from tests.helpers import REPO
    from tests.integration.option_matrix import OPTIONS

    trained = [case for case in CASES if refusal(case) is None]
    for a, b in itertools.combinations(OPTIONS, 2):
        for x, y in itertools.product(OPTIONS[a], OPTIONS[b]):
            # a pair that can train does so in some case (a refused case checks its refusal only)
            assert any(case[a] == x and case[b] == y for case in (CASES if refusal({a: x, b: y}) else trained)), (
                a,
                x,
                b,
                y,
            )
    assert len({case_id(case) for case in CASES}) == len(CASES)
    in_process = {case_id(case) for case in CASES if case["processes"] == "1proc" and case["kill"] == "straight"}
    assert IN_MAKE_TEST <= in_process  # make test's cases exist and run in-process
    docs = (REPO / "docs" / "training.md").read_text()
    for rule in REFUSED:
        assert rule.reason in " ".join(docs.split()), rule.reason
    assert f"resume: {len(CASES)} runs" in " ".join(docs.split())  # the count the docs give is the matrix's
