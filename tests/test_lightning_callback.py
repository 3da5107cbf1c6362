"""``ElasticAccumulation``'s state: a round trip that continues identically, and a bad state refused whole."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

import elastic_batches as eb
from elastic_batches.lightning import ElasticAccumulation
from elastic_batches.lightning.callback import STAGES


def _learned() -> ElasticAccumulation:
    """A callback whose stages learned different things (OOMs, successes, a probe pending)."""
    elastic = ElasticAccumulation(controllers={"train": eb.SplitController(split_count=2, grow_after=3)})
    controllers = elastic.controllers
    controllers["train"].record_oom(64, 64)
    controllers["train"].record_success(32, 64)
    controllers["validate"].record_oom(100, 100)
    controllers["predict"].record_success(7, 7)
    return elastic


def _play(controller: eb.SplitController, rows: int, fits: int, steps: int) -> list[int]:
    """Steps against memory for ``fits`` rows; the count each attempt ran."""
    counts = []
    for _ in range(steps):
        while True:
            count = controller.plan(rows)
            counts.append(count)
            size = -(-rows // count)
            if size <= fits:
                controller.record_success(size, rows)
                break
            controller.record_oom(size, rows)
    return counts


def test_state_round_trip_contract() -> None:
    """After torchdata's ``run_test_save_load_state``: restored, every stage continues as the original does."""
    original = _learned()
    state = original.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain values only
    assert state["version"] == 1 and set(state["controllers"]) == set(STAGES)
    restored = ElasticAccumulation(controllers={"train": eb.SplitController(split_count=2, grow_after=3)})
    restored.load_state_dict(copy.deepcopy(state))
    assert restored.state_dict() == state
    for stage in STAGES:
        assert _play(restored.controllers[stage], 100, 37, 12) == _play(original.controllers[stage], 100, 37, 12)
    assert restored.state_dict() == original.state_dict()


def _with(**changes: Any) -> dict[str, Any]:
    state = copy.deepcopy(_learned().state_dict())
    for stage, value in changes.items():
        if value is None:
            del state["controllers"][stage]
        else:
            state["controllers"][stage] = value
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (_with(test=None), r"stages missing \['test'\], unknown \[\]"),
        (_with(evaluate={}), r"stages missing \[\], unknown \['evaluate'\]"),
        (_with(predict=None, tune={}), r"stages missing \['predict'\], unknown \['tune'\]"),
        (
            _with(test={**eb.SplitController().state_dict(), "fits": -1}),
            r"the 'test' stage: SplitController\.load_state_dict: state\['fits'\] must be an int >= 0",
        ),
    ],
    ids=["missing", "unknown", "missing-and-unknown", "a-bad-stage"],
)
def test_a_bad_state_is_named_and_loads_nothing(state: dict[str, Any], message: str) -> None:
    elastic = ElasticAccumulation()
    elastic.controllers["train"].record_oom(48, 48)
    before = elastic.state_dict()
    with pytest.raises(ValueError, match=rf"ElasticAccumulation\.load_state_dict: {message}"):
        elastic.load_state_dict(state)
    assert elastic.state_dict() == before  # not even the stages before the bad one
