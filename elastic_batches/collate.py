"""The elastic collate: runs in DataLoader workers and turns each batch into an ``ElasticBatch``.

It calls the user's ``collate_fn`` (or torch's default collate, extended with the functions
given to :func:`register_collate`) and wraps the result in a deferred :class:`ElasticBatch`:
it crosses from a worker to the main process as the plain loader's batch would, and is taken
apart with the batch-type registry when the step first cuts it. With ``pad_values`` it first
pads the variable-length fields (see :mod:`elastic_batches.variable_length.padding`). It
pickles both registries along, so that registrations made in ``__main__`` apply in workers
started with ``spawn`` (registrations whose functions cannot be pickled, such as lambdas, stay
behind: use module-level functions with ``spawn``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data._utils.collate import collate, default_convert

from elastic_batches import registry
from elastic_batches.batch import ElasticBatch
from elastic_batches.registry import register_collate
from elastic_batches.structures import flatten
from elastic_batches.variable_length.padding import Padding, PadValue, check_pad_values
from elastic_batches.variable_length.shape_buckets import ShapeBuckets
from elastic_batches.variable_length.trim import TrimPadding

__all__ = ["ElasticCollate", "collate_padded", "register_collate"]


class ElasticCollate:
    """A picklable collate function that returns :class:`ElasticBatch` objects.

    Args:
        collate_fn: The user's collate function; ``None``: torch's default collate (or
            ``default_convert`` without automatic batching), extended by :func:`register_collate`.
            A collate function that pads itself (Hugging Face's collators) is kept by wrapping
            it in :class:`TrimPadding`, instead of giving ``pad_values``.
        auto_collation: ``False`` when the DataLoader's dataset yields whole batches
            (``batch_size=None``).
        pad_values: Names the per-sample fields of varying length and the value to pad each
            with: they are padded to the batch's longest sample, and each microbatch is later cut
            to its own (see :func:`collate_padded`). Samples must then
            be mappings; the other fields go through ``collate_fn``. ``None``: no padding.
        sort_by_length: With ``pad_values``, sort each batch's samples longest first, so that
            microbatches hold samples of similar length (default ``True``).
        shape_buckets: With ``pad_values``, round microbatch shapes up for ``torch.compile``.

    Raises:
        TypeError: ``collate_fn`` is not callable, or ``pad_values`` is not a mapping of numbers.
        ValueError: ``pad_values`` without automatic batching or with a :class:`TrimPadding`
            ``collate_fn``, or ``shape_buckets`` without ``pad_values``.

    Example:
        >>> import torch
        >>> from elastic_batches import ElasticCollate
        >>> batch = ElasticCollate()([{"x": torch.zeros(3), "y": 0}, {"x": torch.ones(3), "y": 1}])
        >>> batch.unwrap()["y"]
        tensor([0, 1])
        >>> padded = ElasticCollate(pad_values={"ids": 0})([{"ids": [5]}, {"ids": [6, 7]}])
        >>> padded.unwrap()["ids"]
        tensor([[6, 7],
                [5, 0]])
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        auto_collation: bool = True,
        pad_values: Mapping[Any, PadValue] | None = None,
        sort_by_length: bool = True,
        shape_buckets: ShapeBuckets | None = None,
    ) -> None:
        if isinstance(collate_fn, ElasticCollate):
            collate_fn = collate_fn.collate_fn
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"ElasticCollate: collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn: Callable[[list[Any]], Any] | None = collate_fn
        self.auto_collation = auto_collation
        self.pad_values = check_pad_values(pad_values)
        self.sort_by_length = bool(sort_by_length)
        if shape_buckets is not None and not isinstance(shape_buckets, ShapeBuckets):
            raise TypeError(
                f"ElasticCollate: shape_buckets must be an elastic_batches.ShapeBuckets, got {shape_buckets!r}"
            )
        self.shape_buckets = shape_buckets
        if self.pad_values is not None and isinstance(collate_fn, TrimPadding):
            raise ValueError(
                "pad_values pads the samples itself, TrimPadding keeps the collate function that pads: give one of "
                "them (TrimPadding(collate_fn, pad_values=...) takes pad values of its own)"
            )
        if self.pad_values is not None and not auto_collation:
            raise ValueError(
                "pad_values needs automatic batching: give the loader a batch_size (it has batch_size=None, "
                "so the dataset yields whole batches; pad them in the dataset instead)"
            )
        if shape_buckets is not None and self.pad_values is None:
            raise ValueError("shape_buckets rounds padded shapes up: it needs pad_values={field: pad value}")

    def _collate(self, samples: Any) -> Any:
        if self.collate_fn is not None:
            return self.collate_fn(samples)
        if self.auto_collation:
            try:
                return collate(samples, collate_fn_map=registry.collate_fn_map())
            except RuntimeError as err:
                if "stack expects each tensor to be equal size" not in str(err):
                    raise
                raise RuntimeError(
                    f"MicrobatchingDataLoader: the samples hold tensors of different lengths, which the default "
                    f"collate cannot stack ({err}). Pad them per microbatch with pad_values={{field: pad value}} "
                    "(e.g. pad_values={'input_ids': 0, 'labels': -100}), or give a collate_fn that pads, wrapped "
                    "in elastic_batches.TrimPadding"
                ) from err
        return default_convert(samples)

    def __call__(self, samples: Any) -> ElasticBatch:
        if self.pad_values is not None:
            return collate_padded(
                samples,
                self.pad_values,
                collate_rest=self._collate,
                sort_by_length=self.sort_by_length,
                buckets=self.shape_buckets,
            )
        return ElasticBatch.deferred(self._collate(samples))  # taken apart on first use, if ever

    def __getstate__(self) -> dict[str, Any]:
        return {
            "collate_fn": self.collate_fn,
            "auto_collation": self.auto_collation,
            "pad_values": self.pad_values,
            "sort_by_length": self.sort_by_length,
            "shape_buckets": self.shape_buckets,
            "registries": registry.snapshot(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        registry.install(state["registries"])
        self.collate_fn = state["collate_fn"]
        self.auto_collation = state["auto_collation"]
        self.pad_values = state["pad_values"]
        self.sort_by_length = state["sort_by_length"]
        self.shape_buckets = state["shape_buckets"]


def collate_padded(
    samples: Sequence[Any],
    pad_values: Mapping[Any, PadValue],
    *,
    collate_rest: Callable[[list[Any]], Any],
    sort_by_length: bool = True,
    buckets: ShapeBuckets | None = None,
) -> ElasticBatch:
    """Collate mapping samples whose ``pad_values`` fields vary in length into an ``ElasticBatch``.

    Args:
        samples: The batch's samples, each a mapping holding every ``pad_values`` key.
        pad_values: Field name -> pad value.
        collate_rest: Collates the samples without their padded fields (the loader's
            ``collate_fn`` or the default collate); it must return a mapping.
        sort_by_length: Sort the samples longest first, so that each microbatch holds samples of
            similar length.
        buckets: Rounding of microbatch shapes for ``torch.compile``.

    Returns:
        An :class:`ElasticBatch` whose user structure is a dict: padded fields (dense, padded to
        the batch's longest sample) and the other fields, in the samples' key order.

    Raises:
        TypeError: a sample is not a mapping, ``collate_rest`` returned something else, or a
            padded value is not a sequence of numbers.
        KeyError: a sample lacks a padded field.
        ValueError: samples of one field differ in their trailing dimensions or dtypes.

    Example:
        >>> import torch
        >>> from torch.utils.data import default_collate
        >>> from elastic_batches.collate import collate_padded
        >>> samples = [{"ids": torch.tensor([1]), "y": 0}, {"ids": torch.tensor([2, 3, 4]), "y": 1}]
        >>> batch = collate_padded(samples, {"ids": 0}, collate_rest=default_collate)
        >>> batch.unwrap()  # longest first
        {'ids': tensor([[2, 3, 4],
                [1, 0, 0]]), 'y': tensor([1, 0])}
        >>> [mb.unwrap()["ids"].tolist() for mb in batch.microbatches(2)]
        [[[2, 3, 4]], [[1]]]
    """
    samples = list(samples)
    for index, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"pad_values needs samples that are mappings of fields (dicts), but sample {index} is a "
                f"{type(sample).__qualname__}: return dicts from the dataset, or drop pad_values"
            )
        missing = [key for key in pad_values if key not in sample]
        if missing:
            raise KeyError(
                f"sample {index} has no field(s) {missing} named in pad_values; its fields are {list(sample.keys())}"
            )
    sequences = {key: [_as_sequence(s[key], key, i) for i, s in enumerate(samples)] for key in pad_values}
    lengths = {key: [t.shape[0] for t in seqs] for key, seqs in sequences.items()}
    if sort_by_length and len(samples) > 1:
        row_lengths = [max(row) for row in zip(*lengths.values(), strict=True)]
        order = sorted(range(len(samples)), key=lambda i: -row_lengths[i])
        samples = [samples[i] for i in order]
        sequences = {key: [seqs[i] for i in order] for key, seqs in sequences.items()}
        lengths = {key: [values[i] for i in order] for key, values in lengths.items()}
    padded = {key: _pad(key, seqs, pad_values[key]) for key, seqs in sequences.items()}
    rest = collate_rest([{k: v for k, v in s.items() if k not in pad_values} for s in samples])
    if type(rest) is dict:
        merged: Any = {k: padded[k] if k in padded else rest[k] for k in samples[0] if k in padded or k in rest}
        merged.update((k, v) for k, v in rest.items() if k not in merged)
    elif isinstance(rest, MutableMapping):
        merged = copy.copy(rest)
        merged.update(padded)
    else:
        raise TypeError(
            f"with pad_values, collate_fn must return a mapping of the samples' other fields, got "
            f"{type(rest).__qualname__}: return a dict, or drop pad_values and pad in collate_fn"
        )
    fields, spec, _ = flatten(merged)
    padding = Padding(
        values={str(key): value for key, value in pad_values.items()},
        lengths={str(key): tuple(values) for key, values in lengths.items()},
        buckets=buckets,
    )
    return ElasticBatch.from_fields(fields, spec, padding=padding)


def _as_sequence(value: Any, key: Any, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"sample {index}: padded field {key!r} holds a {type(value).__qualname__}; pad_values fields must be "
                "tensors, arrays or lists of numbers whose first dimension varies"
            ) from err
    if tensor.dim() == 0:
        raise ValueError(
            f"sample {index}: padded field {key!r} is a scalar; pad_values fields must have at least one dimension "
            "(the one whose length varies): remove it from pad_values"
        )
    return tensor


def _pad(key: Any, sequences: list[torch.Tensor], value: PadValue) -> torch.Tensor:
    first = sequences[0]
    for index, tensor in enumerate(sequences):
        if tensor.shape[1:] != first.shape[1:] or tensor.dtype != first.dtype:
            raise ValueError(
                f"padded field {key!r}: sample {index} has trailing shape {tuple(tensor.shape[1:])} and dtype "
                f"{tensor.dtype}, the first sample {tuple(first.shape[1:])} and {first.dtype}; only the first "
                "dimension may vary"
            )
    return pad_sequence(sequences, batch_first=True, padding_value=value)
