"""Predicted microbatches: ``ElasticStep`` with a memory probe settles without OOM and follows memory that changes.

The device is ``testing.MemoryBudget`` given to the step as its probe (``memory=budget``). "Fewest"
is the smallest count whose balanced split fits under the budget, found by running the splits
with prediction off. Gradients are compared with the full-batch gradient within 1e-6 of the
largest entry (float32, only the order of summation differs), as in ``test_step.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.memory import RECOVER_AFTER, MemoryProbe, MemoryReading
from elastic_batches.testing import MemoryBudget, inject_oom

Batch = tuple[torch.Tensor, torch.Tensor]
ROWS = 96


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 1))  # activations outweigh the gradients


def _batch(rows: int = ROWS, seed: int = 1) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 1, generator=generator)


def _loss(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    def loss_fn(mb: Any) -> torch.Tensor:
        return (model(mb[0]) - mb[1]).pow(2).mean()

    return loss_fn


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _reference(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    return list(torch.autograd.grad(_loss(model)(batch), list(model.parameters())))


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) <= 1e-6 * scale


def _peak(model: nn.Module, batch: Batch, count: int) -> int:
    """Peak bytes of a step at ``count`` balanced microbatches."""
    budget = MemoryBudget()
    step = eb.ElasticStep(model, controller=eb.SplitController(count, margin=None), memory=None)
    with budget:
        step.backward(batch, _loss(model))
    model.zero_grad(set_to_none=True)
    return budget.peak_bytes


def _fewest(model: nn.Module, batch: Batch, limit: int) -> int:
    return next(k for k in range(1, len(batch[0]) + 1) if _peak(model, batch, k) <= limit)


class Run:
    """Steps of a model through a step whose probe is a budget; counts OOMs and the microbatches of each step."""

    def __init__(self, limit: int, probe: MemoryProbe | None = None, **controller: Any) -> None:
        self.model = _model()
        self.budget = MemoryBudget(limit)
        self.controller = eb.SplitController(**controller)
        self.step = eb.ElasticStep(self.model, controller=self.controller, memory=probe or self.budget)
        self.rows: list[list[int]] = []  # rows of each microbatch of the attempt that fitted, per step

    def backward(self, batch: Batch, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> list[torch.Tensor]:
        seen: list[eb.Microbatch] = []
        inner = loss_fn or _loss(self.model)

        def recorded(mb: eb.Microbatch) -> torch.Tensor:
            if mb.index == 0:
                seen.clear()
            seen.append(mb)
            return inner(mb.unwrap())

        self.model.zero_grad(set_to_none=True)
        with self.budget:
            self.step.backward(batch, recorded, unwrap=False)
        self.rows.append([len(mb) for mb in seen])
        self.last = seen
        return _grads(self.model)


def _limit(count: int) -> int:
    """A budget in which ``count`` balanced microbatches of the test batch just fit."""
    return _peak(_model(), _batch(), count) + 64


def test_a_batch_it_knows_nothing_about_is_measured_first_and_settles_without_an_oom() -> None:
    limit = _limit(6)
    fewest = _fewest(_model(), _batch(), limit)
    run = Run(limit)
    grads = run.backward(_batch())
    first = run.rows[0]
    assert first[0] == 1 and sum(first) == ROWS  # measured, then cut: each piece at most twice the largest before
    assert all(rows <= 2 * max(first[: i + 1]) for i, rows in enumerate(first[1:], start=0))
    assert max(first[-3:]) - min(first[-3:]) <= 1  # the rest balanced at the predicted size
    assert [mb.count for mb in run.last] == [len(first)] * len(first) and [mb.index for mb in run.last] == list(
        range(len(first))
    )
    _assert_close(grads, _reference(run.model, _batch()))  # pieces of different sizes, the same update
    for _ in range(4):
        run.backward(_batch())
    assert run.budget.oom_count == 0 and run.controller.oom_count == 0
    settled = len(run.rows[-1])
    assert settled <= max(fewest + 1, math.floor(1.1 * fewest)) and all(len(r) == settled for r in run.rows[1:])


def test_a_measured_attempt_with_count_fn_gives_the_token_mean_gradient() -> None:
    run = Run(_limit(5))
    x, y = _batch()
    mask = (torch.arange(ROWS) % 3 != 0).float()[:, None]  # items a row counts: 0 or 1

    def loss_fn(mb: Any) -> torch.Tensor:
        return ((run.model(mb[0]) - mb[1]).pow(2) * mb[2]).sum() / mb[2].sum()

    run.model.zero_grad(set_to_none=True)
    with run.budget:
        loss = run.step.backward((x, y, mask), loss_fn, count_fn=lambda mb: mb[2].sum())
    assert run.controller.memory is not None and run.controller.memory.ready  # it was a measured attempt
    model = run.model
    want = torch.autograd.grad(((model(x) - y).pow(2) * mask).sum() / mask.sum(), list(model.parameters()))
    _assert_close(_grads(model), list(want))
    assert torch.allclose(loss, ((model(x) - y).pow(2) * mask).sum() / mask.sum())


def test_a_count_fn_that_does_not_add_up_over_the_pieces_still_weighs_by_the_real_total() -> None:
    run = Run(_limit(5))
    x, y = _batch()
    pieces: list[int] = []

    def count_fn(mb: Any) -> float:
        return float(len(mb[0])) ** 0.5  # not additive: the whole batch counts less than its pieces

    def loss_fn(mb: Any) -> torch.Tensor:
        pieces.append(len(mb[0]))
        return (run.model(mb[0]) - mb[1]).pow(2).mean()

    with run.budget:
        run.step.backward((x, y), loss_fn, count_fn=count_fn)
    assert pieces[0] == 1 and sum(pieces) == ROWS  # measured: the weights divided by the whole batch's count
    model, params = run.model, list(run.model.parameters())
    counts = [n**0.5 for n in pieces]
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    weighted = sum(
        c * (model(x[a : a + n]) - y[a : a + n]).pow(2).mean() for c, a, n in zip(counts, starts, pieces, strict=True)
    )
    _assert_close(_grads(model), list(torch.autograd.grad(weighted / sum(counts), params)))


def test_the_first_microbatch_measures_then_an_oom_in_the_next_is_retried_to_the_same_update() -> None:
    run = Run(_limit(6))
    with inject_oom(run.model[2], phase="backward", calls=1):  # the second microbatch: the first after measuring
        grads = run.backward(_batch())
    _assert_close(grads, _reference(run.model, _batch()))
    assert run.controller.oom_count == 1
    for _ in range(3):
        run.backward(_batch())
    assert run.controller.oom_count == 1 and run.budget.oom_count == 0


def test_an_oom_in_the_measuring_microbatch_of_one_row_is_final_and_leaves_the_gradients() -> None:
    run = Run(_limit(6))
    run.model.zero_grad(set_to_none=True)
    with pytest.raises(eb.ElasticOOMError, match="even at microbatch size 1"):
        with run.budget, inject_oom(run.model[0], phase="forward", calls=0):
            run.step.backward(_batch(), _loss(run.model))
    assert all(p.grad is None for p in run.model.parameters())


def test_a_budget_that_shrinks_after_the_measurement_is_read_before_each_next_piece() -> None:
    run = Run(_limit(4))
    shrunk = _limit(12)
    calls = [0]

    def loss_fn(mb: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            run.budget.limit_bytes = shrunk  # another process took memory while the batch runs
        return _loss(run.model)(mb)

    grads = run.backward(_batch(), loss_fn)
    assert run.budget.oom_count == 0 and len(run.rows[0]) >= 12
    _assert_close(grads, _reference(run.model, _batch()))


def test_memory_that_shrinks_and_grows_back_between_steps_is_planned_without_an_oom() -> None:
    roomy, tight = _limit(3), _limit(10)
    fewest = {roomy: _fewest(_model(), _batch(), roomy), tight: _fewest(_model(), _batch(), tight)}
    run = Run(roomy)
    counts = []
    for limit in [roomy] * 3 + [tight] * 3 + [roomy] * 3:
        run.budget.limit_bytes = limit
        run.backward(_batch())
        counts.append((len(run.rows[-1]), fewest[limit]))
    assert run.budget.oom_count == 0
    # Shrunk: planned at once. Grown back: from the step after the one that saw it (its vote agrees on it).
    assert all(count <= max(best + 1, math.floor(1.1 * best)) for count, best in counts[1:6] + counts[7:])
    assert counts[-1][0] < counts[5][0]


def test_a_larger_batch_is_planned_from_the_model_before_it_runs() -> None:
    run = Run(_limit(4))
    for _ in range(2):
        run.backward(_batch())
    assert run.controller.predicting()
    large = _batch(4 * ROWS, seed=2)
    run.backward(large)
    fewest = _fewest(_model(), large, run.budget.limit_bytes)
    assert run.budget.oom_count == 0 and run.rows[-1][0] > 1  # planned from the 96-row model, not measured again
    assert len(run.rows[-1]) <= max(fewest + 1, math.floor(1.1 * fewest))


class _Lying(MemoryProbe):
    """A probe that reports 30% more capacity than there is (the allocator's cache it cannot use, another process)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget

    def memory_reading(self) -> MemoryReading:
        reading = self.budget.memory_reading()
        assert reading.capacity is not None
        return MemoryReading(reading.in_use, int(1.3 * reading.capacity))

    def start_window(self) -> int:
        return self.budget.start_window()

    def window_peak(self) -> int:
        return self.budget.window_peak()


def test_a_probe_that_over_reports_the_capacity_costs_a_few_ooms_then_none() -> None:
    limit = _limit(6)
    run = Run(limit)
    run.step = eb.ElasticStep(run.model, controller=run.controller, memory=_Lying(run.budget))
    for _ in range(4):
        grads = run.backward(_batch())
    learned = run.controller.oom_count
    assert 1 <= learned <= 3 and run.controller.memory is not None and run.controller.memory.margin > 0.05
    _assert_close(grads, _reference(run.model, _batch()))
    for _ in range(4):
        run.backward(_batch())
    assert run.controller.oom_count == learned


def test_an_oom_the_model_did_not_predict_widens_the_margin_and_the_retry_is_the_more_cautious_plan() -> None:
    run = Run(_limit(6))
    for _ in range(2):
        run.backward(_batch())
    settled = len(run.rows[-1])
    with inject_oom(run.model[2], phase="forward", calls=0):
        run.backward(_batch())
    assert run.controller.memory is not None and run.controller.memory.margin == pytest.approx(0.10)
    assert len(run.rows[-1]) >= settled and run.controller.oom_count == 1
    run.backward(_batch())
    assert run.controller.oom_count == 1  # predicted again, with the wider margin


def test_a_resumed_controller_predicts_from_the_first_batch() -> None:
    run = Run(_limit(6))
    for _ in range(3):
        run.backward(_batch())
    state = run.controller.state_dict()
    resumed = Run(_limit(6))
    resumed.controller.load_state_dict(state)
    resumed.backward(_batch())
    assert resumed.rows[0] == run.rows[-1] and resumed.budget.oom_count == 0  # no measuring microbatch of one row
    old = {k: v for k, v in state.items() if k not in ("memory", "predicted", "fallback")}
    fresh = Run(_limit(6))
    fresh.controller.load_state_dict({**old, "version": 1})  # a state from before the memory model: measured again
    fresh.backward(_batch())
    assert fresh.rows[0][0] == 1 and fresh.budget.oom_count == 0


def test_without_a_margin_nothing_is_measured_and_the_search_runs_as_before() -> None:
    run = Run(_limit(6), margin=None)
    for _ in range(3):
        run.backward(_batch())
    assert run.controller.memory is None and run.controller.oom_count >= 1 and run.rows[0][0] > 1


def test_with_a_probe_growth_probes_are_not_needed() -> None:
    run = Run(_limit(6), grow_after=1)
    for _ in range(6):
        run.backward(_batch())
    assert run.controller.oom_count == 0


def test_each_change_is_logged_with_the_models_estimate(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic_batches")
    run = Run(_limit(6))
    run.backward(_batch())
    messages = [r.getMessage() for r in caplog.records if r.name == "elastic_batches.controller"]
    assert messages[0].startswith("measuring memory on a batch of 96 rows: a first microbatch of 1 row")
    assert messages[-1].startswith(f"a batch of 96 rows ran as {len(run.rows[0])} microbatches of 1 to ")
    assert "(memory model: " in messages[-1]
    assert " per row, margin 5%; it predicts microbatches of up to " in messages[-1]
    assert "per row, margin 5%" in repr(run.controller)


def test_a_tokens_controller_plans_a_longer_batch_from_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 50))
    collate = eb.ElasticCollate(pad_values={"ids": 0})

    def batch(length: int, seed: int) -> eb.ElasticBatch:
        g = torch.Generator().manual_seed(seed)
        return collate([{"ids": torch.randint(1, 50, (max(2, length - i % 5),), generator=g)} for i in range(32)])

    def loss_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(mb["ids"]).flatten(0, 1), mb["ids"].flatten(), ignore_index=0)

    def count_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (mb["ids"] != 0).sum()

    measure = MemoryBudget()
    with measure:
        loss_fn(collate([{"ids": torch.ones(40, dtype=torch.long)}] * 8).unwrap()).backward()
    model.zero_grad(set_to_none=True)
    budget = MemoryBudget(measure.peak_bytes)
    step = eb.ElasticStep(model, controller=eb.SplitController(unit="tokens"), memory=budget)
    counts = []
    for length in (20, 20, 80, 20):
        with budget:
            step.backward(batch(length, length), loss_fn, count_fn=count_fn)
        counts.append(step.controller.split_count)
        model.zero_grad(set_to_none=True)
    assert budget.oom_count == 0 and step.controller.oom_count == 0
    assert counts[2] >= 3 * counts[1]  # four times longer: about four times the microbatches, before it ran


# -- robust by construction: limits, bounds, what users see -------------------------------------


def _search_run(limit: int, rows: int, steps: int, **controller: Any) -> tuple[str, int]:
    """The outcome (``"ok"`` or the error's start) and the OOMs of the same steps with the search alone."""
    run = Run(limit, **controller)
    run.step = eb.ElasticStep(run.model, controller=run.controller, memory=None)
    try:
        for _ in range(steps):
            run.backward(_batch(rows))
    except eb.ElasticOOMError as err:
        return str(err).split(" (")[0], run.budget.oom_count
    return "ok", run.budget.oom_count


def _predicted_run(limit: int, rows: int, steps: int, **controller: Any) -> tuple[str, int, Run]:
    run = Run(limit, **controller)
    try:
        for _ in range(steps):
            run.backward(_batch(rows))
    except eb.ElasticOOMError as err:
        return str(err).split(" (")[0], run.budget.oom_count, run
    return "ok", run.budget.oom_count, run


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("rows", "controller", "count"),
    [
        (ROWS, {"max_split_count": 4}, None),  # not one row fits: an OOM of the measuring piece ended nothing
        (39, {"min_microbatch_size": 4}, None),  # the measuring piece of 4 rows does not fit
        (ROWS, {"min_microbatch_size": 2, "max_split_count": 6}, 32),  # the second measuring piece does not fit
    ],
    ids=["max-split-nothing-fits", "min-size-nothing-fits", "second-piece-fails"],
)
def test_when_nothing_the_limits_allow_fits_prediction_raises_as_the_search_does(
    rows: int, controller: dict[str, Any], count: int | None
) -> None:
    limit = _peak(_model(), _batch(rows), rows) // 2 if count is None else _peak(_model(), _batch(rows), count) + 64
    search = _search_run(limit, rows, 2, **controller)
    outcome, ooms, _ = _predicted_run(limit, rows, 2, **controller)
    assert outcome == search[0] and outcome.startswith("out of memory on a batch of")
    assert ooms <= search[1] + 1


def test_max_split_count_holds_while_measuring() -> None:
    run = Run(1 << 30, max_split_count=2)
    for _ in range(3):
        run.backward(_batch())
    assert all(len(rows) <= 2 for rows in run.rows)  # the measuring ramp ran 7 pieces
    run = Run(_limit(4), max_split_count=5)
    run.backward(_batch())
    assert len(run.rows[0]) <= 5 and sum(run.rows[0]) == ROWS


def _lengths_batch(collate: eb.ElasticCollate, seed: int) -> eb.ElasticBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [40 - i for i in range(30)]  # longest first: token-balanced pieces of the long rows have few rows
    return collate([{"ids": torch.randint(1, 50, (n,), generator=g)} for n in lengths])


@pytest.mark.parametrize("margin", [0.05, None], ids=["predicted", "search"])
def test_min_microbatch_size_holds_in_the_tokens_unit(margin: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    collate = eb.ElasticCollate(pad_values={"ids": 0})
    rows_seen: list[int] = []

    def loss_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        rows_seen.append(len(mb["ids"]))
        return nn.functional.cross_entropy(model(mb["ids"]).flatten(0, 1), mb["ids"].flatten(), ignore_index=0)

    budget = MemoryBudget()
    with budget:
        loss_fn(_lengths_batch(collate, 0).unwrap()).backward()
    model.zero_grad(set_to_none=True)
    budget = MemoryBudget(budget.peak_bytes // 8)
    controller = eb.SplitController(unit="tokens", min_microbatch_size=3, margin=margin)
    step = eb.ElasticStep(model, controller=controller, memory=budget)
    for seed in range(3):
        with budget:
            step.backward(_lengths_batch(collate, seed), loss_fn)
        model.zero_grad(set_to_none=True)
    assert controller.split_count > 1 and min(rows_seen) >= 3


def _gradient_heavy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))


def test_a_gradient_heavy_model_settles_near_the_fewest_not_at_one_row_microbatches() -> None:
    """The accumulation temporaries (about the largest gradient) are bytes per microbatch, not per row."""
    batch = _batch(128)
    loss = _loss

    def peak(count: int) -> int:
        model, budget = _gradient_heavy(), MemoryBudget()
        with budget:
            eb.ElasticStep(model, controller=eb.SplitController(count, margin=None), memory=None).backward(
                batch, loss(model)
            )
        return budget.peak_bytes

    limit = peak(4) + 64
    assert peak(3) > limit  # 4 balanced microbatches fit, 3 do not
    model, budget = _gradient_heavy(), MemoryBudget(limit)
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller, memory=budget)
    counts = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        with budget:
            step.backward(batch, loss(model))
        counts.append(controller.split_count)
    assert budget.oom_count <= 1 and counts[-1] <= 5 and counts[-2] == counts[-1]  # ran 128 one-row microbatches
    assert controller.memory is not None and controller.memory.ready


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError], ids=["interrupt", "user-error"])
def test_an_interrupt_in_a_measured_attempt_leaves_the_controller_as_it_was(error: type[BaseException]) -> None:
    run = Run(_limit(6))
    before = run.controller.state_dict()

    def loss_fn(mb: Any) -> torch.Tensor:
        if mb.index == 3:  # the 4th microbatch of the measured first attempt
            raise error("raised by the test")
        return _loss(run.model)(mb.unwrap())

    with pytest.raises(error, match="raised by the test"), run.budget:
        run.step.backward(_batch(), loss_fn, unwrap=False)
    assert run.controller.state_dict() == before and not run.controller.predicting()


def test_split_count_microbatch_size_and_the_log_report_the_pieces_that_ran(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_batches.controller")
    run = Run(_limit(6))
    run.backward(_batch())
    pieces = run.rows[0]
    assert (run.controller.split_count, run.controller.microbatch_size) == (len(pieces), max(pieces))
    assert f"split_count={len(pieces)}, microbatch_size={max(pieces)}" in repr(run.controller)
    ran = [r.getMessage() for r in caplog.records if " ran as " in r.getMessage()]
    assert ran[-1].startswith(f"a batch of {ROWS} rows ran as {len(pieces)} microbatches of {min(pieces)} to ")
    run.backward(_batch())
    assert run.controller.split_count == len(run.rows[-1]) and run.controller.microbatch_size == max(run.rows[-1])


def test_a_batch_that_fits_whole_runs_whole_once_the_model_predicts_it() -> None:
    run = Run(_limit(1) * 2)
    for _ in range(3):
        run.backward(_batch())
    assert len(run.rows[0]) > 1 and run.rows[1:] == [[ROWS], [ROWS]] and run.budget.oom_count == 0


def test_memory_that_grows_back_after_a_spike_is_used_again_within_the_stated_batches() -> None:
    limit = _limit(4)
    fewest = _fewest(_model(), _batch(), limit)
    run = Run(limit)
    spike = [False]

    def loss_fn(mb: Any) -> torch.Tensor:
        loss = _loss(run.model)(mb)
        if spike[0]:  # once: memory the model did not foresee, in the attempt's first microbatch
            spike[0] = False
            loss = loss + 0.0 * torch.zeros(limit // 4).sum()
        return loss

    for _ in range(3):
        run.backward(_batch())
    spike[0] = True
    run.backward(_batch(), loss_fn)
    assert run.controller.oom_count == 1 and run.controller.memory is not None and run.controller.memory.margin > 0.05
    for _ in range(RECOVER_AFTER + 2):  # 8 calm batches narrow the margin, the vote after them plans the next
        run.backward(_batch())
    assert len(run.rows[-1]) <= max(fewest + 1, math.floor(1.1 * fewest))
    assert run.controller.memory is not None and run.controller.memory.margin == pytest.approx(0.05)


def test_memory_after_a_spike_in_the_first_batch_s_measuring_attempt_is_used_again_within_the_stated_batches() -> None:
    limit = _limit(2)
    fewest = _fewest(_model(), _batch(), limit)
    run = Run(limit)
    with inject_oom(run.model, phase="forward", calls=3) as oom:  # the ramp's fourth piece (8 rows): a moment's spike
        run.backward(_batch())
    assert oom.fired == 1 and max(run.rows[0]) < 8
    for _ in range(RECOVER_AFTER + 4):
        run.backward(_batch())
    # at the narrowing the size that failed is tried again, fits, and the failure goes: the batch after plans freely
    assert len(run.rows[-1]) <= max(fewest + 1, math.floor(1.1 * fewest))
    assert run.budget.oom_count == 0 and run.controller.oom_count == 1


def test_a_size_past_a_caching_allocator_s_segment_is_not_tried_again_at_every_narrowing_of_the_margin() -> None:
    # 8 MiB of a caching allocator: 64 rows of 4096 floats make a 1 MiB activation, from the small pool; from 65 rows
    # it needs a 20 MiB segment, which never fits. The measured line cannot see that jump.
    budget = MemoryBudget(8 << 20, allocator="caching")
    with budget:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4096), nn.Tanh(), nn.Linear(4096, 1))
    step = eb.ElasticStep(model, controller=eb.SplitController(), memory=budget)
    batch = _batch(256)
    ooms = []
    for _ in range(12 * RECOVER_AFTER):  # narrowings every 8 calm batches (16 after an OOM) while a failure moves up
        before = step.controller.oom_count
        model.zero_grad(set_to_none=True)
        with budget:
            step.backward(batch, _loss(model))
        ooms.append(step.controller.oom_count - before)
    grads = _grads(model)
    _assert_close(grads, _reference(model, batch))
    assert step.controller.split_count == 4 and step.controller.microbatch_size == 64  # the fewest that fit
    # the measuring attempt's failure (74 rows) is tried again before any larger size, one narrowing at a time: past it
    # the first size that makes fewer microbatches (86 rows, 3 of them) fails once and is kept, never tried again
    assert sum(ooms) <= 2 and sum(ooms[1:]) <= 1, ooms
    assert step.controller.memory is not None
    state = step.controller.memory.state_dict()
    assert [size for size, _ in state["failures"]] == state["kept"] == [86] and state["moved"] == []


def test_a_predicted_state_loaded_without_a_margin_starts_at_the_learned_count() -> None:
    run = Run(_limit(6))
    for _ in range(3):
        run.backward(_batch())
    learned = len(run.rows[-1])
    search = Run(_limit(6), margin=None)
    search.step = eb.ElasticStep(search.model, controller=search.controller, memory=None)
    search.controller.load_state_dict(run.controller.state_dict())
    search.backward(_batch())
    assert search.budget.oom_count == 0 and len(search.rows[0]) <= learned + 1


class _NoRoom(_Lying):
    """A probe whose in-use bytes pass its capacity (a stale or foreign figure)."""

    def memory_reading(self) -> MemoryReading:
        return MemoryReading(self.budget.live_bytes + 1 << 40, 1 << 30)


class _Raising(_Lying):
    def memory_reading(self) -> MemoryReading:
        raise RuntimeError("the driver's memory query failed")


@pytest.mark.parametrize("probe", [_NoRoom, _Raising], ids=["in-use-over-capacity", "raises"])
def test_a_probe_that_cannot_plan_falls_back_to_the_search_and_says_so_once(probe: type[_Lying]) -> None:
    run = Run(_limit(6))
    run.step = eb.ElasticStep(run.model, controller=run.controller, memory=probe(run.budget))
    with pytest.warns(UserWarning, match="planned by the OOM-driven search") as caught:
        for _ in range(3):
            grads = run.backward(_batch())
    assert len([w for w in caught if "OOM-driven search" in str(w.message)]) == 1
    _assert_close(grads, _reference(run.model, _batch()))
    assert all(len(rows) < ROWS for rows in run.rows)  # not 1-row microbatches: the search's plan
    assert not run.controller.predicting()
