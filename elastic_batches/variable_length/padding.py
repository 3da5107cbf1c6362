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

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from elastic_batches.structures import Fields, slice_fields
from elastic_batches.variable_length.shape_buckets import ShapeBuckets

__all__ = ["Padding", "PadValue", "check_pad_values"]

PadValue = bool | int | float


def check_pad_values(pad_values: Mapping[Any, PadValue] | None) -> dict[Any, PadValue] | None:
    """Validate ``pad_values`` and return it as a plain ``dict`` (``None`` or empty: ``None``).

    Raises:
        TypeError: ``pad_values`` is not a mapping, or a pad value is not a number.

    Example:
        >>> from elastic_batches.variable_length.padding import check_pad_values
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
        >>> from elastic_batches.variable_length.padding import Padding
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
