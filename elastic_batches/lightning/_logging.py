"""``self.log`` inside a split step: recorded per microbatch, logged once per batch with the full-batch value.

While a batch runs as microbatches, the module's ``log`` is replaced by a recorder (an instance
attribute, removed afterwards). When the batch completes, each name is logged once, through the
module's own ``log``, with the microbatch values combined:

* ``reduce_fx="mean"`` (the default): the weighted mean with the microbatches' weights (their
  share of rows, or of counted items); with ``batch_size=`` given on every call, weighted by
  those sizes and logged with their sum;
* ``"sum"``: summed; ``"max"`` / ``"min"``: the largest / smallest; any other callable: applied
  to the stacked microbatch values;
* a ``torchmetrics.Metric`` object: logged once (its state accumulated every microbatch).

An attempt that ran out of memory leaves nothing behind: its records are dropped, and the
state of the module's ``torchmetrics`` metrics is restored to what it was before the batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from elastic_batches.lightning._outputs import weighted_mean

__all__ = ["LogRecorder"]

try:  # torchmetrics ships with Lightning, but it is an optional dependency of it
    from torchmetrics import Metric
except ImportError:  # pragma: no cover - exercised only without torchmetrics
    Metric = None  # type: ignore[assignment,misc]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduction(reduce_fx: Any) -> Any:
    if isinstance(reduce_fx, str):
        return _REDUCTIONS.get(reduce_fx.lower(), reduce_fx)
    for name in ("mean", "sum", "max", "min"):
        if reduce_fx is getattr(torch, name):
            return name
    return reduce_fx


def _combine_values(values: list[Any], weights: list[float], reduce_fx: Any) -> Any:
    if len(values) == 1:
        return values[0]
    if isinstance(values[0], dict):
        return {key: _combine_values([v[key] for v in values], weights, reduce_fx) for key in values[0]}
    if Metric is not None and isinstance(values[-1], Metric):
        return values[-1]
    tensors = [torch.as_tensor(v).detach() for v in values]
    how = _reduction(reduce_fx)
    if how == "mean":
        return weighted_mean(tensors, weights)
    stacked = torch.stack(tensors)
    if how == "sum":
        return stacked.sum(0)
    if how == "max":
        return stacked.max(0).values
    if how == "min":
        return stacked.min(0).values
    return how(stacked)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {key: _detached(v) for key, v in value.items()}
    return value


class _MetricStates:
    """The states of the module's ``torchmetrics`` metrics, saved before a batch and restored before a retry."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.metrics = [] if Metric is None else [m for m in module.modules() if isinstance(m, Metric)]
        self.saved: list[tuple[dict[str, Any], int]] | None = None

    def save(self) -> None:
        self.saved = [(m._copy_state_dict(), m._update_count) for m in self.metrics] if self.metrics else None

    def restore(self) -> None:
        if self.saved is None:
            return
        for metric, (states, count) in zip(self.metrics, self.saved, strict=True):
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count = count
            metric._computed = None
        self.save()  # a second retry restores the same point again


class LogRecorder:
    """Records ``self.log`` calls of the microbatches of one batch, and logs their combination once.

    Args:
        module: The ``LightningModule`` whose ``log`` calls are recorded.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self._records: dict[str, list[tuple[float, str | None, dict[str, Any]]]] = {}
        self._weight = 1.0
        self._attempts = 0
        self._metrics = _MetricStates(module)

    def start_batch(self) -> None:
        """Forget everything recorded; save the metric states the batch starts from."""
        self._records.clear()
        self._attempts = 0
        self._metrics.save()

    def start_attempt(self) -> None:
        """A new attempt at the batch starts: drop what a failed one recorded and restore the metrics."""
        self._records.clear()
        if self._attempts:
            self._metrics.restore()
        self._attempts += 1

    @contextlib.contextmanager
    def capture(self, weight: float) -> Iterator[None]:
        """Record the module's ``log`` calls made inside the block, as those of a microbatch of this weight."""
        self._weight = weight
        module = self.module
        previous = module.__dict__.get("log")
        module.__dict__["log"] = self._record
        try:
            yield
        finally:
            if previous is None:
                module.__dict__.pop("log", None)
            else:
                module.__dict__["log"] = previous

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        if not arguments.get("enable_graph", False):
            arguments["value"] = _detached(value)
        self._records.setdefault(name, []).append((self._weight, self.module._current_fx_name, arguments))

    def replay(self) -> None:
        """Log each recorded name once, with the combination of its microbatch values."""
        module = self.module
        previous_fx = module._current_fx_name
        try:
            for records in self._records.values():
                arguments = dict(records[0][2])
                values = [r[2]["value"] for r in records]
                sizes = [int(r[2]["batch_size"]) for r in records if r[2].get("batch_size") is not None]
                if len(sizes) == len(records):
                    weights = [float(size) for size in sizes]
                    if len(records) > 1:
                        arguments["batch_size"] = sum(sizes)
                else:
                    weights = [r[0] for r in records]
                arguments["value"] = _combine_values(values, weights, arguments.get("reduce_fx", "mean"))
                module._current_fx_name = records[0][1]
                module.log(**arguments)
        finally:
            module._current_fx_name = previous_fx
            self._records.clear()
