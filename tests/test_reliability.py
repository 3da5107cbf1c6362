"""Reliability of the core under failures it did not choose, in one process.

Leaks over many OOM-and-retry cycles, memory that shrinks and grows during training,
interruptions in the middle of a microbatch, and state files from elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import elastic_batches as eb

from support.fault_matrix import churn

RTOL = 1e-6


def test_200_oom_and_retry_cycles_leave_memory_where_it_started() -> None:
    figures = churn.oom_retry_cycles(cycles=200)
    assert figures["ooms"] == 200  # each cycle really ran out of memory once
    assert figures["retries"] == 210  # the warm-up's 10 too
    assert figures["live_bytes"] == 0  # gradients dropped: nothing counted by the budget survives
    assert figures["tensors"] == 0
    assert figures["oom_errors"] == 0  # no OOM error (and the frames of its traceback) kept alive
    assert figures["tried"] == 0
    growth = figures["resident_bytes"]
    assert growth < 8 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over 200 cycles"


def test_shrinking_memory_raises_the_count_step_by_step_without_losing_a_batch() -> None:
    figures = churn.shrinking_memory()
    assert figures["settled"] == [1, 2, 3, 4], f"counts settled at each memory level: {figures['settled']}"
    assert figures["gradient_error"] <= RTOL  # every batch ran, whole, exactly once


def test_growing_memory_is_used_by_the_growth_probe_at_a_bounded_probe_rate() -> None:
    figures = churn.growing_memory(grow_after=10)
    assert figures["settled_after"] == figures["settled"]  # memory stays tight: probes fail...
    assert figures["probe_ooms"] <= 5  # ...at most one per 10 steps
    assert figures["freed"] < figures["settled"]  # memory comes back: the count comes down


def test_keyboard_interrupt_mid_microbatch_leaves_state_consistent_and_resume_is_exact():
    data = TensorDataset(torch.randn(40, 16), torch.randn(40, 1))

    def train(interrupt_at: tuple[int, int] | None, resume: dict | None = None):
        model = churn.mlp(seed=1, width=32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = eb.MicrobatchingDataLoader(data, batch_size=8, controller=eb.SplitController(split_count=2))
        if resume is not None:
            model.load_state_dict(resume["model"])
            optimizer.load_state_dict(resume["optimizer"])
            loader.load_state_dict(resume["loader"])
        step = eb.ElasticStep(model, controller=loader.controller)
        checkpoint = None
        calls = {"n": 0}
        for index, batch in enumerate(loader):

            def loss_fn(mb, index=index):
                calls["n"] += 1
                if interrupt_at is not None and (index, mb is not None and calls["n"]) == interrupt_at:
                    raise KeyboardInterrupt
                return churn.mse(model)(mb)

            grads_before = [p.grad for p in model.parameters()]
            controller_before = loader.controller.state_dict()
            try:
                step.backward(batch, loss_fn)
            except KeyboardInterrupt:
                assert [p.grad for p in model.parameters()] == grads_before  # nothing half-accumulated
                assert loader.controller.state_dict() == controller_before
                return model, checkpoint
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            calls["n"] = 0
            checkpoint = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),
            }
        return model, checkpoint

    uninterrupted, _ = train(None)
    _, checkpoint = train(interrupt_at=(3, 2))  # the second microbatch of the fourth batch
    assert checkpoint is not None
    resumed, _ = train(None, resume=checkpoint)
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_controller_state_learned_on_one_batch_size_adapts_to_another():
    fits = 47  # rows per microbatch that fit in memory

    def run(controller: eb.SplitController, rows: int, steps: int) -> int:
        ooms = 0
        for _ in range(steps):
            while True:
                count = controller.plan(rows)
                size = math.ceil(rows / count)
                if size <= fits:
                    controller.record_success(size, rows)
                    break
                ooms += 1
                controller.record_oom(size, rows)
        return ooms

    learned = eb.SplitController()
    assert run(learned, 256, 10) > 0
    resumed = eb.SplitController()
    resumed.load_state_dict(learned.state_dict())
    assert resumed.count_for(100) == 3  # the learned microbatch size (43 rows) holds for another batch size
    # At most a refinement probe inside the interval it had left open, never the descent from scratch:
    assert run(resumed, 100, 10) < run(eb.SplitController(), 100, 10)
    assert resumed.count_for(100) == 3


def test_loader_state_of_another_batch_size_or_version_is_refused():
    data = TensorDataset(torch.randn(40, 3))
    saved = eb.MicrobatchingDataLoader(data, batch_size=8)
    iterator = iter(saved)
    next(iterator)
    state = saved.state_dict()
    other = eb.MicrobatchingDataLoader(data, batch_size=10)
    with pytest.raises(ValueError, match=r"saved with batch_size=8, this loader has batch_size=10"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state version 99 is not supported"):
        eb.MicrobatchingDataLoader(data, batch_size=8).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"state version 0 is not supported"):
        eb.SplitController().load_state_dict({**state["controller"], "version": 0})
