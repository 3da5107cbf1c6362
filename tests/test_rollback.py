"""``Rollback``: what a failed attempt changed besides ``.grad`` is put back, and constant buffers are not copied."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from elastic_batches.rollback import Rollback

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
