"""``Rollback``: what a failed attempt changed besides ``.grad`` is put back, and constant buffers are not copied."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.rollback import Rollback
from elastic_batches.testing import inject_oom

CPU = [torch.device("cpu")]


class _Buffers(nn.Module):
    """Each forward changes a counter in place (after ``count_from`` forwards) and reassigns a cache; a constant."""

    def __init__(self, count_from: int = 0) -> None:
        super().__init__()
        self.count_from = count_from
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(3))
        self.register_buffer("constant", torch.arange(6.0))
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards > self.count_from:
            self.calls += 1
        self.cache = x.detach().mean(0)
        return x


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in model.named_buffers()}


def _assert_buffers(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in model.named_buffers():
        assert torch.equal(value, expected[name]), name


def test_batchnorm_running_statistics_come_back_though_their_versions_do_not_move() -> None:
    model = nn.BatchNorm1d(3)
    rollback = Rollback(model)
    for step in range(3):  # the first step copies from host memory, later ones into kept copies
        before = _snapshot(model)
        mean_version = model.running_mean._version
        rollback.save(CPU)
        model(torch.randn(8, 3) + step)
        assert model.running_mean._version == mean_version  # why a version check cannot see it
        rollback.restore()
        _assert_buffers(model, before)
        model(torch.randn(8, 3))  # the retry
        rollback.commit()


def test_a_reassigned_buffer_gets_its_object_back_and_a_counter_its_value() -> None:
    module = _Buffers()
    rollback = Rollback(module)
    for _ in range(2):  # at the first step (host copy), then once the counter is known to change
        before, cache = _snapshot(module), module.cache
        rollback.save(CPU)
        module(torch.randn(4, 3))
        rollback.restore()
        assert module.cache is cache
        _assert_buffers(module, before)
        module(torch.randn(4, 3))
        rollback.commit()


def test_random_generators_come_back() -> None:
    rollback = Rollback(nn.Linear(2, 2))
    torch.manual_seed(5)
    rollback.save(CPU)
    first = torch.rand(4)
    rollback.restore()
    assert torch.equal(torch.rand(4), first)


def test_a_buffer_first_changed_in_place_by_a_failed_attempt_warns_then_is_saved() -> None:
    module = _Buffers(count_from=2)  # the counter starts changing at the third forward
    rollback = Rollback(module)
    for _ in range(2):  # two steps that leave the counter alone: it is taken for a constant
        rollback.save(CPU)
        module(torch.randn(4, 3))
        rollback.commit()
    rollback.save(CPU)
    module(torch.randn(4, 3))  # the counter moves, inside an attempt that fails
    with pytest.warns(UserWarning, match=r"changed a buffer 'calls' of shape \(\) in place for the first time"):
        rollback.restore()
    assert float(module.calls) == 1.0  # this once, not undone
    rollback.forget()
    rollback.save(CPU)
    module(torch.randn(4, 3))
    rollback.restore()
    assert float(module.calls) == 1.0  # saved from now on


def test_a_copy_kept_from_training_is_not_put_back_in_eval_mode() -> None:
    model = nn.BatchNorm1d(3)
    rollback = Rollback(model)
    for _ in range(2):
        rollback.save(CPU)
        model(torch.randn(8, 3))
        rollback.commit()
    model(torch.randn(8, 3) + 5.0)  # trained outside any step: the kept copy is stale now
    model.eval()
    before = _snapshot(model)
    rollback.save(CPU)
    model(torch.randn(8, 3))
    rollback.restore()
    _assert_buffers(model, before)


def test_a_buffer_resized_in_place_gets_a_new_copy() -> None:
    module = _Buffers()
    rollback = Rollback(module)
    for _ in range(2):
        rollback.save(CPU)
        module(torch.randn(4, 3))
        rollback.commit()
    module.calls.resize_(2).fill_(7.0)  # known to change in place, now of another shape
    before = _snapshot(module)
    rollback.save(CPU)
    module.calls.add_(1.0)
    rollback.restore()
    _assert_buffers(module, before)


def test_a_constant_buffer_is_copied_at_the_first_step_only() -> None:
    module = _Buffers()
    rollback = Rollback(module)
    rollback.save(CPU)
    first = {entry[1]: entry[4] for entry in rollback._saved}
    module(torch.randn(4, 3))
    rollback.commit()
    rollback.save(CPU)
    later = {entry[1]: entry[4] for entry in rollback._saved}
    assert all(copy is not None for copy in first.values())
    assert later["constant"] is None and later["cache"] is None  # kept by object and version only
    assert later["calls"] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rollback.restore()


# ---------------------------------------------------------------------------------------------
# State a failed attempt created, and devices without a random generator


def test_a_device_without_a_random_generator_is_skipped() -> None:
    model = nn.Linear(2, 2, device="meta")
    rollback = Rollback(model)
    torch.manual_seed(3)
    rollback.save([torch.device("cpu"), torch.device("meta")])  # raised "Device 'meta' does not have ..."
    first = torch.rand(3)
    rollback.restore()
    assert torch.equal(torch.rand(3), first)


def test_an_elastic_step_runs_a_model_on_the_meta_device() -> None:
    model = nn.Linear(4, 1, device="meta")
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    batch = (torch.randn(6, 4, device="meta"), torch.randn(6, 1, device="meta"))
    loss = step.backward(batch, lambda mb: (model(mb[0]) - mb[1]).pow(2).mean())
    assert loss.device.type == "meta" and model.weight.grad is not None and model.weight.grad.shape == (1, 4)


class _RegistersOnFirstForward(nn.Module):
    """Registers a counter buffer, a parameter and a submodule at its first forward; the counter counts forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "calls"):
            self.register_buffer("calls", torch.zeros(()))
            self.register_parameter("scale", nn.Parameter(torch.ones(())))
            self.extra = nn.Linear(1, 1)
        self.calls += 1
        return self.extra(self.linear(x)) * self.scale


def _retried(model: nn.Module, loss_fn: Any, batch: Any) -> int:
    """A step of ``batch`` at 1 microbatch that runs out of memory in its backward, then the retry; its split."""
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=1), memory=None)
    with inject_oom(model, phase="backward", calls=0) as oom:
        step.backward(batch, loss_fn)
    assert oom.fired == 1
    return step.controller.split_count


def _direct(model: nn.Module, loss_fn: Any, batch: Any, split: int) -> None:
    eb.ElasticStep(model, controller=eb.SplitController(split_count=split), memory=None).backward(batch, loss_fn)


def _loss(model: nn.Module) -> Any:
    return lambda mb: (model(mb[0]) - mb[1]).pow(2).mean()


def test_state_registered_during_a_failed_attempt_goes_with_it() -> None:
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    torch.manual_seed(0)
    retried = _RegistersOnFirstForward()
    split = _retried(retried, _loss(retried), batch)  # the failed attempt's forward registered and counted
    torch.manual_seed(0)
    direct = _RegistersOnFirstForward()
    _direct(direct, _loss(direct), batch, split)
    assert split == 2
    assert float(direct.calls) == 2.0 and float(retried.calls) == 2.0  # the failed attempt's forward is gone
    assert [name for name, _ in retried.named_parameters()] == [name for name, _ in direct.named_parameters()]
    for (name, got), want in zip(retried.named_parameters(), direct.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)


class _LazyDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lazy = nn.LazyLinear(16)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.lazy(x)))


def test_a_lazy_module_initialised_in_a_failed_attempt_is_initialised_again_as_a_direct_run_would() -> None:
    batch = (torch.randn(12, 5), torch.randn(12, 1))
    torch.manual_seed(0)
    retried = _LazyDropout()
    split = _retried(retried, _loss(retried), batch)  # initialised (random numbers drawn) in the failed attempt
    after_retry = torch.rand(4)
    torch.manual_seed(0)
    direct = _LazyDropout()
    _direct(direct, _loss(direct), batch, split)
    assert torch.equal(torch.rand(4), after_retry)  # the generator ends where the direct run's does
    assert type(retried.lazy) is nn.Linear and retried.lazy.in_features == 5
    for (name, got), want in zip(retried.named_parameters(), direct.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)  # the same initialisation
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)  # the same dropout masks


def test_a_lazy_module_the_failed_attempt_did_not_reach_stays_lazy() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(2))
    rollback = Rollback(model)
    rollback.save(CPU)
    rollback.restore()
    assert isinstance(model[1], nn.LazyLinear) and model[1].has_uninitialized_params()
    assert model(torch.randn(2, 3)).shape == (2, 2)
