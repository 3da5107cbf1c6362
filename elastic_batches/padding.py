"""Variable-length fields: padded once at collate time, trimmed per microbatch.

The rules (``docs/variable_length.md`` walks through them):

1. ``pad_values`` names the per-sample fields whose first dimension varies (token ids, labels,
   masks, audio frames) and the value to pad each with. Samples are mappings; the other fields
   go through the usual collate (the loader's ``collate_fn`` or torch's default).
2. In the worker, the samples of a batch are sorted by length, longest first (unless
   ``sort_by_length=False``), each padded field is padded to the batch's longest sample, and each
   sample's length is kept beside the batch (a sample's length is that of its longest padded
   field).
3. When the batch is cut, each microbatch's padded fields are sliced down to *that
   microbatch's* longest sample. Padding never depends on the split count, so a batch re-split
   at any count (a prefetched batch tagged before the count rose) stays as tight.
4. With :class:`ShapeBuckets`, the sliced length (and optionally the rows) is rounded up into a
   few buckets, for ``torch.compile``.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from elastic_batches.batch import ElasticBatch
from elastic_batches.buckets import ShapeBuckets
from elastic_batches.structures import Fields, flatten, slice_fields

__all__ = ["Padding", "check_pad_values", "collate_padded"]

PadValue = bool | int | float


def check_pad_values(pad_values: Mapping[Any, PadValue] | None) -> dict[Any, PadValue] | None:
    """Validate ``pad_values`` and return it as a plain ``dict`` (``None`` or empty: ``None``).

    Raises:
        TypeError: ``pad_values`` is not a mapping, or a pad value is not a number.

    Example:
        >>> from elastic_batches.padding import check_pad_values
        >>> check_pad_values({"input_ids": 0, "labels": -100})
        {'input_ids': 0, 'labels': -100}
    """
    if pad_values is None:
        return None
    if not isinstance(pad_values, Mapping):
        raise TypeError(
            f"pad_values must map field names to pad values, e.g. {{'input_ids': 0, 'labels': -100}}, "
            f"got {type(pad_values).__qualname__}"
        )
    for key, value in pad_values.items():
        if not isinstance(value, numbers.Number) or isinstance(value, complex):
            raise TypeError(f"pad_values[{key!r}] must be a number to pad the field with, got {value!r}")
    return dict(pad_values) or None


@dataclasses.dataclass(frozen=True)
class Padding:
    """Which fields of an :class:`ElasticBatch` are padded, with what, and each sample's lengths.

    Attributes:
        values: Field key of each padded field -> its pad value (``None``: not known, for a field
            a :class:`TrimPadding` collator padded; such a field is only ever cut, never
            extended). A padded field has the batch as first dimension and the varying length
            as second.
        lengths: Field key -> each row's length in that field, in batch order.
        buckets: Rounding of the microbatch shapes, or ``None`` for tight padding.

    Example:
        >>> import torch
        >>> from elastic_batches import Padding
        >>> ids = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
        >>> padding = Padding(values={"ids": 0}, lengths={"ids": (3, 2, 1)})
        >>> padding.row_lengths()
        [3, 2, 1]
        >>> padding.piece({"ids": ids}, 1, 3)["ids"].tolist()
        [[4, 5], [6, 0]]
    """

    values: Mapping[str, PadValue | None]
    lengths: Mapping[str, tuple[int, ...]]
    buckets: ShapeBuckets | None = None

    def row_lengths(self) -> list[int]:
        """Each row's length: the longest of its padded fields."""
        return [max(row) for row in zip(*self.lengths.values(), strict=True)]

    def piece(self, fields: Fields, start: int, stop: int) -> Fields:
        """Rows ``start:stop`` of the batch's ``fields`` with each padded field cut to their longest sample.

        The padded fields come back contiguous. With :attr:`buckets`, the length is rounded up
        (new positions hold the pad value) and so are the rows (new rows hold only pad values).

        Raises:
            ValueError: rows are rounded up but a field has no pad value.
        """
        part = slice_fields(fields, start, stop)
        rows = stop - start
        buckets = self.buckets
        target_rows = rows if buckets is None else buckets.round_rows(rows)
        padded = {}
        for key, value in self.values.items():
            tensor = part[key]
            longest = max(self.lengths[key][start:stop], default=0)
            width = longest if buckets is None else buckets.round_length(longest)
            if width <= tensor.shape[1]:
                tensor = tensor[:, :width].contiguous()
            elif value is None:
                raise ValueError(f"padded field {key!r} has no pad value to extend it to {width} positions with")
            else:
                extra = tensor.new_full((rows, width - tensor.shape[1], *tensor.shape[2:]), value)
                tensor = torch.cat([tensor, extra], dim=1)
            if target_rows > rows:
                if value is None:
                    raise ValueError(f"padded field {key!r} has no pad value to add rows with")
                tensor = torch.cat([tensor, tensor.new_full((target_rows - rows, *tensor.shape[1:]), value)])
            padded[key] = tensor
        if target_rows == rows:
            part.update(padded)
            return part
        unpadded = sorted(set(part) - set(padded))
        if unpadded:
            raise ValueError(
                f"ShapeBuckets(rows={buckets.rows!r}) pads whole rows, but fields {unpadded} have no pad value: "  # type: ignore[union-attr]
                "give every field a value in pad_values (its loss must ignore rows of pad values), "
                "or use ShapeBuckets(rows=None)"
            )
        return padded


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
        >>> from elastic_batches.padding import collate_padded
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
