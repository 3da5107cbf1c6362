"""``SplitController``: the search for the split count, growth probes, limits, logging, state.

The memory oracle of these tests is pure: a microbatch fits iff it has at most ``F`` rows. A
"step" asks the controller for a count, and reports an OOM (then asks again, as ``ElasticStep``
retries the same batch) or a success.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from typing import Any

import pytest

import elastic_batches as eb
from elastic_batches.controller_state import STATE_KEYS
from elastic_batches.memory import MemoryModel, MemoryReading


def largest_piece(rows: int, count: int) -> int:
    """Rows of the largest microbatch of a balanced split."""
    return math.ceil(rows / count)


def best_size(rows: int, fits: int) -> int:
    """The largest "largest microbatch" of any balanced split of ``rows`` that fits in ``fits`` rows."""
    return largest_piece(rows, math.ceil(rows / fits))


def oom_budget(rows: int) -> int:
    return math.ceil(math.log2(rows)) + 4


class Oracle:
    """Runs steps against a controller with memory for ``fits`` rows; records OOMs and sizes."""

    def __init__(self, controller: eb.SplitController, rows: int, fits: int) -> None:
        self.controller, self.rows, self.fits = controller, rows, fits
        self.ooms = 0
        self.sizes: list[int] = []  # size of each completed step
        self.trace: list[tuple[str, int]] = []  # ("ok" | "oom", count) per attempt

    def step(self) -> None:
        while True:
            count = self.controller.plan(self.rows)
            size = largest_piece(self.rows, count)
            if size <= self.fits:
                self.trace.append(("ok", count))
                self.controller.record_success(size, self.rows)
                self.sizes.append(size)
                return
            self.trace.append(("oom", count))
            self.ooms += 1
            self.controller.record_oom(size, self.rows, discarded=1)

    def run(self, steps: int) -> Oracle:
        for _ in range(steps):
            self.step()
        return self


def settle_steps(rows: int) -> int:
    return 2 * oom_budget(rows) + 6


@pytest.mark.parametrize("rows", [7, 100, 256, 1000], ids=["B7", "B100", "B256", "B1000"])
def test_search_settles_fast_near_the_best_size_for_every_limit(rows: int) -> None:
    failures = []
    for fits in range(1, rows + 2):
        oracle = Oracle(eb.SplitController(), rows, fits).run(settle_steps(rows))
        settled = oracle.sizes[-1]
        best = best_size(rows, min(fits, rows))
        ooms_before = oracle.ooms
        oracle.run(5)  # settled: never OOMs again, and keeps the same size
        problems = []
        if ooms_before > oom_budget(rows):
            problems.append(f"{ooms_before} OOMs > {oom_budget(rows)}")
        if settled < 0.9 * best:
            problems.append(f"settled at {settled} < 90% of {best}")
        if oracle.ooms != ooms_before or set(oracle.sizes[-5:]) != {settled}:
            problems.append(f"not settled: trace {oracle.trace[-8:]}")
        if problems:
            failures.append(f"F={fits}: {', '.join(problems)}")
    assert not failures, "\n".join(failures[:20])


def test_fits_whole_batch_never_ooms() -> None:
    oracle = Oracle(eb.SplitController(), 256, 256).run(5)
    assert oracle.ooms == 0 and oracle.sizes == [256] * 5 and oracle.controller.split_count == 1


def test_counts_are_any_integer_not_powers_of_two() -> None:
    controller = eb.SplitController()
    oracle = Oracle(controller, 256, 47).run(settle_steps(256))
    assert controller.split_count == 6 and controller.count_for(256) == 6
    assert oracle.sizes[-1] == 43  # 6 microbatches of 43 (or 42), not 8 of 32
    assert {count for outcome, count in oracle.trace if outcome == "ok"} - {1, 2, 4, 8, 16, 32} != set()


def test_what_was_learned_applies_to_another_batch_size() -> None:
    controller = eb.SplitController()
    Oracle(controller, 256, 47).run(settle_steps(256))
    assert controller.microbatch_size == 43  # what it saw fit (47 was never tried)
    assert controller.count_for(86) == 2 and controller.count_for(43) == 1 and controller.count_for(1000) == 24


def test_halving_phase_halves_the_microbatch() -> None:
    controller = eb.SplitController()
    counts = []
    for size in (256, 128, 64):
        controller.record_oom(size, 256)
        counts.append(controller.plan(256))
    assert counts == [2, 4, 8]


def test_settled_count_is_what_the_loader_tags_while_plan_probes() -> None:
    controller = eb.SplitController()
    controller.record_oom(256, 256)
    controller.record_oom(128, 256)  # halving: 4 microbatches of 64
    controller.record_success(64, 256)
    assert controller.count_for(256) == 4  # what fitted
    assert controller.plan(256) == 3  # a probe between 64 (fits) and 128 (failed)
    assert controller.count_for(256) == 4  # probing does not change the tag


@pytest.mark.parametrize("grow_after", [1, 3], ids=["grow-after-1", "grow-after-3"])
def test_grow_after_probes_one_microbatch_fewer_and_falls_back(grow_after: int) -> None:
    controller = eb.SplitController(split_count=3, grow_after=grow_after)
    oracle = Oracle(controller, 256, 100).run(grow_after)
    assert oracle.trace == [("ok", 3)] * grow_after
    oracle.run(1)
    assert oracle.trace[grow_after:] == [("oom", 2), ("ok", 3)]  # the probe failed; the same step went through
    assert controller.count_for(256) == 3 and controller.oom_count == 1
    oracle.run(2 * grow_after)  # a failed probe doubles the wait
    assert oracle.trace[grow_after + 2 :] == [("ok", 3)] * (2 * grow_after - 1) + [("oom", 2), ("ok", 3)]


def test_failed_growth_probes_back_off() -> None:
    controller = eb.SplitController(grow_after=1)
    oracle = Oracle(controller, 256, 100).run(settle_steps(256))
    ooms = oracle.ooms
    oracle.run(100)
    assert oracle.ooms - ooms <= 8  # waits 1, 2, 4, ... 64 steps between failed probes


def test_growth_probe_succeeds_when_memory_grew() -> None:
    controller = eb.SplitController(grow_after=2)
    oracle = Oracle(controller, 256, 100).run(settle_steps(256))
    assert controller.count_for(256) == 3
    oracle.fits = 200
    oracle.run(settle_steps(256))
    assert controller.count_for(256) == 2


def test_without_grow_after_it_never_probes_a_settled_count() -> None:
    oracle = Oracle(eb.SplitController(), 256, 100).run(settle_steps(256))
    start = len(oracle.trace)
    oracle.fits = 1000  # memory grew, but nobody asks
    oracle.run(50)
    assert set(oracle.trace[start:]) == {("ok", 3)}


@pytest.mark.parametrize(("before", "after"), [(100, 30), (47, 5), (256, 1)], ids=["100-to-30", "47-to-5", "256-to-1"])
def test_memory_that_shrinks_re_descends(before: int, after: int) -> None:
    rows = 256
    oracle = Oracle(eb.SplitController(), rows, before).run(settle_steps(rows))
    ooms = oracle.ooms
    oracle.fits = after
    oracle.run(settle_steps(rows))
    assert oracle.ooms - ooms <= oom_budget(rows)
    assert oracle.sizes[-1] >= 0.9 * best_size(rows, after)
    ooms = oracle.ooms
    oracle.run(5)
    assert oracle.ooms == ooms


# ---------------------------------------------------------------------------------------------
# Limits: ElasticOOMError


def test_oom_at_microbatch_size_one_raises_elastic_oom_error_saying_what_was_tried() -> None:
    controller = eb.SplitController()
    oracle = Oracle(controller, 100, 0)
    with pytest.raises(
        eb.ElasticOOMError,
        match=r"out of memory on a batch of 100 rows even at microbatch size 1 \(100 microbatches\); "
        r"microbatch sizes tried on this batch: 100, 50, 25, 13, 7, 4, 2, 1\. Splitting cannot help further",
    ):
        oracle.step()


def test_elastic_oom_error_is_a_torch_out_of_memory_error() -> None:
    assert issubclass(eb.ElasticOOMError, __import__("torch").OutOfMemoryError)


@pytest.mark.parametrize(
    ("kwargs", "fits", "message"),
    [
        ({"min_microbatch_size": 8}, 5, r"even at microbatch size 9 \(12 microbatches\).*min_microbatch_size=8"),
        ({"max_split_count": 3}, 10, r"even at microbatch size 34 \(3 microbatches\).*max_split_count=3\)"),
    ],
    ids=["min-microbatch-size", "max-split-count"],
)
def test_limits_raise_elastic_oom_error(kwargs: dict[str, int], fits: int, message: str) -> None:
    controller = eb.SplitController(**kwargs)
    oracle = Oracle(controller, 100, fits)
    with pytest.raises(eb.ElasticOOMError, match=message):
        oracle.step()


@pytest.mark.parametrize(
    ("kwargs", "rows", "count"),
    [({"min_microbatch_size": 8}, 100, 12), ({"max_split_count": 3}, 100, 3), ({}, 5, 5)],
    ids=["min-microbatch-size", "max-split-count", "rows"],
)
def test_counts_are_clamped_to_the_limits(kwargs: dict[str, int], rows: int, count: int) -> None:
    controller = eb.SplitController(split_count=min(50, kwargs.get("max_split_count", 50)), **kwargs)
    assert controller.count_for(rows) == count and controller.plan(rows) == count


# ---------------------------------------------------------------------------------------------
# Counters, logging


def test_counters_count_ooms_retries_and_discarded_work() -> None:
    controller = eb.SplitController()
    controller.record_oom(256, 256, discarded=1)
    controller.record_oom(128, 256, discarded=2)
    controller.record_success(64, 256)
    assert (controller.oom_count, controller.retry_count, controller.discarded_microbatches) == (2, 2, 3)
    with pytest.raises(eb.ElasticOOMError):
        controller.record_oom(1, 256, discarded=5)
    assert (controller.oom_count, controller.retry_count, controller.discarded_microbatches) == (3, 2, 8)


def test_one_info_line_per_change_of_count(caplog: pytest.LogCaptureFixture) -> None:
    controller = eb.SplitController(split_count=4, grow_after=1)
    caplog.set_level(logging.DEBUG, logger="elastic_batches")
    controller.record_success(64, 256)  # 4 of 64 fit: no change
    assert controller.plan(256) == 3  # growth probe
    controller.record_success(86, 256)  # 3 of 86 fit: a change
    assert controller.plan(256) == 2  # growth probe
    controller.record_oom(128, 256)  # back to 3
    controller.record_success(86, 256)  # no change
    lines = [(r.levelno, r.name, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0][:2] == (logging.INFO, "elastic_batches.controller")
    assert lines[0][2] == ("a batch of 256 rows ran as 3 microbatches of 85 to 86 rows: split count 4 -> 3")
    assert lines[1][:2] == (logging.INFO, "elastic_batches.controller")
    assert lines[1][2] == (  # the growth probe that failed is named as one: the count 2 appeared nowhere before
        "OOM at 2 microbatches of at most 128 rows on a batch of 256 rows (a probe; settled at 3): "
        "split count 2 -> 3, 3 microbatches of at most 86 rows"
    )


def test_halving_logs_each_oom(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic_batches")
    Oracle(eb.SplitController(), 256, 100).run(settle_steps(256))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert messages[0] == (
        "OOM at 1 microbatch of at most 256 rows on a batch of 256 rows: split count 1 -> 2, "
        "2 microbatches of at most 128 rows"
    )
    assert messages[1] == (
        "OOM at 2 microbatches of at most 128 rows on a batch of 256 rows: split count 2 -> 4, "
        "4 microbatches of at most 64 rows"
    )
    assert sum(m.startswith("OOM at") for m in messages) == 2


def test_a_tokens_controller_logs_tokens_and_rows_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic_batches")
    controller = eb.SplitController(unit="tokens")
    load = eb.BatchLoad(64, [120] * 64)
    controller.record_oom(load.size_at(1), load)
    assert caplog.records[-1].getMessage() == (
        "OOM at 1 microbatch of at most 7680 tokens on a batch of 64 rows: split count 1 -> 2, "
        "2 microbatches of at most 3840 tokens"
    )


# ---------------------------------------------------------------------------------------------
# State


def _environment(seed: int, steps: int) -> list[tuple[int, int]]:
    """A random sequence of (batch rows, memory in rows): memory and batch sizes change over time."""
    rng = random.Random(seed)
    fits, env = rng.randint(1, 300), []
    for _ in range(steps):
        if rng.random() < 0.1:
            fits = rng.randint(1, 300)
        env.append((rng.choice([256, 256, 256, 200, 31]), fits))
    return env


def _play(controller: eb.SplitController, env: list[tuple[int, int]]) -> list[tuple[str, int]]:
    trace: list[tuple[str, int]] = []
    for rows, fits in env:
        oracle = Oracle(controller, rows, fits)
        oracle.step()
        trace.extend(oracle.trace)
    return trace


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed-0", "seed-1", "seed-2"])
@pytest.mark.parametrize("grow_after", [None, 2], ids=["no-growth", "grow-after-2"])
def test_state_round_trip_contract(seed: int, grow_after: int | None) -> None:
    """After torchdata's ``run_test_save_load_state``: a controller restored at any point continues identically."""
    env = _environment(seed, 40)
    kwargs: dict[str, Any] = {"split_count": 2, "grow_after": grow_after}
    for stop in range(0, len(env) + 1, 3):
        original = eb.SplitController(**kwargs)
        _play(original, env[:stop])
        state = original.state_dict()
        assert json.loads(json.dumps(state)) == state  # plain values only
        assert set(state) == set(STATE_KEYS) and state["version"] == 2
        restored = eb.SplitController(**kwargs)
        restored.load_state_dict(copy.deepcopy(state))
        assert restored.state_dict() == state
        assert restored.split_count == original.split_count
        assert [restored.count_for(r) for r in (1, 31, 200, 256)] == [original.count_for(r) for r in (1, 31, 200, 256)]
        assert _play(restored, env[stop:]) == _play(original, env[stop:])
        assert restored.state_dict() == original.state_dict()


def test_restored_controller_does_not_oom_its_way_down_again() -> None:
    learned = eb.SplitController()
    Oracle(learned, 256, 47).run(settle_steps(256))
    resumed = eb.SplitController()
    resumed.load_state_dict(learned.state_dict())
    oracle = Oracle(resumed, 256, 47).run(10)
    assert oracle.ooms == 0 and set(oracle.sizes) == {43}


def _state_with(**changes: Any) -> dict[str, Any]:
    state = eb.SplitController().state_dict()
    for key, value in changes.items():
        if value is _DROP:
            del state[key]
        else:
            state[key] = value
    return state


_DROP = object()


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (_state_with(fits=_DROP, fails=_DROP), ValueError, r"missing keys \['fails', 'fits'\], unexpected keys \[\]"),
        (_state_with(extra=1), ValueError, r"missing keys \[\], unexpected keys \['extra'\]"),
        (_state_with(fits=_DROP, extra=1), ValueError, r"missing keys \['fits'\], unexpected keys \['extra'\]"),
        (
            _state_with(version=99),
            ValueError,
            r"state version 99 is not supported \(this elastic_batches writes version 2\)",
        ),
        (
            _state_with(unit="tokens", fits=7),
            ValueError,
            r"learned with unit='tokens', this controller has unit='rows'",
        ),
    ],
    ids=["missing", "unexpected", "missing-and-unexpected", "version", "unit"],
)
def test_bad_state_dict_is_named_and_changes_nothing(state: dict[str, Any], error: type, message: str) -> None:
    controller = eb.SplitController(split_count=3)
    controller.record_oom(64, 64)
    before = controller.state_dict()
    with pytest.raises(error, match=message):
        controller.load_state_dict(state)
    assert controller.state_dict() == before


# ---------------------------------------------------------------------------------------------
# Constructor and arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split_count": 0}, r"split_count must be an int >= 1, got 0"),
        ({"split_count": True}, r"split_count must be an int >= 1, got True"),
        ({"split_count": 2.0}, r"split_count must be an int >= 1, got 2\.0"),
        ({"min_microbatch_size": 0}, r"min_microbatch_size must be an int >= 1, got 0"),
        ({"max_split_count": 0}, r"max_split_count must be an int >= 1 or None, got 0"),
        ({"grow_after": -1}, r"grow_after must be an int >= 1 or None, got -1"),
        ({"split_count": 5, "max_split_count": 4}, r"split_count=5 exceeds max_split_count=4"),
        ({"unit": "bytes"}, r"unit must be 'rows' or 'tokens', got 'bytes'"),
    ],
    ids=["zero", "bool", "float", "min-size", "max-count", "grow-after", "count-over-max", "unit"],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=rf"SplitController: {message}"):
        eb.SplitController(**kwargs)


@pytest.mark.parametrize("rows", [0, -5, 2.5, None], ids=["zero", "negative", "float", "none"])
def test_plan_rejects_bad_rows(rows: Any) -> None:
    with pytest.raises(ValueError, match=rf"SplitController: rows must be an int >= 1, got {rows!r}"):
        eb.SplitController().plan(rows)


def test_repr_shows_what_was_learned() -> None:
    controller = eb.SplitController()
    controller.record_oom(64, 64)
    assert repr(controller) == (
        "SplitController(split_count=2, microbatch_size=32, fits=0, fails=64, oom_count=1, "
        "memory='nothing measured yet, margin 5%')"
    )
    assert repr(eb.SplitController(margin=None)).endswith("fails=None, oom_count=0)")


def test_limits_set_later_apply_to_the_next_count_and_are_checked() -> None:
    controller = eb.SplitController()
    controller.record_oom(size=64, load=64)
    controller.record_oom(size=32, load=64)
    assert controller.count_for(64) == 4
    controller.max_split_count = 3
    assert controller.count_for(64) == 3
    controller.min_microbatch_size = 32
    assert controller.count_for(64) == 2
    with pytest.raises(ValueError, match="max_split_count must be an int >= 1 or None, got 0"):
        controller.max_split_count = 0
    with pytest.raises(ValueError, match="min_microbatch_size must be an int >= 1, got 1.5"):
        controller.min_microbatch_size = 1.5  # type: ignore[assignment]
    assert (controller.max_split_count, controller.min_microbatch_size) == (3, 32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"start_split_count": 0}, r"state\['start_split_count'\] must be an int >= 1, got 0"),
        ({"fits": -8}, r"state\['fits'\] must be an int >= 0, got -8"),
        ({"fails": 0}, r"state\['fails'\] must be an int >= 1 or None, got 0"),
        ({"fits": "8"}, r"state\['fits'\] must be an int >= 0, got '8'"),
        ({"fits": 64, "fails": 32}, r"state\['fits'\] must be below fails=32 .*, got 64"),
        ({"grow_pending": 1}, r"state\['grow_pending'\] must be a bool, got 1"),
        ({"grow_wait": 0}, r"state\['grow_wait'\] must be an int >= 1 or None, got 0"),
        ({"oom_count": -1}, r"state\['oom_count'\] must be an int >= 0, got -1"),
        ({"last_rows": 3, "last_lengths": [4, 4]}, r"state\['last_lengths'\] must be one length per row"),
        ({"last_rows": None, "last_lengths": [4]}, r"state\['last_lengths'\] must be None when last_rows is None"),
        ({"last_rows": 2.5}, r"state\['last_rows'\] must be an int >= 1 or None, got 2\.5"),
    ],
    ids=[
        "start-zero",
        "fits-negative",
        "fails-zero",
        "fits-string",
        "fits-over-fails",
        "grow-pending-int",
        "grow-wait-zero",
        "oom-count-negative",
        "lengths-per-row",
        "lengths-without-rows",
        "rows-float",
    ],
)
def test_a_bad_field_is_named_and_nothing_is_loaded(changes: dict[str, Any], message: str) -> None:
    """Every field is checked before any is applied: a bad one late in the state leaves the early ones alone."""
    source = eb.SplitController(split_count=2)
    source.record_oom(64, 64)
    source.record_success(32, 64)
    state = {**source.state_dict(), "start_split_count": 5, "retry_count": 7, **changes}
    controller = eb.SplitController(split_count=3)
    controller.record_oom(48, 48)
    before = controller.state_dict()
    with pytest.raises(ValueError, match=rf"SplitController\.load_state_dict: {message}"):
        controller.load_state_dict(state)
    assert controller.state_dict() == before


# ---------------------------------------------------------------------------------------------
# A success is a lower bound, never a ceiling


def test_a_small_batch_that_fitted_does_not_cap_a_larger_one() -> None:
    controller = eb.SplitController()
    controller.record_success(8, 8)  # a smoke test, a last partial batch, a resumed run
    assert controller.plan(1024) == 1 and controller.count_for(1024) == 1
    oracle = Oracle(controller, 1024, 1024).run(5)  # the whole batch fits
    assert oracle.ooms == 0 and set(oracle.sizes) == {1024}


def test_batches_larger_than_those_that_fitted_run_whole_until_an_oom_says_otherwise() -> None:
    controller = eb.SplitController()
    Oracle(controller, 256, 300).run(20)
    assert controller.plan(300) == 1
    assert Oracle(controller, 300, 300).run(5).ooms == 0
    limited = Oracle(controller, 300, 280).run(10)  # one OOM teaches it: then 2 microbatches of 150
    assert limited.ooms == 1 and limited.sizes[-1] == 150


def test_a_known_failure_still_limits_the_plan() -> None:
    controller = eb.SplitController()
    controller.record_oom(512, 512)
    controller.record_success(256, 512)
    assert controller.count_for(1024) == 4  # microbatches of what fitted, under the failure at 512
    assert controller.count_for(200) == 1  # a batch that fits whole below it runs whole


def _fitted(controller: eb.SplitController) -> MemoryModel:
    """The controller's memory model, given exact measurements: 1000 bytes + 100 per row, 500 retained."""
    model = controller.memory
    assert model is not None
    model.observe(4, 1000 + 100 * 4, first=True)
    model.observe_retained(500)
    for size in (8, 16, 32):
        model.observe(size, 1000 + 100 * size, first=False)
    return model


@pytest.mark.parametrize("in_use", [0, 20_000], ids=["empty", "in-use"])
def test_a_predicted_plan_keeps_the_largest_microbatch_under_the_capacity_minus_the_margin(in_use: int) -> None:
    controller = eb.SplitController()
    model = _fitted(controller)
    model.widen("the test")  # wrong once: the whole margin applies, 10% now
    reading = MemoryReading(in_use=in_use, capacity=100_000)
    for rows in (50, 256, 1000, 5000):
        count = controller.plan(rows, memory=reading)
        size = math.ceil(rows / count)
        assert in_use + model.predict(size) <= 0.9 * reading.capacity  # exact: 0 bytes of tolerance
        if count > 1:  # and the fewest such: one microbatch fewer would not keep the margin
            assert in_use + model.predict(math.ceil(rows / (count - 1))) > 0.9 * reading.capacity


def test_until_the_model_was_wrong_the_margin_costs_at_most_a_twentieth_of_the_size() -> None:
    controller = eb.SplitController()
    model = _fitted(controller)
    reading = MemoryReading(in_use=0, capacity=100_000)
    exact = model.largest(reading, margin=0.0)  # (100_000 - 500 - 1000) // 100 = 985 rows
    assert exact == 985 and controller.forecast(reading) == exact - exact // 20
    assert model.predict(controller.forecast(reading)) <= reading.capacity
