"""Putting the outputs of a batch's microbatches back together as the unsplit step would have returned them.

The rules, applied recursively (documented in ``docs/lightning.md``):

* one microbatch: its output, untouched;
* a tensor whose first dimension is the microbatch's rows: concatenated in row order;
  a list with one element per row: concatenated;
* a floating scalar (0-dim tensor or ``float``): a mean over the microbatch, combined with the
  microbatches' weights (rows, or counted items); an integer scalar: a count, summed;
* a tensor of the same shape in every microbatch (a per-class vector, say): weighted mean;
* mappings and tuples (named tuples included): combined key by key, element by element;
* ``None`` everywhere: ``None``; anything else: the list of the microbatch outputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["combine_outputs", "weighted_mean"]


def weighted_mean(values: Sequence[torch.Tensor | float], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w * v) / sum(w)``, computed in float64 and returned in the first value's floating dtype.

    Example:
        >>> import torch
        >>> from elastic_batches.lightning._outputs import weighted_mean
        >>> weighted_mean([torch.tensor(1.0), torch.tensor(4.0)], [0.75, 0.25])
        tensor(1.7500)
    """
    tensors = [torch.as_tensor(v).detach() for v in values]
    dtype = tensors[0].dtype if tensors[0].is_floating_point() else torch.get_default_dtype()
    total = float(sum(weights))
    stacked = torch.stack([t.to(torch.float64) for t in tensors])
    w = torch.tensor(weights, dtype=torch.float64, device=stacked.device).view(-1, *([1] * (stacked.dim() - 1)))
    return ((stacked * w).sum(0) / (total if total else 1.0)).to(dtype)


def _rows_leading(value: Any, rows: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1 and value.shape[0] == rows
    return isinstance(value, list) and len(value) == rows


def combine_outputs(outputs: Sequence[Any], weights: Sequence[float], rows: Sequence[int]) -> Any:
    """Combine the outputs of a batch's microbatches, by the rules of this module.

    Args:
        outputs: One output per microbatch, in row order.
        weights: Each microbatch's weight (its share of the batch's mean).
        rows: Each microbatch's rows.

    Example:
        >>> import torch
        >>> from elastic_batches.lightning._outputs import combine_outputs
        >>> out = combine_outputs(
        ...     [
        ...         {"pred": torch.zeros(2), "loss": torch.tensor(1.0)},
        ...         {"pred": torch.ones(1), "loss": torch.tensor(4.0)},
        ...     ],
        ...     weights=[2 / 3, 1 / 3],
        ...     rows=[2, 1],
        ... )
        >>> out["pred"], out["loss"]
        (tensor([0., 0., 1.]), tensor(2.))
    """
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if all(o is None for o in outputs):
        return None
    if all(isinstance(o, torch.Tensor) for o in outputs):
        if all(_rows_leading(o, n) for o, n in zip(outputs, rows, strict=True)):
            return torch.cat(list(outputs))
        if all(o.dim() == 0 for o in outputs) and not first.is_floating_point():
            return torch.stack(list(outputs)).sum(0)
        if all(o.shape == first.shape for o in outputs):
            return weighted_mean(outputs, weights)
        return list(outputs)
    if all(isinstance(o, bool) for o in outputs):
        return list(outputs)
    if all(isinstance(o, numbers.Integral) for o in outputs):
        return sum(outputs)
    if all(isinstance(o, numbers.Real) for o in outputs):
        return float(weighted_mean([float(o) for o in outputs], weights))
    if all(isinstance(o, Mapping) for o in outputs) and all(o.keys() == first.keys() for o in outputs):
        combined = {key: combine_outputs([o[key] for o in outputs], weights, rows) for key in first}
        try:
            return type(first)(combined)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be built from a dict
            return combined
    if all(isinstance(o, list) for o in outputs) and all(
        _rows_leading(o, n) for o, n in zip(outputs, rows, strict=True)
    ):
        return [item for o in outputs for item in o]
    if all(isinstance(o, tuple) and type(o) is type(first) and len(o) == len(first) for o in outputs):
        parts = [combine_outputs([o[i] for o in outputs], weights, rows) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else tuple(parts)
    return list(outputs)
