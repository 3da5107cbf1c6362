"""The core hooks the Lightning integration relies on: ``ElasticStep(backward_fn=)``, ``unwrap=False``, ``evaluate``.

They live in ``elastic_batches/step.py`` and are tested here, without Lightning, against a
full-batch reference.
"""

from __future__ import annotations

import pytest
import torch

import elastic_batches as eb
from elastic_batches.testing import inject_oom


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(10, 4, generator=generator), torch.randn(10, 1, generator=generator)


def _loss(model: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(mb[0]), mb[1])


def _reference_grads() -> list[torch.Tensor]:
    model = _model()
    _loss(model, _batch()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_backward_fn_replaces_backward_and_sees_each_weighted_loss() -> None:
    model = _model()
    seen: list[float] = []

    def backward_fn(loss: torch.Tensor) -> None:
        seen.append(float(loss.detach()))
        loss.backward()

    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3), backward_fn=backward_fn)
    loss = step.backward(_batch(), lambda mb: _loss(model, mb))
    assert len(seen) == 3
    assert sum(seen) == pytest.approx(float(loss), rel=1e-6)
    for got, want in zip((p.grad for p in model.parameters()), _reference_grads(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_backward_fn_and_grad_scaler_together_are_refused() -> None:
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="grad_scaler or backward_fn"):
        eb.ElasticStep(torch.nn.Linear(2, 1), grad_scaler=scaler, backward_fn=lambda loss: loss.backward())


def test_unwrap_false_passes_microbatches_and_restarts_at_index_zero_after_oom() -> None:
    model = _model()
    seen: list[tuple[int, int, float]] = []

    def loss_fn(mb: eb.Microbatch) -> torch.Tensor:
        seen.append((mb.index, mb.count, mb.weight))
        return _loss(model, mb.unwrap())

    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    with inject_oom(model, phase="backward", calls=1):
        step.backward(_batch(), loss_fn, unwrap=False)
    retry = seen[2:]
    assert [(i, c) for i, c, _ in seen[:2]] == [(0, 2), (1, 2)]
    assert [i for i, _, _ in retry] == list(range(len(retry))) and retry[0][1] == len(retry) > 2
    assert sum(w for _, _, w in retry) == pytest.approx(1.0)
    for got, want in zip((p.grad for p in model.parameters()), _reference_grads(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_evaluate_returns_outputs_in_row_order_and_retries_on_oom() -> None:
    model = _model()
    x, _ = _batch()
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller)
    with torch.no_grad(), inject_oom(model, phase="forward", calls=0):
        outputs = step.evaluate(x, model)
    assert [len(o) for o in outputs] == [5, 5]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outputs), model(x), rtol=1e-6, atol=1e-7)
    assert (controller.oom_count, controller.split_count) == (1, 2)


def test_evaluate_passes_other_errors_unchanged() -> None:
    def fn(mb: torch.Tensor) -> torch.Tensor:
        raise KeyError("not an OOM")

    controller = eb.SplitController()
    with pytest.raises(KeyError, match="not an OOM"):
        eb.ElasticStep(_model(), controller=controller).evaluate(torch.zeros(4, 4), fn)


def test_evaluate_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="the batch is empty"):
        eb.ElasticStep(_model()).evaluate(torch.zeros(0, 4), lambda mb: mb)
