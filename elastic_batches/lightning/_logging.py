"""``self.log`` inside a step that ``ElasticStep`` runs: straight through when whole, combined once when split.

A batch that runs as one microbatch logs as under the plain Trainer: ``self.log`` is Lightning's,
unchanged. Should that attempt run out of memory, what it logged is undone before the retry:
each entry of the loop's result collection is saved before the attempt first updates it
(copy-on-write, a shallow copy of a few attributes), and entries it created are removed.

A batch split into microbatches has its values combined. ``self.log`` is still Lightning's own,
so its checks (an invalid value, logging where Lightning forbids it, a torchmetrics metric that
is not an attribute) raise at the call, inside the step; only the result collection's ``log``
is replaced while the microbatch runs, by a recorder. When the batch completes, each name is
logged once into the result collection with the microbatch values combined:

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
    """Lets the ``self.log`` calls of one batch's microbatches through, or records and combines them.

    Args:
        module: The ``LightningModule`` whose ``log`` calls are handled.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self._records: dict[tuple[str, str], list[tuple[float, torch.Tensor | Any, dict[str, Any]]]] = {}
        self._weight = 1.0
        self._attempts = 0
        self._metrics = _MetricStates(module)
        self._results: Any = None  # the loop's _ResultCollection; None where logging is refused (predict)
        self._keys_before = 0  # entries of the result collection before the attempt
        self._saved: dict[str, dict[str, Any]] = {}  # entry -> its attributes before the attempt updated it

    def start_batch(self) -> None:
        """Forget everything recorded; save the metric states the batch starts from."""
        self._records.clear()
        self._attempts = 0
        self._saved.clear()
        self._metrics.save()

    def start_attempt(self) -> None:
        """A new attempt at the batch starts: undo what a failed one logged or recorded."""
        self._records.clear()
        if self._attempts:
            self._metrics.restore()
            self._undo()
        self._attempts += 1
        trainer = self.module._trainer
        self._results = None if trainer is None else trainer._results
        self._keys_before = 0 if self._results is None else len(self._results)

    def _undo(self) -> None:
        results = self._results
        if results is None:
            return
        for key in list(results)[self._keys_before :]:  # entries the failed attempt created (a dict keeps order)
            del results[key]
        for key, attributes in self._saved.items():
            if key in results:
                results[key].__dict__.update(attributes)
        self._saved.clear()

    @contextlib.contextmanager
    def capture(self, weight: float, *, split: bool) -> Iterator[None]:
        """Handle the module's ``log`` calls made inside the block, those of a microbatch of this weight.

        Args:
            weight: The microbatch's weight.
            split: Whether the batch runs as several microbatches (record and combine) or whole
                (log through, undoable).
        """
        results = self._results
        if results is None:
            yield  # Lightning's own log raises at the call where it refuses logging
            return
        self._weight = weight
        name, hook = ("log", self._record) if split else ("update_metrics", self._update)
        previous = results.__dict__.get(name)
        results.__dict__[name] = hook
        try:
            yield
        finally:
            if previous is None:
                results.__dict__.pop(name, None)
            else:
                results.__dict__[name] = previous

    def _update(self, key: str, value: Any, batch_size: int) -> None:
        """The result collection's ``update_metrics``, after saving the entry as it was before the attempt."""
        results = self._results
        if key not in self._saved:
            self._saved[key] = dict(results[key].__dict__)
        type(results).update_metrics(results, key, value, batch_size)

    def _record(self, fx: str, name: str, value: Any, **kwargs: Any) -> None:
        """The result collection's ``log``, called by ``LightningModule.log`` once its checks passed: recorded."""
        if not kwargs.get("enable_graph", False):
            value = _detached(value)
        self._records.setdefault((fx, name), []).append((self._weight, value, kwargs))

    def replay(self) -> None:
        """Log each recorded name once into the result collection, with the combination of its microbatch values."""
        results = self._results
        try:
            for (fx, name), records in self._records.items():
                kwargs = dict(records[0][2])
                values = [value for _, value, _ in records]
                sizes = [int(r[2]["batch_size"]) for r in records if r[2].get("batch_size") is not None]
                if len(sizes) == len(records):
                    weights = [float(size) for size in sizes]
                    if len(records) > 1:
                        kwargs["batch_size"] = sum(sizes)
                else:
                    weights = [weight for weight, _, _ in records]
                combined = _combine_values(values, weights, kwargs.get("reduce_fx", "mean"))
                results.log(fx, name, combined, **kwargs)
        finally:
            self._records.clear()
