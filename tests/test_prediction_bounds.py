"""Prediction, bounded by construction: any limits, budget, batch, unit, ``count_fn`` and probe behaviour.

Every ``backward`` call ends, as a success or an ``ElasticOOMError``, after at most ``D + 1``
attempts, ``D`` being the number of distinct largest-piece sizes of the cuts the limits allow
(``docs/search.md``); every attempt keeps to ``max_split_count`` and ``min_microbatch_size``; a call
that returns leaves the full batch's gradient (1e-6 of the largest entry, float32); an error or an
interrupt in the first attempt leaves the controller's state as it was. The probe is exact (the
budget), noisy, lying (more capacity than there is), or raising now and then.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import elastic_batches as eb
from elastic_batches.memory import MemoryProbe, MemoryReading
from elastic_batches.testing import MemoryBudget

PROBES = ("exact", "noisy", "lying", "raising", "none")


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int
    unit: str  # "rows" or "tokens"
    budget: float  # the budget as a fraction of the peak of the whole batch in one piece
    max_split_count: int | None
    min_microbatch_size: int
    count_fn: bool
    probe: str
    failure: str | None  # "error" or "interrupt" in the first attempt's second microbatch, or None


@dataclasses.dataclass
class Outcome:
    ended: str  # "ok", "oom", "error", "interrupt"
    attempts: list[int]  # attempts per call
    bounds: list[int]  # the bound per call


class _Probe(MemoryProbe):
    """The budget's readings, exact, noisy (the capacity within 10%), lying (30% more) or raising every third call."""

    def __init__(self, budget: MemoryBudget, kind: str, seed: int) -> None:
        self.budget, self.kind, self.random, self.calls = budget, kind, random.Random(seed), 0

    def memory_reading(self) -> MemoryReading:
        self.calls += 1
        if self.kind == "raising" and self.calls % 3 == 0:
            raise RuntimeError("the probe's query failed")
        reading = self.budget.memory_reading()
        assert reading.capacity is not None
        scale = {"noisy": self.random.uniform(0.9, 1.1), "lying": 1.3}.get(self.kind, 1.0)
        return MemoryReading(reading.in_use, int(scale * reading.capacity))

    def start_window(self) -> int:
        return self.budget.start_window()

    def window_peak(self) -> int:
        return self.budget.window_peak()


def _batch(case: Case, seed: int) -> tuple[Any, eb.ElasticBatch]:
    generator = torch.Generator().manual_seed(seed)
    if case.unit == "rows":
        x = torch.randn(case.rows, 6, generator=generator)
        return (x, x[:, :1].sin()), eb.ElasticBatch.wrap((x, x[:, :1].sin()))
    lengths = sorted((int(n) for n in torch.randint(1, 12, (case.rows,), generator=generator)), reverse=True)
    samples = [{"x": torch.randn(n, 6, generator=generator)} for n in lengths]
    batch = eb.ElasticCollate(pad_values={"x": 0.0})(samples)
    return batch.unwrap(), batch


def _loss(model: nn.Module, case: Case) -> Any:
    """A mean over rows; in the tokens unit with ``count_fn``, a mean over the real (unpadded) positions."""

    def loss_fn(mb: Any) -> torch.Tensor:
        if case.unit == "rows":
            return (model(mb[0]) - mb[1]).pow(2).mean()
        x = mb["x"]
        mask = (x.abs().sum(-1) > 0).float()
        squares = model(x).squeeze(-1).pow(2) * mask
        if case.count_fn:
            return squares.sum() / mask.sum()
        return (squares.sum(1) / mask.sum(1)).mean()

    return loss_fn


def _count_fn(case: Case) -> Any:
    """What the loss is a mean over: rows, or real positions."""
    if not case.count_fn:
        return None
    if case.unit == "rows":
        return lambda mb: len(mb[0])
    return lambda mb: (mb["x"].abs().sum(-1) > 0).sum()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))


def _bound(load: eb.BatchLoad, controller: eb.SplitController) -> int:
    """``D + 1``: the distinct largest-piece sizes of every cut the limits allow, and one measuring attempt."""
    smallest = controller.min_microbatch_size
    most = load.rows // smallest if controller.max_split_count is None else controller.max_split_count
    counts = range(1, max(1, min(load.rows // smallest, most)) + 1)
    return len({load.largest(load.sizes(k, min_rows=smallest)) for k in counts}) + 1


def run_case(case: Case, seed: int = 0) -> Outcome:
    """Two steps of ``case``; what ended them, and each call's attempts against its bound."""
    model = _model()
    data, batch = _batch(case, seed)
    loss_fn = _loss(model, case)
    measure = MemoryBudget()
    with measure:
        loss_fn(data).backward()
    model.zero_grad(set_to_none=True)
    budget = MemoryBudget(max(1, int(case.budget * measure.peak_bytes)))
    controller = eb.SplitController(
        max_split_count=case.max_split_count, min_microbatch_size=case.min_microbatch_size, unit=case.unit
    )
    probe = None if case.probe == "none" else _Probe(budget, case.probe, seed)
    step = eb.ElasticStep(model, controller=controller, memory=probe)
    load = batch.load(case.unit)
    smallest = min(case.min_microbatch_size, case.rows)
    limit = case.max_split_count or case.rows
    outcome = Outcome("ok", [], [])
    count_fn = _count_fn(case)
    for call in range(2):
        attempts = [0]
        failing = case.failure if call == 0 else None

        def counted(mb: eb.Microbatch, attempts: list[int] = attempts, failing: str | None = failing) -> torch.Tensor:
            if mb.index == 0:
                attempts[0] += 1
            assert mb.count <= limit, f"{mb.count} microbatches, max_split_count={case.max_split_count}"
            assert len(mb) >= smallest, f"a microbatch of {len(mb)} rows, min_microbatch_size={smallest}"
            if failing is not None and attempts[0] == 1 and mb.index == 1:
                raise KeyboardInterrupt if failing == "interrupt" else ValueError("the user's error")
            return loss_fn(mb.unwrap())

        model.zero_grad(set_to_none=True)
        before = controller.state_dict()
        outcome.bounds.append(_bound(load, controller))
        try:
            with budget:
                step.backward(batch, counted, unwrap=False, count_fn=count_fn)
        except eb.ElasticOOMError:
            outcome.attempts.append(attempts[0])
            outcome.ended = "oom"
            return outcome
        except (ValueError, KeyboardInterrupt) as err:
            assert str(err) in ("", "the user's error"), err
            assert controller.state_dict() == before and all(p.grad is None for p in model.parameters())
            outcome.attempts.append(attempts[0])
            outcome.ended = "interrupt" if isinstance(err, KeyboardInterrupt) else "error"
            return outcome
        outcome.attempts.append(attempts[0])
        want = torch.autograd.grad(loss_fn(data), list(model.parameters()))
        got = [p.grad for p in model.parameters()]
        scale = max(float(w.abs().max()) for w in want)
        assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) <= 1e-6 * scale
    return outcome


cases = st.builds(
    Case,
    rows=st.integers(1, 40),
    unit=st.sampled_from(["rows", "tokens"]),
    budget=st.floats(0.02, 1.5),
    max_split_count=st.none() | st.integers(1, 10),
    min_microbatch_size=st.integers(1, 5),
    count_fn=st.booleans(),
    probe=st.sampled_from(PROBES),
    failure=st.sampled_from([None, None, None, "error", "interrupt"]),
)


@pytest.mark.filterwarnings("ignore:elastic_batches. ElasticStep. the memory probe")
@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_any_limits_budget_and_probe_end_within_the_bound_with_the_full_batch_gradient(case: Case) -> None:
    outcome = run_case(case)
    assert all(a <= b for a, b in zip(outcome.attempts, outcome.bounds, strict=True)), outcome


@pytest.mark.filterwarnings("ignore:elastic_batches. ElasticStep. the memory probe")
def test_sixty_random_configurations_end_within_their_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """The table of ``docs/search.md``: how 60 seeded random configurations ended, and in how many attempts."""
    draw = random.Random(24)
    ended: Counter[str] = Counter()
    attempts: Counter[int] = Counter()
    for seed in range(60):
        case = Case(
            rows=draw.randint(1, 40),
            unit=draw.choice(["rows", "tokens"]),
            budget=draw.uniform(0.02, 1.5),
            max_split_count=draw.choice([None, draw.randint(1, 10)]),
            min_microbatch_size=draw.randint(1, 5),
            count_fn=draw.random() < 0.5,
            probe=draw.choice(PROBES),
            failure=None,
        )
        outcome = run_case(case, seed)
        assert all(a <= b for a, b in zip(outcome.attempts, outcome.bounds, strict=True)), (case, outcome)
        ended[outcome.ended] += 1
        attempts[max(outcome.attempts)] += 1
    with capsys.disabled():
        print(f"\n60 configurations, ended: {dict(sorted(ended.items()))}")
        print(f"most attempts in a call: {dict(sorted(attempts.items()))}")
