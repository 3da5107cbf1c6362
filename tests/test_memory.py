"""``memory`` and ``memory_model``: the probes, and the model fitted from what they measure.

The model's numbers are exact: measurements are made-up integers, so the fit is checked to the
byte (``fixed`` and ``per_unit`` of a line through exact points are exact in float64).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from typing import Any

import pytest
import torch

from elastic_batches.memory import (
    RECOVER_AFTER,
    AcceleratorProbe,
    MemoryModel,
    MemoryReading,
    active_probe,
    device_probe,
)
from elastic_batches.testing import MemoryBudget, StandInCuda, inject_oom


def _linear(model: MemoryModel, fixed: int, per_unit: int, sizes: list[int], retained: int = 0) -> MemoryModel:
    model.observe(sizes[0], fixed + per_unit * sizes[0] + retained, first=True)
    model.observe_retained(retained)
    for size in sizes[1:]:
        model.observe(size, fixed + per_unit * size, first=False)
    return model


def test_a_line_through_exact_measurements_is_found_exactly() -> None:
    model = _linear(MemoryModel(), fixed=3000, per_unit=700, sizes=[1, 10, 40, 25], retained=5000)
    assert (model.fixed, model.per_unit, model.retained) == (3000.0, 700.0, 5000)
    assert model.predict(30) == 5000 + 3000 + 21000
    # 50_000 * 0.95 - 10_000 in use - 5000 retained = 32_500: 3000 + 42 * 700 (beyond the 40 measured, the slope
    # from 25 to 40 rows is the line's)
    assert model.largest(MemoryReading(10_000, 50_000)) == 42
    assert model.largest(MemoryReading(10_000, 40_000)) == 28  # within what was measured: the line, 3000 + 28 * 700
    assert model.largest(MemoryReading(10_000, 50_000), started=True) == 49  # the retained bytes in use already


def test_beyond_the_largest_size_measured_the_increment_grows_at_least_in_proportion() -> None:
    # a peak that is the larger of two lines: 30_000 bytes of gradient below 15 rows, 2000 per row above
    model = MemoryModel()
    model.observe(1, 30_000, first=True)
    model.observe_retained(0)
    for size in (2, 4, 8):  # the forward holds the activations: 1600 bytes per row
        model.observe(size, max(30_000, 2000 * size), first=False, forward=1600 * size)
    assert model.increment(8) == 30_000 and model.increment(32) >= 2000 * 32  # the line alone would say 30_000
    # 95_000 bytes: from 8 rows (30_000) on at 1.25 x 1600 per row, 40 rows (47 would fit: it errs on the safe side)
    assert model.largest(MemoryReading(0, 100_000)) == 40


def test_beyond_the_largest_size_the_slope_just_below_it_continues() -> None:
    model = MemoryModel()
    model.observe(1, 5000, first=True)
    model.observe_retained(0)
    for size in (1, 2, 3, 4, 6):  # flat up to 3 rows, then 3000 per row
        model.observe(size, max(9000, 3000 * size), first=False)
    assert model.increment(10) >= 30_000  # the line through all of them would say 25_400
    assert all(model.increment(s) >= max(9000, 3000 * s) for s in (1, 2, 3, 4, 6))


def test_before_a_second_size_the_line_goes_through_the_origin_and_over_every_point() -> None:
    model = MemoryModel()
    model.observe(1, 9000, first=True)  # the first microbatch alone: an upper bound per row
    assert (model.fixed, model.per_unit, model.ready) == (0.0, 9000.0, False)
    model.observe_retained(4000)
    model.observe(20, 20_000, first=False)
    model.observe(21, 20_500, first=False)  # 20 and 21 rows do not spread enough for a slope
    assert not model.ready and model.per_unit == 1000.0  # through the origin: it does not plan a whole attempt
    model.observe(32, 26_000, first=False)  # 1.5x apart: a slope of its own
    assert model.ready and model.per_unit < 1000.0
    assert all(model.increment(s) >= y for s, y in ((20, 20_000), (21, 20_500)))


def test_the_line_lies_above_every_measurement_and_failure() -> None:
    model = _linear(MemoryModel(), fixed=1000, per_unit=100, sizes=[1, 10, 30])
    model.observe(20, 1000 + 100 * 20 + 400, first=False)  # one microbatch above the line
    assert all(model.increment(s) >= 1000 + 100 * s for s in (10, 30)) and model.increment(20) >= 3400
    wrong = model.observe_failure(25, free=5000, first=False)  # 25 rows did not fit in 5000 bytes free
    assert wrong and model.increment(25) > 5000


def test_a_failure_bounds_the_sizes_from_it_on_and_leaves_the_measured_line_below_it() -> None:
    model = _linear(MemoryModel(0.0), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(40, free=20_000, first=False)  # far above the line's 5000 at 40: the probe missed something
    assert (model.increment(10), model.increment(20)) == (2000, 3000)  # what was measured holds
    assert model.increment(40) == 20_100  # a unit's bytes (the line's 100) over what was free when it failed
    assert model.increment(60) == 22_100  # and the line's 100 per unit beyond it
    assert model.increment(30) == 3000 + math.ceil((20_100 - 3000) / 2)  # on the line from (20, 3000) to the bound
    assert model.margin == 0.05  # it had predicted 5000 bytes: an OOM it did not predict widens the margin
    assert model.largest(MemoryReading(in_use=0, capacity=10_000)) == 27  # 9500 usable: 3000 + 855 * 7
    assert model.largest(MemoryReading(in_use=0, capacity=2_500)) == 13  # 2375 usable, on the measured line


def test_an_oom_it_did_not_predict_widens_the_margin_and_after_four_prediction_turns_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_batches.memory_model")
    model = _linear(MemoryModel(0.05), fixed=0, per_unit=100, sizes=[1, 10, 30])
    margins = []
    for size in (12, 13, 14, 15, 16):
        model.observe_failure(size, free=10 * size * 100, first=False)  # predicted 100 * size: far below the free
        margins.append(model.margin)
    assert margins == [0.10, 0.20, 0.40, 0.50, 0.50] and model.wrong == 5
    assert not model.enabled and not model.ready and model.describe() == "off after 5 OOMs it did not predict"
    assert caplog.records[0].getMessage() == (
        "memory model: a microbatch of 12 rows ran out of memory where it predicted 1.17 KiB: margin 5% -> 10%"
    )
    assert "prediction off" in caplog.records[-1].getMessage()


def test_a_failure_it_predicted_changes_the_fit_only() -> None:
    model = _linear(MemoryModel(0.05), fixed=0, per_unit=100, sizes=[1, 10, 30])
    assert not model.observe_failure(30, free=2000, first=False)  # needs 3000: the capacity shrank under the plan
    assert (model.margin, model.wrong) == (0.05, 0)


def test_a_first_microbatch_that_fails_is_weighed_with_the_retained_bytes() -> None:
    model = _linear(MemoryModel(), fixed=0, per_unit=100, sizes=[1, 10, 30], retained=5000)
    assert model.observe_failure(20, free=8000, first=True)  # predicted 5000 + 2000 <= 8000: wrong
    assert model.predict(20) > 8000


def test_memory_that_falls_drops_the_older_measurements() -> None:
    model = _linear(MemoryModel(), fixed=2000, per_unit=100, sizes=[1, 10, 40])
    model.observe(40, 1000 + 100 * 40, first=False)  # a layer frozen: 1000 bytes less per microbatch
    assert model.increment(40) == 5000 and model.per_unit == 125.0  # through the one point left


def test_a_larger_success_contradicts_an_older_failure() -> None:
    model = _linear(MemoryModel(), fixed=0, per_unit=100, sizes=[1, 10, 30])
    model.observe_failure(20, free=1500, first=False)
    assert model.increment(20) > 1500
    model.observe(25, 2500, first=False)  # 25 rows took 2500: the failure at 20 no longer holds
    assert model.increment(20) == 2000


def _narrow(model: MemoryModel) -> None:
    for _ in range(RECOVER_AFTER):
        model.calm_batch()


@pytest.mark.parametrize("measuring", [False, True], ids=["planned", "measuring"])
def test_a_failure_beyond_every_size_that_fitted_is_kept_at_a_narrowing_when_a_planned_attempt_made_it(
    measuring: bool,
) -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False, measuring=measuring)  # the line said 4000 fits: wrong
    assert model.margin == 0.10
    _narrow(model)
    assert model.margin == 0.05 and model.wrong == 0
    # planned: the model's own error there, kept (else the size fails again at every narrowing); measuring: the
    # cache was shaped by the ramp's pieces of other sizes, so it is tried again, and nothing larger yet
    assert model.failed_at(30) is not measuring and model.failed_at(31)
    # 4550 free: the kept failure wants a unit's 100 bytes over its 4500 at 30, the line from (20, 3000) up to
    # it 4440 at 29; moved to 31, the line from (20, 3000) up to 4600 there is 4455 at 30
    assert model.largest(MemoryReading(0, 4550), margin=0.0) == (30 if measuring else 29)


def test_a_measuring_attempt_s_failure_moves_up_one_narrowing_at_a_time_then_is_forgotten() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False, measuring=True)
    bounds = []
    for _ in range(5):
        _narrow(model)
        bounds.append(next((size for size in range(1, 100) if model.failed_at(size)), None))
    # one unit past 30 (30 tried again before any larger), then the distance doubled and one more; past 30 forgotten
    assert bounds == [31, 33, 37, 45, None]
    # forgotten: with plenty free the line alone plans, 1000 + 100 * 90
    assert model.largest(MemoryReading(0, 10_000), margin=0.0) == 90


def test_a_moved_failure_goes_when_its_own_size_fits_as_after_a_spike() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False, measuring=True)
    _narrow(model)
    assert model.failed_at(31)
    model.observe(30, 4000, first=False)  # the size that failed fits in less than was free then: a moment's spike
    assert not model.failed_at(99) and model.largest(MemoryReading(0, 10_000), margin=0.0) == 90


def test_a_moved_failure_that_a_planned_attempt_fails_below_leaves_the_planned_failure_kept() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False, measuring=True)
    _narrow(model)
    model.observe_failure(30, free=4500, first=False)  # the size tried again in a planned attempt: not a fluke
    for _ in range(4):
        _narrow(model)
    assert model.failed_at(30) and not model.failed_at(29)


def test_a_failure_a_measurement_contradicts_is_forgotten_at_a_narrowing_as_a_spike() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(20, free=3200, first=False)  # 20 fitted in 3000 before: 3200 free was a moment's spike
    assert model.failed_at(20) and model.margin == 0.10  # it had predicted 3000, no more than was free: wrong
    _narrow(model)
    assert not model.failed_at(20)


def test_a_kept_failure_goes_when_memory_per_microbatch_falls() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False)
    _narrow(model)
    assert model.failed_at(30)
    model.observe(20, 1500, first=False)  # half of what 20 took: a layer frozen
    assert not model.failed_at(30)


def test_state_round_trip_refits_the_same_model() -> None:
    model = _linear(MemoryModel(0.1, unit="tokens"), fixed=300, per_unit=7, sizes=[64, 640, 1280], retained=99)
    model.observe_failure(2000, free=10_000, first=False)
    state = model.state_dict()
    assert json.loads(json.dumps(state)) == state
    restored = MemoryModel(0.05, unit="tokens")
    restored.load_state_dict(copy.deepcopy(state))
    assert restored.state_dict() == {**state, "base_margin": 0.05}  # its own margin, at least the saved one
    assert (restored.fixed, restored.per_unit, restored.retained, restored.margin) == (
        model.fixed,
        model.per_unit,
        99,
        model.margin,
    )


def test_a_state_keeps_which_failures_are_kept_and_one_written_before_them_loads_with_none_kept() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False)  # a planned attempt's: kept at narrowings
    state = model.state_dict()
    assert state["version"] == 4 and state["kept"] == [30]
    restored = MemoryModel(0.05)
    restored.load_state_dict(state)
    _narrow(restored)
    assert restored.failed_at(30)
    older = {key: value for key, value in state.items() if key not in ("kept", "moved")}
    restored.load_state_dict({**older, "version": 2})  # written before: nothing kept, forgotten at a narrowing
    assert restored.state_dict()["kept"] == []
    with pytest.raises(ValueError, match=r"state\['kept'\] must be a list of sizes in state\['failures'\], got \[7\]"):
        restored.load_state_dict({**state, "kept": [7]})


def test_a_state_keeps_where_failures_moved_from_and_one_written_before_them_loads_with_none_moved() -> None:
    model = _linear(MemoryModel(0.05), fixed=1000, per_unit=100, sizes=[1, 10, 20])
    model.observe_failure(30, free=4500, first=False, measuring=True)
    _narrow(model)
    state = model.state_dict()
    assert state["version"] == 4 and state["moved"] == [[31, 30]] and state["failures"] == [[31, 4500]]
    restored = MemoryModel(0.05)
    restored.load_state_dict(state)
    _narrow(restored)
    assert restored.state_dict()["moved"] == [[33, 30]]  # it goes on moving from where the saved one was
    older = {key: value for key, value in state.items() if key != "moved"}
    restored.load_state_dict({**older, "version": 3})  # written before: the failure stays where it is, not moved
    assert restored.state_dict()["moved"] == []
    message = r"state\['moved'\] must be a list of \[size in state\['failures'\] and not kept, 1 <= origin < size\]"
    for moved in ([[31, 31]], [[32, 30]], [[31]]):
        with pytest.raises(ValueError, match=message):
            restored.load_state_dict({**state, "moved": moved})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"later": [[0, 5]]}, r"state\['later'\] must be a list of \[size >= 1, bytes >= 0\] pairs, got \[\[0, 5\]\]"),
        ({"margin": 0.9}, r"state\['margin'\] must be a number in \[0, 0.5\], got 0.9"),
        ({"unit": "tokens"}, r"state\['unit'\] must be 'rows' \(the controller's unit\), got 'tokens'"),
        ({"extra": 1}, r"missing keys \[\], unexpected keys \['extra'\]"),
    ],
    ids=["pairs", "margin", "unit", "unexpected"],
)
def test_a_bad_state_is_named_and_nothing_is_loaded(change: dict[str, Any], message: str) -> None:
    model = _linear(MemoryModel(), fixed=10, per_unit=10, sizes=[1, 5, 20])
    before = model.state_dict()
    with pytest.raises(ValueError, match=message):
        model.load_state_dict({**before, **change})
    assert model.state_dict() == before


def test_margin_is_checked() -> None:
    with pytest.raises(ValueError, match=r"MemoryModel: margin must be a fraction of the capacity in \[0, 0.5\]"):
        MemoryModel(0.7)


# -- probes --------------------------------------------------------------------------------------


def test_a_memory_budget_window_leaves_its_peak_bytes_alone() -> None:
    budget = MemoryBudget(limit_bytes=1 << 20)
    with budget:
        big = torch.ones(1000)
        del big
        before = budget.start_window()
        small = torch.ones(10)
    assert (before, budget.window_peak(), budget.peak_bytes) == (0, 40, 4000)
    assert budget.memory_reading() == MemoryReading(40, 1 << 20)
    del small


def test_no_probe_on_a_cpu_and_the_accelerator_probe_says_which_devices_it_measures() -> None:
    assert device_probe("cpu") is None and device_probe(None) is None
    with pytest.raises(ValueError, match="AcceleratorProbe measures cuda or xpu memory, not cpu: use device_probe"):
        AcceleratorProbe("cpu")


class _FakeCuda:
    """What torch.cuda reports on a 16 GiB device: 6 GiB allocated, 8 GiB reserved (2 GiB cached), 5 GiB free."""

    GiB = 1 << 30

    def __init__(self, fraction: float) -> None:
        self.fraction, self.resets = fraction, 0

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def mem_get_info(self, device: Any) -> tuple[int, int]:
        return 5 * self.GiB, 16 * self.GiB

    def get_per_process_memory_fraction(self, device: Any) -> float:
        return self.fraction

    def memory_reserved(self, device: Any) -> int:
        return 8 * self.GiB

    def memory_allocated(self, device: Any) -> int:
        return 6 * self.GiB

    def max_memory_allocated(self, device: Any) -> int:
        return 7 * self.GiB

    def max_memory_reserved(self, device: Any) -> int:
        return 9 * self.GiB

    def reset_peak_memory_stats(self, device: Any) -> None:
        self.resets += 1


@pytest.mark.parametrize(
    ("fraction", "capacity"),
    [(1.0, 13 << 30), (0.5, 8 << 30), (0.3, (4915 << 20) - (1 << 20))],
    ids=["whole-device", "fraction-0.5", "fraction-0.3"],
)
def test_the_cuda_probe_counts_the_allocator_cache_as_free_and_keeps_to_the_fraction(
    monkeypatch: pytest.MonkeyPatch, fraction: float, capacity: int
) -> None:
    fake = _FakeCuda(fraction)
    monkeypatch.setattr(torch, "cuda", fake)
    probe = AcceleratorProbe("cuda")
    # capacity: reserved (8, of which 2 cached and free for this process's tensors) + 5 free, at most fraction x 16,
    # in whole 2 MiB segments (0.3 x 16 GiB is 4915.2 MiB: the allocator can reserve 4914 of them)
    assert probe.memory_reading() == MemoryReading(6 * fake.GiB, capacity)
    assert (probe.start_window(), probe.window_peak(), fake.resets) == (6 * fake.GiB, 7 * fake.GiB, 1)
    assert repr(probe) == "AcceleratorProbe('cuda:0')"


# ---------------------------------------------------------------------------------------------
# memory="auto" under an active budget; the user's peak statistics under the CUDA probe (a stand-in)


def _mlp_step(memory: Any = "auto") -> tuple[torch.nn.Module, Any, Any]:
    import elastic_batches as eb

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    step = eb.ElasticStep(model, memory=memory)
    batch = (torch.randn(128, 64), torch.randn(128, 1))

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (model(mb[0]) - mb[1]).pow(2).mean()

    return model, step, lambda: step.backward(batch, loss_fn)


def test_memory_auto_measures_with_the_active_memory_budget() -> None:
    _, step, run = _mlp_step()
    with MemoryBudget(limit_bytes=64 << 20) as budget:
        assert active_probe() is budget
        run()
    model = step.controller.memory
    assert model is not None and model.ready and model.unprobed is None  # it measured and fitted
    assert model.per_unit > 0 and budget.peak_bytes > 0
    _, outside, run_outside = _mlp_step()
    run_outside()  # a CPU, no budget: no probe, nothing measured
    assert outside.controller.memory is not None and not outside.controller.memory.ready
    assert outside.controller.memory.unprobed == "cpu" and active_probe() is None
    with MemoryBudget(limit_bytes=64 << 20):  # the same step, later under a budget: it measures from then on
        run_outside()
    assert outside.controller.memory.ready and outside.controller.memory.unprobed is None


def test_memory_auto_under_a_budget_predicts_as_the_probe_passed_explicitly() -> None:
    splits = []
    for memory in ("auto", "explicit"):
        budget = MemoryBudget(limit_bytes=320 << 10)
        _, step, run = _mlp_step(memory=budget if memory == "explicit" else "auto")
        with budget:
            for _ in range(3):
                run()
        splits.append((step.controller.split_count, step.controller.oom_count, budget.oom_count))
    assert splits[0] == splits[1] and splits[0][0] > 1  # the same split, the same OOMs, as memory=budget


def test_the_stand_in_refuses_a_device_without_an_index_where_cuda_does() -> None:
    cuda = StandInCuda(64 << 20)
    with pytest.raises(ValueError, match=r"Expected a torch.device with a specified index or an integer"):
        cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"Expected a torch.device with a specified index or an integer"):
        cuda.caching_allocator_alloc(512, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"Expected a cuda device, but got: cpu"):
        cuda.memory_allocated(torch.device("cpu"))
    assert cuda.memory_allocated(torch.device("cuda")) == 0  # the statistics take the current device


@pytest.mark.parametrize(
    ("taken_mib", "capacity_mib"), [(0, 32), (16, 32), (40, 24)], ids=["none", "16-MiB-of-32-free", "40-MiB"]
)
def test_another_process_takes_the_device_free_memory_not_this_process_fraction(
    taken_mib: int, capacity_mib: int
) -> None:
    cuda = StandInCuda(64 << 20)
    cuda.set_per_process_memory_fraction(0.5, 0)  # 32 MiB for this process, of 64
    probe = AcceleratorProbe(torch.device("cuda", 0), module=cuda)
    with cuda.budget:
        held = torch.empty(12 << 18)  # 12 MiB: a segment of its own
    cuda.take_by_another_process(taken_mib << 20)
    assert cuda.mem_get_info()[0] == (64 - 12 - taken_mib) << 20
    assert probe.memory_reading() == (12 << 20, capacity_mib << 20)  # reserved + free, within the fraction
    with cuda.budget:  # the budget runs out where CUDA would: at the capacity the probe reports
        more = torch.empty((capacity_mib - 12) << 18)  # the rest of the capacity, in one segment
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1)  # a 2 MiB segment more
    del held, more


@pytest.mark.parametrize("earlier", [0, 8 << 20], ids=["no-earlier-peak", "earlier-8-MiB-peak"])
@pytest.mark.parametrize("probed", [False, True], ids=["memory-None", "cuda-probe"])
def test_the_user_peak_statistics_after_a_step_report_the_true_maximum(earlier: int, probed: bool) -> None:
    cuda = StandInCuda(256 << 20)
    probe = AcceleratorProbe(torch.device("cuda", 0), module=cuda) if probed else None
    _, step, run = _mlp_step(memory=probe)
    with MemoryBudget() as truth, cuda.budget:  # `truth` sees every allocation and is never reset
        cuda.reset_peak_memory_stats()  # the user's own reset, then an earlier peak of theirs
        held = torch.empty(earlier // 4)
        del held
        run()
    assert cuda.max_memory_allocated() == truth.peak_bytes >= earlier
    assert cuda.memory_stats()["allocated_bytes.all.peak"] == truth.peak_bytes  # what DeviceStatsMonitor reads
    if probed:
        assert step.controller.memory is not None and step.controller.memory.ready  # it did measure per microbatch


@pytest.mark.parametrize(
    ("earlier", "oom"),
    [(12 << 20, False), (32 << 20, False), (-8, False), (12 << 20, True)],
    ids=[
        "user-emptied-12-MiB",
        "user-emptied-32-MiB",
        "user-emptied-8-small-segments",
        "the-step-emptied-after-an-oom",
    ],
)
def test_the_user_reserved_peak_after_a_step_is_the_true_maximum(earlier: int, oom: bool) -> None:
    cuda = StandInCuda(256 << 20)
    probe = AcceleratorProbe(torch.device("cuda", 0), module=cuda)
    model, step, run = _mlp_step(memory=probe)
    seen: list[tuple[int, int]] = []  # (allocated, reserved) peaks, read before every reset of the step's windows
    reset, finish = cuda.reset_peak_memory_stats, probe.finish

    def spy_reset(device: Any = None) -> None:
        seen.append((cuda.max_memory_allocated(), cuda.max_memory_reserved()))
        reset(device)

    def spy_finish() -> None:
        seen.append((cuda.max_memory_allocated(), cuda.max_memory_reserved()))
        finish()

    injected = inject_oom(model[0], phase="backward", calls=1) if oom else contextlib.nullcontext()
    with cuda.budget, injected:  # with an OOM: in the second microbatch's backward
        held = torch.empty(4096)  # the user's model, say: allocated throughout
        cuda.reset_peak_memory_stats()  # the user's own reset, then an earlier peak of theirs
        earlier_tensors = (
            [torch.empty(earlier // 4)] if earlier > 0 else [torch.empty(1 << 18) for _ in range(-earlier)]
        )
        del earlier_tensors  # (-8: eight 1 MiB tensors, each in the small pool: 2 MiB segments)
        if not oom:  # the user's own empty_cache: reserved drops below the peak (else the step's, after the OOM)
            cuda.empty_cache()
        monkey = pytest.MonkeyPatch()
        monkey.setattr(cuda, "reset_peak_memory_stats", spy_reset)
        monkey.setattr(probe, "finish", spy_finish)
        try:
            run()
        finally:
            monkey.undo()
        del held
    true_allocated, true_reserved = max(a for a, _ in seen), max(r for _, r in seen)
    assert true_reserved > seen[-1][1] and len(seen) >= 2  # the last window's peak is below the true one
    assert step.controller.oom_count == int(oom)
    assert (cuda.max_memory_allocated(), cuda.max_memory_reserved()) == (true_allocated, true_reserved)
    assert cuda.memory_stats()["reserved_bytes.all.peak"] == true_reserved  # what DeviceStatsMonitor reads


# ---------------------------------------------------------------------------------------------
# a model spread over two devices in one process (a stand-in with 2 devices)


class _OnDevice(torch.Tensor):
    """A tensor that says it lives on ``device`` (no data): what the engine reads of a parameter to find its devices."""

    @staticmethod
    def __new__(cls, device: torch.device) -> _OnDevice:
        return torch.Tensor._make_wrapper_subclass(cls, (1,), device=device, dtype=torch.float32)  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(func)


_CPU, _CUDA = torch.device("cpu"), [torch.device("cuda", i) for i in (0, 1)]


def test_the_stand_in_has_two_devices_and_checks_their_index_as_cuda_does() -> None:
    cuda = StandInCuda(64 << 20, device_count=2)
    with cuda.budgets[1]:
        x = torch.empty(1 << 18)  # 1 MiB on cuda:1
    assert (cuda.memory_allocated(0), cuda.memory_allocated(torch.device("cuda", 1))) == (0, 1 << 20)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        cuda.memory_allocated(2)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        cuda.set_per_process_memory_fraction(0.5, "cuda")
    del x


def test_the_engine_finds_every_device_of_the_parameters_and_probes_each(monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic_batches as eb
    from elastic_batches.memory import DevicesProbe, devices_probe

    cuda = StandInCuda(64 << 20, device_count=2)
    monkeypatch.setattr(torch, "cuda", cuda)
    step = eb.ElasticStep(torch.nn.Linear(2, 1), memory=None)
    on = [_OnDevice(torch.device("cuda", i)) for i in (0, 1, 1)]
    assert step.engine.devices(on) == (_CPU, *_CUDA)
    probe = devices_probe(_CUDA)
    assert isinstance(probe, DevicesProbe) and [p.device.index for p in probe.probes] == [0, 1]  # type: ignore[attr-defined]
    with cuda.budgets[1]:
        held = torch.empty(4 << 18)  # 4 MiB on cuda:1: the tighter device
    # capacity: the smaller of the two (64 MiB each), in use: what leaves the least room (cuda:1's 4 MiB)
    assert probe.memory_reading() == MemoryReading(4 << 20, 64 << 20)
    assert probe.start_window() == 4 << 20
    with cuda.budgets[0]:
        spike = torch.empty(2 << 18)  # 2 MiB on cuda:0 leaves it more room than cuda:1 has
    del spike
    with cuda.budgets[1]:
        spike = torch.empty(1 << 18)  # 1 MiB more on cuda:1: the least room in the window
    del spike
    assert probe.window_peak() == 5 << 20
    del held


def test_the_random_state_of_both_devices_is_rewound_after_a_failed_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic_batches as eb
    from elastic_batches.testing import inject_oom

    cuda = StandInCuda(64 << 20, device_count=2)
    monkeypatch.setattr(torch, "cuda", cuda)
    spread = [_OnDevice(torch.device("cuda", i)) for i in (0, 1)]  # where device_map="auto" put the parameters

    def run(split_count: int, oom: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        torch.default_generator.manual_seed(0)  # (torch.manual_seed would seed the real torch.cuda)
        for index in (0, 1):
            cuda.generator(index).manual_seed(10 + index)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
        step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split_count), memory=None)
        find = step.engine.devices  # the engine's own search, over parameters on cuda:0 and cuda:1
        monkeypatch.setattr(step.engine, "devices", lambda params, batch=None: find([*(params or ()), *spread], batch))
        masks: list[torch.Tensor] = []

        def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            first = torch.rand(len(mb[0]), 16, generator=cuda.generator(0))  # a dropout on cuda:0
            hidden = model[0](mb[0]) * (first > 0.5)
            second = torch.rand(len(mb[0]), 1, generator=cuda.generator(1))  # one on cuda:1
            masks.append(torch.cat([first.flatten(), second.flatten()]))
            return ((model[1](hidden) * (second > 0.5)) - mb[1]).pow(2).mean()

        batch = (torch.randn(12, 8), torch.randn(12, 1))
        injected = inject_oom(model[1], phase="forward", calls=1) if oom else contextlib.nullcontext()
        with injected:  # with an OOM: in the first attempt's second microbatch
            step.backward(batch, loss_fn)
        assert step.controller.oom_count == int(oom)
        count = step.controller.split_count
        return [p.grad.clone() for p in model.parameters() if p.grad is not None], masks[-count:], count

    retried_grads, retried_masks, count = run(2, oom=True)
    direct_grads, direct_masks, _ = run(count, oom=False)  # the same step run directly at the retry's split
    assert count > 2
    for got, want in zip(retried_masks, direct_masks, strict=True):
        assert torch.equal(got, want)  # both devices' random numbers, as a direct run draws them
    for got, want in zip(retried_grads, direct_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
