"""The planner (``elastic_batches.plan``): every rule that shapes an attempt's microbatches, tested where it lives.

``Plan`` (the cut, the BatchNorm floor, amendment by the ranks' agreement), ``planned_count`` (the
search's or the model's count, and the retry that always cuts smaller), ``measuring_lead`` (when a
batch is measured) and ``Ramp`` (the measuring cut: the growth cap, the piece ``SPREAD`` times the
last, the end piece absorbed, ``max_split_count``). The numbers are exact: made-up loads and
memory models with integer measurements.
"""

from __future__ import annotations

import dataclasses

import pytest

import elastic_batches as eb
from elastic_batches.memory import SPREAD, MemoryModel, MemoryReading, Predictor
from elastic_batches.plan import GROWTH, Plan, Ramp, measuring_lead, planned_count, realized
from elastic_batches.search import SizeSearch


def _fitted(per_row: int = 100, retained: int = 500) -> Predictor:
    """A predictor whose model is ready: ``per_row`` bytes a row through two sizes ``SPREAD`` apart."""
    model = MemoryModel(margin=0.0)
    model.observe(1, per_row, first=True)
    model.observe_retained(retained)
    model.observe(4, 4 * per_row, first=False)
    model.observe(8, 8 * per_row, first=False)
    assert model.ready
    return Predictor(model)


def test_a_plan_is_a_value_and_cuts_balanced_pieces_no_smaller_than_its_floor() -> None:
    plan = Plan.cut(eb.BatchLoad(10), 4, smallest=3)
    assert plan.sizes == (4, 3, 3) and plan.largest == 4 and not plan.measuring
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.count = 2  # type: ignore[misc]


def test_agreement_amends_a_plan_into_a_new_one_with_the_same_limits() -> None:
    plan = Plan.cut(eb.BatchLoad(12), 2, smallest=2, max_split_count=5)
    assert plan.amended(2, 0) is plan
    wider = plan.amended(5, 0)
    assert wider is not plan and plan.sizes == (6, 6)
    assert wider.sizes == (3, 3, 2, 2, 2) and (wider.smallest, wider.max_split_count) == (2, 5)
    measured = plan.amended(5, 2)
    assert measured.measuring and measured.sizes == () and measured.largest == 0


def test_the_controller_plans_an_attempt_with_the_batchnorm_floor_and_its_own_limits() -> None:
    controller = eb.SplitController(split_count=5, min_microbatch_size=1, max_split_count=5)
    assert controller.plan_attempt(7).sizes == (2, 2, 1, 1, 1)
    assert controller.plan_attempt(7, floor=2).sizes == (3, 2, 2)  # no one-row piece through a BatchNorm
    assert controller.plan_attempt(7, floor=2).max_split_count == 5


@pytest.mark.parametrize("min_size", [1, 2, 3])
def test_each_retry_cuts_smaller_than_the_smallest_failure_even_where_the_floor_widens_pieces(min_size: int) -> None:
    # Tokens: one long row, so that min_microbatch_size makes several counts cost the same.
    load = eb.BatchLoad(6, lengths=[100, 10, 10, 10, 10, 10])
    controller = eb.SplitController(unit="tokens", min_microbatch_size=min_size, margin=None)
    failed: list[int] = []
    with pytest.raises(eb.ElasticOOMError, match="Splitting cannot help further"):
        for _ in range(8):  # every attempt runs out of memory
            cost = controller.realized(load, controller.plan(load))
            assert not failed or cost < min(failed)
            failed.append(cost)
            controller.record_oom(cost, load)
    assert len(failed) <= 6 and failed[-1] == realized(load, 6 // min_size, min_size)


def test_a_fitted_model_plans_the_count_and_after_an_oom_the_more_cautious_of_it_and_the_search() -> None:
    controller = eb.SplitController(margin=0.0)
    fitted = _fitted()  # 500 retained + 100 per row: 20 rows fit in 2500 free bytes
    controller.load_state_dict({**controller.state_dict(), "memory": fitted.model.state_dict()})
    predictor, memory = controller.predictor, MemoryReading(in_use=0, capacity=2500)
    assert predictor is not None and predictor.limit(memory) == 20
    controller.record_success(20, 64, capacity=20)
    assert controller.plan(64, memory=memory) == 4
    assert controller.plan(64, tag=8, memory=memory) == 8  # a tag above the settled count is obeyed
    controller.record_oom(16, 64, capacity=20)  # an OOM the model did not predict
    assert predictor.fallback and controller.plan(64, memory=memory) == 8  # the search's 8 rows, not the model's 20
    search = SizeSearch()
    assert planned_count(eb.BatchLoad(64), None, None, controller.settled, search, None, None) == 8


def test_a_batch_is_measured_only_where_three_pieces_fit_within_the_limits() -> None:
    new = Predictor(MemoryModel())
    assert measuring_lead(eb.BatchLoad(256), new, 1, None) == 1
    assert measuring_lead(eb.BatchLoad(256), new, 2, None) == 2  # the floor's rows first
    assert measuring_lead(eb.BatchLoad(256), new, 1, 2) == 0  # max_split_count below 3
    assert measuring_lead(eb.BatchLoad(2 + 2), new, 1, None) == 1  # 1 + SPREAD (2) + 1 rows
    assert measuring_lead(eb.BatchLoad(3), new, 1, None) == 0
    assert measuring_lead(eb.BatchLoad(256), _fitted(), 1, None) == 0  # a ready model plans without measuring
    assert measuring_lead(eb.BatchLoad(256), None, 1, None) == 0  # margin=None


def test_the_ramp_grows_at_most_growth_times_the_largest_piece_and_takes_a_piece_spread_times_the_last() -> None:
    ramp = Ramp(Plan.cut(eb.BatchLoad(1000), 1, lead=1), _fitted(per_row=1))
    roomy = MemoryReading(in_use=0, capacity=1 << 40)  # the model alone would take every row left in one piece
    assert ramp.count(1, 1, roomy, last=1, largest=1) == -(-999 // GROWTH)  # pieces of at most 2 rows
    ramp = Ramp(Plan.cut(eb.BatchLoad(1000), 1, lead=1), Predictor(MemoryModel()))
    ramp.predictor.model.observe(1, 10, first=True)
    ramp.predictor.model.observe_retained(5)
    ramp.predictor.model.observe(2, 20, first=False)  # one later size: no slope yet
    assert not ramp.predictor.model.spread
    spread = int(SPREAD * 2 + 0.999)
    assert ramp.count(3, 2, roomy, last=2, largest=2) <= -(-997 // spread)


def test_the_ramp_absorbs_rows_too_few_for_a_piece_and_keeps_max_split_count() -> None:
    ramp = Ramp(Plan.cut(eb.BatchLoad(10), 1, lead=2, smallest=2, max_split_count=3), Predictor(MemoryModel()))
    assert ramp.room(0, 0) == 3 and ramp.room(2, 1) == 2 and ramp.room(6, 2) == 1
    assert ramp.rows(6, 2, room=1) == 4  # the last piece the limit allows takes every row left
    assert ramp.rows(7, 2, room=2) == 3  # one row would be left: below the floor, it joins this piece
    assert ramp.rows(2, 1, room=2) == 2  # never under the floor
    assert ramp.first_of(2, 2) == 4  # 8 rows left in 2 pieces


def test_without_a_probe_reading_the_ramp_cuts_no_piece_larger_than_the_largest_so_far() -> None:
    ramp = Ramp(Plan.cut(eb.BatchLoad(100), 1, lead=1), _fitted())
    assert ramp.count(10, 3, None, last=6, largest=6) == 15  # 90 rows in pieces of at most 6
