"""The checks of a step's costs: named columns, merged over micro-batches, decoded into one error."""

from __future__ import annotations

import random

import pytest
import torch

from hfmca_lightning.losses.cost_checks import (
    CHECK_COLUMNS,
    MATRICES,
    NONFINITE,
    CostChecks,
    CostFactorisationError,
    check_state,
    merge_checks,
)

NAMES, SIZES, REGS = ("external", "internal/L1"), ((128, 128), (64, 32)), (0.1, 0.1)


def _checks(state: list[list[int]], total: int | None) -> CostChecks:
    return CostChecks(
        torch.tensor(state, dtype=torch.int64), NAMES, SIZES, REGS, None if total is None else torch.tensor(total)
    )


def test_merged_checks_are_the_elementwise_maximum_of_the_micro_batches():
    """Against a plain reference: each cost's failed column, flag and the total's flag is the largest over the
    micro-batches (a failure in any of them), whether or not each micro-batch checked its total."""
    rng = random.Random(0)
    for micro_batches in (1, 2, 3, 5):
        states = [[[rng.choice((0, 0, 0, 3, 7)) for _ in CHECK_COLUMNS] for _ in NAMES] for _ in range(micro_batches)]
        totals = [rng.choice((None, 0, 1)) for _ in range(micro_batches)]
        merged = merge_checks([_checks(state, total) for state, total in zip(states, totals)])
        expected = [
            [max(state[cost][column] for state in states) for column in range(len(CHECK_COLUMNS))]
            for cost in range(len(NAMES))
        ]
        assert merged.state.tolist() == expected
        checked = [total for total in totals if total is not None]
        if micro_batches == 1:
            assert (merged.total is None) == (totals[0] is None)
        else:
            assert (merged.total is None) == (not checked)
        if checked and merged.total is not None:
            assert int(merged.total) == max(checked)
        assert (merged.names, merged.sizes, merged.regs) == (NAMES, SIZES, REGS)


def test_check_state_orders_the_named_columns():
    columns = {name: torch.tensor([index, 0]) for index, name in enumerate(CHECK_COLUMNS)}
    state = check_state(columns)
    assert state.dtype == torch.int64 and state[0].tolist() == list(range(len(CHECK_COLUMNS)))
    with pytest.raises(ValueError, match="need the check columns"):
        check_state({"low": torch.tensor([0])})


@pytest.mark.parametrize("matrix", MATRICES, ids=[matrix.column for matrix in MATRICES])
def test_the_error_names_the_failed_matrix_with_its_size(matrix):
    state = [[0] * len(CHECK_COLUMNS) for _ in NAMES]
    state[1][CHECK_COLUMNS.index(matrix.column)] = 5
    error = _checks(state, 0).error(_checks(state, 0).packed())
    size = SIZES[1][0] if matrix.dimension == "low" else SIZES[1][1]
    assert isinstance(error, CostFactorisationError)
    assert f"HFMCA cost 'internal/L1': the {matrix.description} ({size}x{size})" in str(error)
    assert "column 5" in str(error)


def test_non_finite_statistics_without_a_failed_factorisation_name_the_cost():
    state = [[0] * len(CHECK_COLUMNS) for _ in NAMES]
    state[0][CHECK_COLUMNS.index(NONFINITE)] = 1
    with pytest.raises(CostFactorisationError, match="HFMCA cost 'external': its statistics hold NaN or Inf"):
        _checks(state, 0).raise_if_failed()
    with pytest.raises(CostFactorisationError, match="the total cost is not finite"):
        _checks([[0] * len(CHECK_COLUMNS) for _ in NAMES], 1).raise_if_failed()
    _checks([[0] * len(CHECK_COLUMNS) for _ in NAMES], 0).raise_if_failed()  # nothing failed
