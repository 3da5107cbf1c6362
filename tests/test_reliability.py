"""Reliability of the core under failures it did not choose (issue 6, single process).

Leaks over many OOM-and-retry cycles, memory that shrinks and grows during training,
interruptions in the middle of a microbatch, and state files from elsewhere.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget

RTOL = 1e-6


def _mlp(seed: int = 0, width: int = 256) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))


def _loss_fn(model: nn.Module):
    def loss_fn(mb):
        x, y = mb
        return nn.functional.mse_loss(model(x), y)

    return loss_fn


def _reference_grads(model: nn.Module, batch) -> list[torch.Tensor]:
    x, y = batch
    return list(torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters())))


def _assert_grads_equal(model: nn.Module, reference: list[torch.Tensor], rtol: float = RTOL) -> None:
    for p, ref in zip(model.parameters(), reference, strict=True):
        assert p.grad is not None
        error = ((p.grad - ref).abs().max() / ref.abs().max()).item()
        assert error <= rtol, f"relative gradient error {error:.2e} > {rtol:.0e}"


def _peak_at(model: nn.Module, batch, split_count: int) -> int:
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split_count))
    budget = MemoryBudget(None)
    with budget:
        step.backward(batch, _loss_fn(model))
    model.zero_grad(set_to_none=True)
    return budget.peak_bytes


def _resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _live_ooms() -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is torch.OutOfMemoryError)


def test_200_oom_and_retry_cycles_leave_memory_where_it_started():
    model = _mlp()
    batch = (torch.randn(64, 16), torch.randn(64, 1))
    limit = (_peak_at(model, batch, 1) + _peak_at(model, batch, 2)) // 2
    controller = eb.SplitController(grow_after=1)  # every step after a retry probes the full batch again
    step = eb.ElasticStep(model, controller=controller)
    budget = MemoryBudget(None)
    loss_fn = _loss_fn(model)

    def cycle() -> None:  # one step that OOMs and retries, one that runs whole
        for tight in (True, False):
            budget.limit_bytes = limit if tight else None
            with budget:
                step.backward(batch, loss_fn)
            model.zero_grad(set_to_none=True)

    for _ in range(10):  # warm up allocator, caches and lazy imports
        cycle()
    gc.collect()
    tensors, ooms_alive, resident = _live_tensors(), _live_ooms(), _resident_bytes()
    ooms_before = budget.oom_count
    for _ in range(200):
        cycle()
    gc.collect()

    assert budget.oom_count - ooms_before == 200  # each cycle really ran out of memory once
    assert controller.retry_count == 210
    assert budget.live_bytes == 0  # gradients dropped: nothing counted by the budget survives
    assert _live_tensors() == tensors
    assert _live_ooms() == ooms_alive  # no OOM error (and the frames of its traceback) kept alive
    assert controller._tried == []
    growth = _resident_bytes() - resident
    assert growth < 8 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over 200 cycles"


def test_shrinking_memory_raises_the_count_step_by_step_without_losing_a_batch():
    model = _mlp(width=512)
    batches = [(torch.randn(48, 16), torch.randn(48, 1)) for _ in range(6)]
    peaks = {k: _peak_at(model, batches[0], k) for k in (1, 2, 3, 4, 6)}
    limits = [peaks[1] + 1, (peaks[1] + peaks[2]) // 2, (peaks[2] + peaks[3]) // 2, (peaks[3] + peaks[4]) // 2]
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller)
    budget = MemoryBudget(None)
    settled = []
    for limit in limits:  # the device loses memory (fragmentation, another process)
        budget.limit_bytes = limit
        for batch in batches:
            reference = _reference_grads(model, batch)
            with budget:
                step.backward(batch, _loss_fn(model))
            _assert_grads_equal(model, reference)  # every batch ran, whole, exactly once
            model.zero_grad(set_to_none=True)
        settled.append(controller.split_count)
    assert settled == [1, 2, 3, 4], f"counts settled at each memory level: {settled}"


def test_growing_memory_is_used_by_the_growth_probe_at_a_bounded_probe_rate():
    model = _mlp(width=512)
    batch = (torch.randn(48, 16), torch.randn(48, 1))
    tight = (_peak_at(model, batch, 3) + _peak_at(model, batch, 4)) // 2
    controller = eb.SplitController(grow_after=10)
    step = eb.ElasticStep(model, controller=controller)
    budget = MemoryBudget(tight)
    for _ in range(20):  # settle under the tight limit
        with budget:
            step.backward(batch, _loss_fn(model))
        model.zero_grad(set_to_none=True)
    settled, ooms = controller.split_count, controller.oom_count
    for _ in range(50):  # memory stays tight: probes fail, at most one per 10 steps
        with budget:
            step.backward(batch, _loss_fn(model))
        model.zero_grad(set_to_none=True)
    assert controller.split_count == settled
    assert controller.oom_count - ooms <= 5
    budget.limit_bytes = None  # memory comes back
    for _ in range(60):
        with budget:
            step.backward(batch, _loss_fn(model))
        model.zero_grad(set_to_none=True)
    assert controller.split_count < settled


def test_keyboard_interrupt_mid_microbatch_leaves_state_consistent_and_resume_is_exact():
    data = TensorDataset(torch.randn(40, 16), torch.randn(40, 1))

    def train(interrupt_at: tuple[int, int] | None, resume: dict | None = None):
        model = _mlp(seed=1, width=32)
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
                return _loss_fn(model)(mb)

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
